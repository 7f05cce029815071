"""Score a checkpoint's policy in the env it was trained on: mean return and length over whole episodes.

    make eval CKPT=runs/cartpole/2026-01-01_12-00-00/model_100.pt
    python -m ppo.evaluate runs/cartpole/.../model_100.pt --episodes 100 --num-envs 10 [--stochastic]
    make eval CKPT=runs/isaaclab/.../model_5000.pt PRESET=isaaclab ARGS='--env.launcher-args="--viz kit"'

The env is built as training builds it (envs.make_env from the run's saved env settings, the tracking motion library
from the run's shared env seed: the motions the policy learned), on the CPU; an Isaac Lab checkpoint on the first
GPU, through the same adapter and Isaac Lab launcher, in Isaac Lab's environment (PRESET=isaaclab); --env.task,
--env.task-overrides and --env.launcher-args replace the run's settings where its env takes them. The policy acts
with its mean action unless --stochastic samples it. Each env's first episode is not counted (the envs start theirs
part-way through the time limit, as in training); every env then counts the same number of whole episodes, so that
short episodes are not over-represented by envs that finish sooner. No communication.
"""

import argparse
import dataclasses
import math
import os
import sys
import time
import types

if __name__ == "__main__" and not __package__:  # `python ppo/evaluate.py`: import from the repository, as -m does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from configs.config import EnvConfig  # noqa: E402
from configs.resume import shared_env_seed  # noqa: E402
from envs import make_env  # noqa: E402
from envs.base import MissingSimulator  # noqa: E402
from ppo.export import check_ckpt_path, policy_and_entries  # noqa: E402

PROGRESS_S = 5.0    # at most one progress line this often


# Settings typed for an evaluation, replacing the run's: which envs take each (another task: e.g. a task's Play
# variant; other task-config overrides or launcher flags: another physics preset, a viewer).
TYPED = {"task": ("--env.task", ("gymnasium", "isaaclab")),
         "task_overrides": ("--env.task-overrides", ("isaaclab",)),
         "launcher_args": ("--env.launcher-args", ("isaaclab",))}


def saved_env(config: dict, path: str, num_envs: int, typed: dict | None = None) -> EnvConfig:
    """The run's env settings as an EnvConfig with `num_envs` envs (settings this version does not know are dropped,
    those it added take their defaults; lists back to tuples, as JSON and torch.save give them), with the `typed`
    ones of TYPED (name -> value) in place of the run's."""
    env = config.get("env")
    if not isinstance(env, dict):
        raise ValueError(f"CKPT {path!r}: its config has no 'env' settings (saved by another version?)")
    known = {f.name for f in dataclasses.fields(EnvConfig)}
    cfg = EnvConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in env.items() if k in known})
    for name, value in (typed or {}).items():
        flag, envs = TYPED[name]
        if cfg.name not in envs:
            raise ValueError(f"{flag} is for {' and '.join(envs)} checkpoints, but CKPT {path!r} trained on "
                             f"{cfg.name}: leave the flag out")
        setattr(cfg, name, tuple(value) if isinstance(value, list) else value)
    cfg.num_envs, cfg.global_num_envs = num_envs, 0
    return cfg


