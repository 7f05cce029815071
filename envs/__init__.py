"""Environments behind one VecEnv protocol (see envs/base.py); `make_env` builds one from an EnvConfig."""

import torch

from envs.base import VecEnv
from envs.cartpole import CartPole
from envs.tracking import Tracking


def make_env(cfg, device: torch.device, seed: int, base_seed: int) -> VecEnv:
    """Build the configured env on `device`. `seed` is per rank; `base_seed` is shared (motion library)."""
    if cfg.name == "cartpole":
        return CartPole(cfg.num_envs, device, seed, cfg.episode_length_s)
    if cfg.name == "tracking":
        return Tracking(cfg.num_envs, device, seed, base_seed, cfg.episode_length_s, cfg.num_motions,
                        cfg.sampling_uniform_floor)
    raise ValueError(f"unknown --env.name {cfg.name!r}; choose cartpole or tracking")


__all__ = ["VecEnv", "CartPole", "Tracking", "make_env"]
