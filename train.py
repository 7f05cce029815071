"""Data-parallel PPO: parse -> init -> build -> (rollout -> update -> sync -> log -> checkpoint)*.

    python train.py cartpole                                   # one process, no torchrun needed
    torchrun --standalone --nproc-per-node 2 train.py tracking # 2 ranks (gloo on CPU, NCCL on GPUs)
    python train.py tracking --dry-run                         # print the sync plan and exit
    python train.py tracking --help                            # every flag with its help string

Each rank owns N envs and a [T, N] rollout. Everything that crosses ranks is listed in the sync plan
printed at start-up; `dist.comm.LEDGER` counts what actually did. A single process is world size 1
on the same code path (collectives become no-ops).
"""

import dataclasses
import os
import time

import torch
import tyro

from configs import PRESETS, Config, resolve_num_envs, validate
from dist import comm
from dist.buffers import buffer_bytes, resolve_buffer_policy, sync_buffers
from dist.checkpoint import check_checkpoint_path, load_checkpoint, save_checkpoint
from dist.grad_sync import GradSync
from dist.params import broadcast_bytes, broadcast_module
from dist.plan import build_plan, format_plan
from dist.setup import init_distributed, seed_everything, shutdown
from dist.stats import reduce_metrics
from dist.verify import verify_replicas
from envs import make_env
from ppo.actor_critic import build_actor_critic
from ppo.gae import compute_gae
from ppo.logger import RunLogger
from ppo.normalizer import RewardNormalizer
from ppo.storage import RolloutStorage
from ppo.update import ppo_update

TRAIN_KEYS = ("Train/mean_reward", "Train/mean_episode_length", "Loss/surrogate", "Loss/value_function", "Loss/entropy")


