"""Full training loop throughput: syncppo vs RSL-RL on the same env, batch, network and PPO settings.

    python bench/bench_train.py [--preset tracking] [--iterations 30] [--num-envs 512]

Runs, one after the other in this process (so the machine is the same for both):
  1. syncppo `train.main` at world size 1;
  2. RSL-RL's OnPolicyRunner (rsl-rl-lib, installed by `make bench`) at world size 1, wrapping the
     same embedded env, with the same T, N, epochs, minibatches, network, LR schedule and losses;
  3. syncppo at 2 ranks through torchrun (RSL-RL's multi-GPU path needs CUDA, so it has no CPU
     counterpart), for the scaling column.
Per-iteration collection and learning times are read back from each run's TensorBoard events and the
first `--warmup` iterations are dropped. Prints env-steps/s, update time per iteration and ratios.
"""

import argparse
import contextlib
import glob
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from configs import preset  # noqa: E402
from envs import make_env  # noqa: E402


def perf_from_events(log_dir: str, collect_tag: str, learn_tag: str, warmup: int) -> tuple[float, float]:
    """Median collection and learning seconds per iteration from a TensorBoard run, after `warmup`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    (events,) = glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)[:1]
    acc = EventAccumulator(events)
    acc.Reload()
    collect = sorted(e.value for e in acc.Scalars(collect_tag)[warmup:])
    learn = sorted(e.value for e in acc.Scalars(learn_tag)[warmup:])
    return collect[len(collect) // 2], learn[len(learn) // 2]


def run_syncppo(cfg, log_root: str, warmup: int) -> tuple[float, float]:
    cfg.log.root, cfg.log.print_every, cfg.log.save_every = log_root, 10**6, 10**6
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        train.main(cfg)
    return perf_from_events(log_root, "Perf/collection_time", "Perf/learning_time", warmup)


class RslRlEnv:
    """Our VecEnv seen through RSL-RL's interface: TensorDict observations, dones, extras['time_outs']."""

    def __init__(self, env):
        from tensordict import TensorDict
        self.env, self.TensorDict = env, TensorDict
        self.num_envs, self.num_actions, self.device = env.num_envs, env.num_actions, env.device
        self.max_episode_length, self.cfg = env.max_episode_length, {}
        self.episode_length_buf = torch.zeros(env.num_envs, dtype=torch.long)
        self.obs, _ = env.reset()

    def get_observations(self):
        return self.TensorDict(self.obs, batch_size=[self.num_envs])

    def step(self, actions):
        self.obs, reward, terminated, truncated, extras = self.env.step(actions)
        log = {f"/{k}": v for k, v in extras["log"].items()}
        return self.get_observations(), reward, terminated | truncated, {"time_outs": truncated, "log": log}


def run_rsl_rl(cfg, log_root: str, warmup: int) -> tuple[float, float]:
    from rsl_rl.runners import OnPolicyRunner
    torch.manual_seed(cfg.seed)
    env = RslRlEnv(make_env(cfg.env, torch.device("cpu"), seed=cfg.seed, base_seed=cfg.seed))
    p, policy = cfg.ppo, cfg.policy
    train_cfg = {
        "num_steps_per_env": p.num_steps, "save_interval": 10**6, "obs_groups": {"actor": ["policy"], "critic": ["critic"]},
        "algorithm": {"class_name": "PPO", "num_learning_epochs": p.num_epochs, "num_mini_batches": p.num_mini_batches,
                      "clip_param": p.clip_param, "gamma": p.gamma, "lam": p.lam, "value_loss_coef": p.value_loss_coef,
                      "entropy_coef": p.entropy_coef, "learning_rate": p.learning_rate, "max_grad_norm": p.max_grad_norm,
                      "use_clipped_value_loss": p.clip_value_loss, "schedule": p.schedule, "desired_kl": p.desired_kl},
        "actor": {"class_name": "MLPModel", "hidden_dims": list(policy.actor_hidden), "activation": policy.activation,
                  "obs_normalization": policy.normalize_actor_obs,
                  "distribution_cfg": {"class_name": "GaussianDistribution", "init_std": policy.init_noise_std}},
        "critic": {"class_name": "MLPModel", "hidden_dims": list(policy.critic_hidden), "activation": policy.activation,
                   "obs_normalization": policy.normalize_critic_obs},
    }
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):   # RSL-RL prints a page per iteration
        runner = OnPolicyRunner(env, train_cfg, log_dir=log_root, device="cpu")
        runner.learn(cfg.max_iterations)
    return perf_from_events(log_root, "Perf/collection_time", "Perf/learning_time", warmup)


def run_syncppo_two_ranks(args, log_root: str, warmup: int) -> tuple[float, float]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "train.py", args.preset, "--max-iterations",
           str(args.iterations), "--env.num-envs", str(args.num_envs), "--log.root", log_root,
           "--log.print-every", str(10**6), "--log.save-every", str(10**6)]
    subprocess.run(cmd, check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   stdout=subprocess.DEVNULL)
    return perf_from_events(log_root, "Perf/collection_time", "Perf/learning_time", warmup)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tracking")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first iterations dropped from the medians")
    parser.add_argument("--num-envs", type=int, default=512, help="envs per rank")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    def make_cfg():
        cfg = preset(args.preset)
        cfg.env.num_envs, cfg.max_iterations = args.num_envs, args.iterations
        return cfg
    cfg = make_cfg()
    per_iteration = cfg.env.num_envs * cfg.ppo.num_steps
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, world, fn in (("syncppo", 1, lambda d: run_syncppo(make_cfg(), d, args.warmup)),
                                ("rsl-rl 5.5", 1, lambda d: run_rsl_rl(make_cfg(), d, args.warmup)),
                                ("syncppo", 2, lambda d: run_syncppo_two_ranks(args, d, args.warmup))):
            collect, learn = fn(os.path.join(tmp, f"{name}-{world}"))
            rows.append((name, world, world * per_iteration / (collect + learn), collect, learn))
    print(f"\n{args.preset}: {args.num_envs} envs/rank x {cfg.ppo.num_steps} steps, {cfg.ppo.num_epochs} epochs x "
          f"{cfg.ppo.num_mini_batches} minibatches, MLP {cfg.policy.actor_hidden}, {args.iterations} iterations "
          f"(medians after {args.warmup} warm-up), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("| learner | ranks | env-steps/s | collection s/it | update s/it | steps/s vs RSL-RL | update vs RSL-RL |")
    print("|---|---|---|---|---|---|---|")
    base = rows[1]
    for name, world, fps, collect, learn in rows:
        print(f"| {name} | {world} | {fps:,.0f} | {collect:.3f} | {learn:.3f} | {fps / base[2]:.2f}x | "
              f"{learn / base[4]:.2f}x |")


if __name__ == "__main__":
    main()
