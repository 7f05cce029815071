"""Data-parallel PPO: parse -> init -> build -> (rollout -> update -> log -> checkpoint)*.

    python train.py cartpole                                   # one process, no torchrun needed
    torchrun --standalone --nproc-per-node 2 train.py tracking # 2 ranks (gloo on CPU, NCCL on GPUs)
    python train.py tracking --help                            # every flag with its help string

Each rank owns N envs and a [T, N] rollout; nothing but the statistics named in ppo/update.py and the
metrics below crosses ranks. A single process is world size 1 on the same code path.
"""

import dataclasses
import os
import time

import torch
import tyro

from configs import PRESETS, Config, validate
from dist import comm
from dist.checkpoint import check_checkpoint_path, load_checkpoint, save_checkpoint
from dist.grad_sync import FlatGradSync
from dist.params import broadcast_module
from dist.setup import init_distributed, seed_everything, shutdown
from dist.stats import reduce_metrics
from envs import make_env
from ppo.actor_critic import build_actor_critic
from ppo.gae import compute_gae
from ppo.logger import RunLogger
from ppo.storage import RolloutStorage
from ppo.update import ppo_update


def main(cfg: Config) -> tuple[torch.nn.Module, dict[str, float]]:
    """Train; return the model and the last iteration's logged scalars (tests use both)."""
    # ---- parse-time checks, before anything is built ----------------------------------------------
    validate(cfg)
    if cfg.resume:
        check_checkpoint_path(cfg.resume)

    # ---- distributed set-up: torchrun's env vars, or world size 1 -----------------------------------
    info = init_distributed(cfg.dist.backend, cfg.dist.device)
    rank, world, device = info.rank, info.world_size, info.device
    seed_everything(cfg.seed + info.rank)
    is_main = rank == 0

    # ---- build: env, model (same init everywhere via broadcast), optimizer, gradient sync ----------
    env = make_env(cfg.env, device, seed=cfg.seed + rank, base_seed=cfg.seed)
    model = build_actor_critic(cfg.policy, env.obs_dims, env.num_actions).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.ppo.learning_rate)
    grad_sync = FlatGradSync(list(model.parameters()), num_extras=2)   # extras: KL sum, KL count
    storage = RolloutStorage(cfg.ppo.num_steps, env.num_envs, env.obs_dims, env.num_actions, device)
    shuffle = torch.Generator().manual_seed(cfg.seed + rank)
    start_iteration = 0
    if cfg.resume:
        start_iteration = restore(cfg.resume, model, optimizer, env, shuffle, rank, world, device)
    broadcast_module(model)

    T, N = cfg.ppo.num_steps, env.num_envs
    run_dir = os.path.join(cfg.log.root, cfg.log.experiment or cfg.env.name, time.strftime("%Y-%m-%d_%H-%M-%S"))
    logger = RunLogger(run_dir, cfg.max_iterations, start_iteration) if is_main else None
    if is_main:
        print(f"[syncppo] world size {world}, backend {info.backend}, device {device} (one per rank)\n"
              f"[syncppo] {world} ranks x {N} envs x {T} steps = {world * N * T} transitions per iteration "
              f"(--env.num-envs is per rank)\n[syncppo] logging to {run_dir}", flush=True)

    obs, _ = env.reset()
    episode_return = torch.zeros(N, device=device)
    episode_length = torch.zeros(N, device=device)
    stats: dict[str, float] = {}
    for iteration in range(start_iteration, cfg.max_iterations):
        # ---- rollout: T steps of every local env, no communication --------------------------------
        t0 = time.time()
        sums, counts = {}, {}
        done_return = torch.zeros((), device=device)
        done_length = torch.zeros((), device=device)
        done_count = torch.zeros((), device=device)
        storage.clear()
        with torch.no_grad():
            for _ in range(T):
                pi = model.distribution(obs["policy"])
                actions = pi.sample()
                values = model.value(obs["critic"])
                next_obs, reward, terminated, truncated, extras = env.step(actions)
                done = terminated | truncated
                # Time-outs are not failures: bootstrap them with the value of the obs before the reset.
                bootstrapped = reward
                if cfg.ppo.bootstrap_time_outs:
                    bootstrapped = reward + cfg.ppo.gamma * truncated * model.value(extras["final_obs"]["critic"])
                storage.add(obs["policy"], obs["critic"], actions, pi.mean, pi.stddev,
                            pi.log_prob(actions).sum(-1), bootstrapped, values, done)
                episode_return += reward
                episode_length += 1
                done_return += (episode_return * done).sum()
                done_length += (episode_length * done).sum()
                done_count += done.sum()
                episode_return *= ~done
                episode_length *= ~done
                for key, value in extras["log"].items():
                    sums[key] = sums.get(key, 0.0) + value
                    counts[key] = counts.get(key, 0) + 1
                obs = next_obs
            last_values = model.value(obs["critic"])
        storage.advantages, storage.returns = compute_gae(storage.rewards, storage.values, storage.dones,
                                                          last_values, cfg.ppo.gamma, cfg.ppo.lam)
        collection_time = time.time() - t0

        # ---- update: E epochs x M minibatches, gradients averaged across ranks --------------------
        t1 = time.time()
        if cfg.ppo.schedule == "linear":
            for group in optimizer.param_groups:
                group["lr"] = cfg.ppo.learning_rate * (1.0 - iteration / cfg.max_iterations)
        stats = ppo_update(model, optimizer, storage, grad_sync, cfg.ppo, generator=shuffle)
        learning_time = time.time() - t1

        # ---- metrics: one packed all-reduce of (sum, count) pairs; rank 0 writes ------------------
        sums.update({"Train/mean_reward": done_return, "Train/mean_episode_length": done_length,
                     "Loss/surrogate": stats["surrogate"], "Loss/value_function": stats["value_function"],
                     "Loss/entropy": stats["entropy"]})
        counts.update({"Train/mean_reward": done_count, "Train/mean_episode_length": done_count,
                       "Loss/surrogate": 1, "Loss/value_function": 1, "Loss/entropy": 1})
        scalars = reduce_metrics(sums, counts)
        iteration_time = collection_time + learning_time
        scalars.update({"Loss/learning_rate": stats["learning_rate"], "Policy/kl": stats["kl"],
                        "Policy/mean_noise_std": model.log_std.exp().mean().item(),
                        "Perf/total_fps": world * N * T / iteration_time, "Perf/collection_time": collection_time,
                        "Perf/learning_time": learning_time, "Train/skipped_steps": stats["skipped_steps"]})
        if is_main:
            logger.log(iteration, scalars, step=iteration + 1)
            if (iteration + 1) % cfg.log.print_every == 0 or iteration + 1 == cfg.max_iterations:
                logger.print_line(iteration, scalars)
        stats = scalars

        # ---- checkpoint: every rank's RNG gathered, rank 0 writes atomically ----------------------
        if (iteration + 1) % cfg.log.save_every == 0 or iteration + 1 == cfg.max_iterations:
            checkpoint(os.path.join(run_dir, f"model_{iteration + 1}.pt"), cfg, model, optimizer, env, shuffle,
                       iteration + 1, is_main)
    if is_main:
        logger.close()
    shutdown()
    return model, stats


