"""Environments behind one VecEnv protocol (see envs/base.py); `make_env` builds one from an EnvConfig."""

import torch

from envs.base import VecEnv
from envs.cartpole import CartPole
from envs.gymnasium import GymnasiumEnv
from envs.isaaclab import IsaacLabEnv
from envs.tracking import Tracking


def make_env(cfg, device: torch.device, seed: int, base_seed: int) -> VecEnv:
    """Build the configured env on `device`. `seed` is per rank; `base_seed` is shared (motion library)."""
    if cfg.name == "cartpole":
        return CartPole(cfg.num_envs, device, seed, cfg.episode_length_s)
    if cfg.name == "tracking":
        return Tracking(cfg.num_envs, device, seed, base_seed, cfg.episode_length_s, cfg.num_motions,
                        cfg.sampling_uniform_floor)
    if cfg.name == "gymnasium":
        return GymnasiumEnv(cfg.task, cfg.num_envs, device, seed, cfg.action_scale, cfg.action_clip)
    if cfg.name == "isaaclab":
        return IsaacLabEnv(cfg.task, cfg.num_envs, device, seed, cfg.actor_obs_groups, cfg.critic_obs_groups,
                           cfg.action_scale, cfg.action_clip, cfg.launcher_args, cfg.task_overrides)
    # --env.name passed the parser (its Literal) or a preset set it: a new env lacks its branch here.
    raise ValueError(f"unknown --env.name {cfg.name!r}: make_env (envs/__init__.py) builds cartpole, tracking, "
                     f"gymnasium or isaaclab; an env of your own needs a branch there (docs/design.md, "
                     f"\"Adding an env of your own\")")


__all__ = ["VecEnv", "CartPole", "Tracking", "GymnasiumEnv", "IsaacLabEnv", "make_env"]