def main(cfg: Config) -> tuple[torch.nn.Module, dict[str, float], list]:
    """Train (or print the plan, with --dry-run); return the model, the last logged scalars and the sync plan."""
    # ---- distributed set-up and every config check, before anything is built ---------------------
    info = init_distributed(cfg.dist.backend, cfg.dist.device)
    rank, world, device, is_main = info.rank, info.world_size, info.device, info.rank == 0
    envs_scope = resolve_num_envs(cfg, world)
    validate(cfg)
    if cfg.resume:
        check_checkpoint_path(cfg.resume)
    seed_everything(cfg.seed + rank)

    # ---- build: env, model, optimizer, gradient sync, buffer rules -------------------------------
    env = make_env(cfg.env, device, seed=cfg.seed + rank, base_seed=cfg.seed)
    model = build_actor_critic(cfg.policy, env.obs_dims, env.num_actions).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.ppo.learning_rate, eps=cfg.ppo.adam_eps)
    grad_sync = GradSync(model.parameters(), cfg.dist.grad_sync, cfg.dist.bucket_mb, num_extras=2,  # KL sum, count
                         unused=cfg.dist.unused_params)
    buffer_rules = resolve_buffer_policy(model, model.BUFFER_POLICY)
    reward_normalizer = (RewardNormalizer(env.num_envs, cfg.ppo.gamma, cfg.ppo.reward_clip).to(device)
                         if cfg.ppo.normalize_rewards else None)
    if reward_normalizer is not None:
        resolve_buffer_policy(reward_normalizer, reward_normalizer.BUFFER_POLICY)   # all merge/local
    storage = RolloutStorage(cfg.ppo.num_steps, env.num_envs, env.obs_dims, env.num_actions, device)
    shuffle = torch.Generator().manual_seed(cfg.seed + rank)
    stateful = {"model": model, "optimizer": optimizer, "env": env, "reward_normalizer": reward_normalizer}
    start_iteration = restore(cfg.resume, stateful, shuffle, rank, world, device) if cfg.resume else 0
    broadcast_module(model)                       # same start everywhere (after a load too)
    if cfg.resume:
        verify_replicas(model, "parameters after checkpoint load")

    T, N = cfg.ppo.num_steps, env.num_envs
    metric_keys = TRAIN_KEYS + tuple(env.log_keys)
    plan = build_plan(
        optimizer_steps=cfg.ppo.num_epochs * cfg.ppo.num_mini_batches, grad_bucket_bytes=grad_sync.bucket_bytes(),
        kl_rides=True, param_bytes=broadcast_bytes(model), advantage_global=cfg.ppo.advantage_norm == "global",
        normalizer_bytes=[(1 + 2 * n.mean.numel()) * 8 for n in model.normalizers().values()]
        + ([24] if reward_normalizer is not None else []),
        buffer_broadcast_bytes=buffer_bytes(model, buffer_rules, "broadcast"),
        buffer_mean_bytes=buffer_bytes(model, buffer_rules, "mean"),
        sampler_bytes=env.sampler.local_counts.numel() * 8 if env.sampler is not None else 0,
        sampler_every=cfg.dist.sampler_sync_every, metric_keys=len(metric_keys), verify_every=cfg.dist.verify_every,
        save_every=cfg.log.save_every, resumed=bool(cfg.resume))
    run_dir = os.path.join(cfg.log.root, cfg.log.experiment or cfg.env.name, time.strftime("%Y-%m-%d_%H-%M-%S"))
    if is_main:
        print(f"[syncppo] world size {world}, backend {info.backend}, device {device} (one per rank); {envs_scope}\n"
              f"[syncppo] {world} ranks x {N} envs x {T} steps = {world * N * T} transitions per iteration\n"
              f"{format_plan(plan, world)}", flush=True)
    if cfg.dry_run:
        shutdown()
        return model, {}, plan
    logger = RunLogger(run_dir, cfg.max_iterations, start_iteration) if is_main else None

    obs, _ = env.reset()
    episode_return, episode_length = torch.zeros(N, device=device), torch.zeros(N, device=device)
    ledger_before = {k: list(v) for k, v in comm.LEDGER.items()}
    scalars: dict[str, float] = {}
    for iteration in range(start_iteration, cfg.max_iterations):
        # ---- rollout: T steps of every local env, no communication --------------------------------
        t0 = time.time()
        sums = {k: torch.zeros((), device=device) for k in metric_keys}
        counts = {k: torch.zeros((), device=device) for k in metric_keys}
        storage.clear()
        ended = []   # rank 0, --log.episode-returns: [N] per step, the return of each env that finished, else NaN
        with torch.inference_mode():
            for _ in range(T):
                pi = model.distribution(obs["policy"])
                actions = pi.sample()
                values = model.value(obs["critic"])
                next_obs, raw_reward, terminated, truncated, extras = env.step(actions)
                done = terminated | truncated
                reward = reward_normalizer(raw_reward, done) if reward_normalizer is not None else raw_reward
                if cfg.ppo.bootstrap_time_outs:   # a time-out is not a failure: add gamma * V(obs before reset)
                    reward = reward + cfg.ppo.gamma * truncated * model.value(extras["final_obs"]["critic"])
                storage.add(obs["policy"], obs["critic"], actions, pi.mean, pi.stddev, pi.log_prob(actions).sum(-1),
                            reward, values, done)
                episode_return += raw_reward
                episode_length += 1
                for key, value in (("Train/mean_reward", episode_return), ("Train/mean_episode_length", episode_length)):
                    sums[key] += (value * done).sum()
                    counts[key] += done.sum()
                if cfg.log.episode_returns and is_main:
                    ended.append(torch.where(done, episode_return, torch.nan))
                episode_return *= ~done
                episode_length *= ~done
                for key, value in extras["log"].items():
                    sums[key] += value
                    counts[key] += 1
                obs = next_obs
            last_values = model.value(obs["critic"])
        storage.advantages, storage.returns = compute_gae(storage.rewards, storage.values, storage.dones,
                                                          last_values, cfg.ppo.gamma, cfg.ppo.lam)
        collection_time = time.time() - t0

        # ---- update: E x M synchronized steps, then the once-per-iteration state syncs ------------
        t1 = time.time()
        if cfg.ppo.schedule == "linear":
            for group in optimizer.param_groups:
                group["lr"] = cfg.ppo.learning_rate * (1.0 - iteration / cfg.max_iterations)
        stats = ppo_update(model, optimizer, storage, grad_sync, cfg.ppo, generator=shuffle)
        sync_buffers(model, buffer_rules)
        if reward_normalizer is not None:
            reward_normalizer.update()
        if env.sampler is not None and (iteration + 1) % cfg.dist.sampler_sync_every == 0:
            sync_sampler(env.sampler)
        if cfg.dist.verify_every and (iteration + 1) % cfg.dist.verify_every == 0:
            verify_replicas(model)
        learning_time = time.time() - t1

        # ---- metrics: one packed all-reduce of (sum, count) pairs; rank 0 writes ------------------
        for key, value in (("Loss/surrogate", stats["surrogate"]), ("Loss/value_function", stats["value_function"]),
                           ("Loss/entropy", stats["entropy"])):
            sums[key] += value
            counts[key] += 1
        scalars = reduce_metrics(sums, counts)
        scalars.update({"Loss/learning_rate": stats["learning_rate"], "Policy/kl": stats["kl"],
                        "Policy/mean_noise_std": model.log_std.exp().mean().item(),
                        "Perf/total_fps": world * N * T / (collection_time + learning_time),
                        "Perf/collection_time": collection_time, "Perf/learning_time": learning_time,
                        "Train/nonfinite_skipped_steps": stats["skipped_steps"]})
        for purpose, (calls, nbytes) in comm.LEDGER.items():
            before = ledger_before.get(purpose, [0, 0])
            scalars[f"Comm/{purpose}_calls"], scalars[f"Comm/{purpose}_bytes"] = calls - before[0], nbytes - before[1]
        ledger_before = {k: list(v) for k, v in comm.LEDGER.items()}
        if is_main:
            logger.log(scalars, step=iteration + 1)
            returns = torch.stack(ended).flatten().cpu() if ended else torch.zeros(0)   # in the order they ended
            for value in returns[~returns.isnan()].tolist():
                logger.writer.add_scalar("Episode/return", value, (iteration + 1) * world * N * T)
            if (iteration + 1) % cfg.log.print_every == 0 or iteration + 1 == cfg.max_iterations:
                logger.print_line(iteration, scalars)

        # ---- checkpoint: sampler counts summed, every rank's RNG gathered, rank 0 writes ----------
        if (iteration + 1) % cfg.log.save_every == 0 or iteration + 1 == cfg.max_iterations:
            if env.sampler is not None:
                sync_sampler(env.sampler)
            rngs = comm.all_gather_object(rng_state(env, shuffle), "checkpoint")
            if is_main:
                path = os.path.join(run_dir, f"model_{iteration + 1}.pt")
                save_checkpoint(path, {**{k: v.state_dict() for k, v in stateful.items() if v is not None},
                                       "iteration": iteration + 1, "learning_rate": optimizer.param_groups[0]["lr"],
                                       "config": dataclasses.asdict(cfg), "rng": rngs})
                print(f"[syncppo] saved {path}", flush=True)
    if is_main:
        logger.close()
    shutdown()
    return model, scalars, plan