def rng_state(env, shuffle: torch.Generator) -> dict:
    state = {"torch": torch.get_rng_state(), "env": env.generator.get_state(), "shuffle": shuffle.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def checkpoint(path, cfg, model, optimizer, env, shuffle, iteration, is_main) -> None:
    """Crosses ranks: one all_gather_object of the RNG states (a few KB per rank), every save."""
    rngs = comm.all_gather_object(rng_state(env, shuffle), "checkpoint")
    if is_main:
        save_checkpoint(path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                               "iteration": iteration, "learning_rate": optimizer.param_groups[0]["lr"],
                               "env": env.state_dict(), "config": dataclasses.asdict(cfg), "rng": rngs})
        print(f"[syncppo] saved {path}", flush=True)


def restore(path, model, optimizer, env, shuffle, rank, world, device) -> int:
    """Every rank loads the same file; RNG states are restored per rank when the world size matches."""
    state = load_checkpoint(path, map_location=device)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise ValueError(f"--resume {path!r} does not fit this model (different env or --policy.* sizes?): {exc}") from None
    optimizer.load_state_dict(state["optimizer"])
    env.load_state_dict(state["env"])
    if len(state["rng"]) == world:
        rng = state["rng"][rank]
        torch.set_rng_state(rng["torch"].cpu())
        env.generator.set_state(rng["env"].cpu() if env.generator.device.type == "cpu" else rng["env"])
        shuffle.set_state(rng["shuffle"].cpu())
    elif rank == 0:
        print(f"[syncppo] resuming {len(state['rng'])}-rank checkpoint on {world} ranks: RNG streams restart "
              f"from --seed + rank, everything else is restored", flush=True)
    if rank == 0:
        print(f"[syncppo] resumed {path} at iteration {state['iteration']}", flush=True)
    return state["iteration"]


if __name__ == "__main__":
    main(tyro.extras.overridable_config_cli({name: (fn.__doc__, fn()) for name, fn in PRESETS.items()}))