def evaluate(path: str, episodes: int = 100, num_envs: int = 10, seed: int = 0, stochastic: bool = False,
             progress=print, typed: dict | None = None) -> dict:
    """Run the checkpoint's policy until each of `num_envs` envs has finished ceil(episodes / num_envs) whole
    episodes after its first; returns {"episodes", "return_mean", "return_std", "return_min", "return_max",
    "length_mean", "length_std"} over them (population std). `seed`: the envs' resets and --stochastic's draws;
    `typed`: env settings in place of the run's (saved_env). An Isaac Lab env is left open: its runtime (Kit)
    closes at the process's exit, ending the process."""
    for name, value, low, high in (("--episodes", episodes, 1, None), ("--num-envs", num_envs, 1, None),
                                   ("--seed", seed, 0, 2**32)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low or high and value >= high:
            raise ValueError(f"{name} must be an integer in [{low}, {high or 'inf'}), got {value!r}")
    check_ckpt_path(path)
    model, state = policy_and_entries(path, "evaluate")
    cfg = saved_env(state["config"], path, num_envs, typed)
    torch.manual_seed(seed)                  # Gaussian.sample draws from the global generator
    # Isaac Lab simulates on a GPU only (the adapter says so on a machine without one); the rest on the CPU.
    gpu = cfg.name == "isaaclab" and torch.cuda.is_available()
    try:
        env = make_env(cfg, torch.device("cuda", 0) if gpu else torch.device("cpu"), seed,
                       shared_env_seed(types.SimpleNamespace(seed=seed), state))
    except MissingSimulator as exc:      # gymnasium or Isaac Lab not installed here: the message says what to install
        where = "; make eval CKPT=... PRESET=isaaclab runs it there" if cfg.name == "isaaclab" else ""
        raise ValueError(f"{exc}{where}") from None
    model.to(env.device)
    label = " ".join(filter(None, (cfg.name, cfg.task)))      # "cartpole", "gymnasium Hopper-v4"
    sizes = {"actor observation": (model.actor[0].in_features, env.obs_dims["policy"]),
             "action": (model.log_std.shape[0], env.num_actions)}
    wrong = [f"{what} size {mine} (the env's: {theirs})" for what, (mine, theirs) in sizes.items() if mine != theirs]
    if wrong:     # the policy's first layer would fail on the env's observations with a shape error's traceback
        why = ("the settings typed here build an env of other sizes" if typed else
               "another env's checkpoint, or one saved by another version of the env?")
        raise ValueError(f"CKPT {path!r}: its policy's {' and '.join(wrong)} does not fit the {label} env built "
                         f"from its config ({why})")
    limit = env.max_episode_length
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"CKPT {path!r}: its env ({label}) has no time limit (max_episode_length "
                         f"{limit!r}), so an episode may never end; evaluate it with your own loop (docs/export.md)")
    quota = math.ceil(episodes / num_envs)
    returns, lengths = torch.zeros(num_envs, device=env.device), torch.zeros(num_envs, dtype=torch.long,
                                                                             device=env.device)
    finished = torch.zeros_like(lengths)   # episodes ended, the uncounted first one included
    counted_returns, counted_lengths = [], []
    obs, _ = env.reset()
    started = shown = time.monotonic()
    with torch.no_grad():
        for _ in range((quota + 1) * limit):     # every episode ends by the time limit: each env reaches its quota
            policy = model.distribution(obs["policy"])
            obs, reward, terminated, truncated, _ = env.step(policy.sample() if stochastic else policy.mean)
            returns += reward
            lengths += 1
            done = terminated | truncated
            counted = done & (finished >= 1) & (finished <= quota)
            counted_returns += returns[counted].tolist()
            counted_lengths += lengths[counted].tolist()
            finished += done.long()
            returns[done], lengths[done] = 0.0, 0
            if bool((finished > quota).all()):
                break
            if time.monotonic() - shown > PROGRESS_S:
                shown = time.monotonic()
                progress(f"[eval] {len(counted_returns)}/{quota * num_envs} episodes, {shown - started:.0f} s")
    cap = f"the step cap, {(quota + 1) * limit} steps ({quota + 1} time limits of {limit} steps)"
    if not counted_returns:     # an env whose episodes outlast its max_episode_length
        raise ValueError(f"CKPT {path!r}: no env finished an episode after its first within {cap}: does the "
                         f"{label} env end its episodes at its max_episode_length?")
    if len(counted_returns) < quota * num_envs:
        progress(f"[eval] note: {cap} reached with {len(counted_returns)} of {quota * num_envs} episodes finished; "
                 f"scoring those")
    r, n = torch.tensor(counted_returns, dtype=torch.float64), torch.tensor(counted_lengths, dtype=torch.float64)
    return {"episodes": len(counted_returns), "return_mean": r.mean().item(), "return_std": r.std(correction=0).item(),
            "return_min": r.min().item(), "return_max": r.max().item(), "length_mean": n.mean().item(),
            "length_std": n.std(correction=0).item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt", help="a checkpoint written by train.py (model_<iteration>.pt)")
    parser.add_argument("--episodes", type=int, default=100, help="whole episodes to score, at least (a multiple "
                        "of --num-envs: each env scores the same number)")
    parser.add_argument("--num-envs", type=int, default=10, help="envs stepped side by side")
    parser.add_argument("--seed", type=int, default=0, help="seed of the envs' resets and of --stochastic's draws")
    parser.add_argument("--stochastic", action="store_true", help="sample actions (default: the mean action)")
    parser.add_argument("--env.task", dest="task", help="gymnasium, Isaac Lab: this task instead of the run's (a "
                        "variant of it: the sizes must fit the policy)")
    parser.add_argument("--env.task-overrides", dest="task_overrides", nargs="*", help="Isaac Lab: these task-config "
                        "overrides instead of the run's (e.g. physics=newton_mjwarp)")
    parser.add_argument("--env.launcher-args", dest="launcher_args", help="Isaac Lab: the launcher's flags instead "
                        "of the run's, written with = (--env.launcher-args=\"--viz kit\")")
    args = parser.parse_args()
    typed = {name: getattr(args, name) for name in TYPED if getattr(args, name) is not None}
    try:
        scores = evaluate(args.ckpt, args.episodes, args.num_envs, args.seed, args.stochastic, typed=typed)
    except ValueError as exc:
        # Where an exit handler looks for the status: Isaac Lab's Kit, if started, ends the process with it.
        sys.last_exc = sys.last_value = SystemExit(2)
        parser.exit(2, f"error: {exc}\n")
    print(f"{scores['episodes']} episodes ({args.num_envs} envs, {'stochastic' if args.stochastic else 'mean action'}"
          f"): return {scores['return_mean']:.2f} +- {scores['return_std']:.2f} (min {scores['return_min']:.2f}, max "
          f"{scores['return_max']:.2f}), length {scores['length_mean']:.1f} +- {scores['length_std']:.1f} steps")


if __name__ == "__main__":
    main()