def sync_sampler(sampler) -> None:
    """Crosses ranks: one all-reduce (sum, not mean) of the local visit/failure counts, 2 x motions float64."""
    sampler.commit_global(comm.all_reduce(sampler.local_counts.clone().to(comm.device()), "sampler").to(
        sampler.local_counts.device))


def rng_state(env, shuffle: torch.Generator) -> dict:
    state = {"torch": torch.get_rng_state(), "env": env.generator.get_state(), "shuffle": shuffle.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(path, stateful: dict, shuffle, rank, world, device) -> int:
    """Every rank loads the same file; RNG states are restored per rank when the world size matches."""
    state = load_checkpoint(path, map_location=device)
    for key, obj in stateful.items():
        if obj is None:
            continue
        if key not in state:
            raise ValueError(f"--resume {path!r} has no {key!r} state (saved with other flags, e.g. --ppo.normalize-rewards?)")
        try:
            obj.load_state_dict(state[key])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ValueError(f"--resume {path!r}: its {key} does not fit this run (other env or --policy.* sizes?): "
                             f"{exc}") from None
    env = stateful["env"]
    if len(state["rng"]) == world:
        rng = state["rng"][rank]
        torch.set_rng_state(rng["torch"].cpu())
        env.generator.set_state(rng["env"].cpu())
        shuffle.set_state(rng["shuffle"].cpu())
    elif rank == 0:
        print(f"[syncppo] resuming a {len(state['rng'])}-rank checkpoint on {world} ranks: RNG streams restart "
              f"from --seed + rank; everything else is restored", flush=True)
    if rank == 0:
        print(f"[syncppo] resumed {path} at iteration {state['iteration']}", flush=True)
    return state["iteration"]


if __name__ == "__main__":
    main(tyro.extras.overridable_config_cli({name: (fn.__doc__, fn()) for name, fn in PRESETS.items()}))
