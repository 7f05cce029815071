"""Data-parallel PPO: parse -> check -> init -> build -> (rollout -> update -> sync -> log -> checkpoint)*.

    python train.py cartpole                                   # one process, no torchrun needed
    torchrun --standalone --nproc-per-node 2 train.py tracking # 2 ranks (gloo on CPU, NCCL on GPUs)
    python train.py tracking --dry-run                         # print the sync plan and exit
    python train.py tracking --help                            # every flag with its help string

Each rank owns N envs and a [T, N] rollout. Everything that crosses ranks is listed in the sync plan
printed at start-up; `dist.comm.LEDGER` counts what actually did. A single process is world size 1
on the same code path (collectives become no-ops). Bad input is one line on stderr and exit status 2,
before anything is built or written.
"""

import contextlib
import dataclasses
import gc
import io
import json
import os
import signal
import sys
import time
import traceback

if __name__ == "__main__":    # Ctrl-C while torch and numpy import (~1.5 s): nothing is written yet, and a
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))   # KeyboardInterrupt there can abort the interpreter

import torch
import tyro

from configs import Config, cli_presets, env_count_flag, resolve_num_envs, validate, validate_device
from configs.resume import (blame_checkpoint, check_resume_fits, continue_saved_config, resolve_resume,
                            resume_command, shared_env_seed)
from configs.same_settings import differing_settings, settings_digest
from configs.typed_flags import env_label, experiment_dir, typed_flags, typed_task
from dist import comm
from dist.buffers import buffer_plan_rows, resolve_buffer_policy, sync_buffers
from dist.checkpoint import (agree_on_checkpoint, agree_plan_rows, checkpoint_plan_rows, gather_save_states,
                             lock_run_dir, open_run_dir, release_run_dirs, rng_states, save_checkpoint)
from dist.checkpoint_read import load_checkpoint
from dist.log_root import check_writable_root
from dist.errors import RunError, UsageError, first_line, one_line, out_of_memory, tell_torchrun
from dist.grad_sync import GradSync
from dist.params import broadcast_module, broadcast_plan_rows
from dist.plan import format_plan
from dist.roles import assign_roles
from dist.setup import (init_distributed, keep_freed_host_memory, launch_int, launch_rank_and_world,
                        rank_seed, resolve_device, seed_everything, shutdown)
from dist.stats import metrics_plan_rows, reduce_metrics, sum_counts, sum_counts_plan_rows
from dist.stop import STOP_KEYS, SecondInterrupt, StopRequests
from dist.verify import names_plan_row, same_names_everywhere, verify_plan_rows, verify_replicas
from envs import make_env
from envs.base import MissingSimulator
from ppo.actor_critic import build_actor_critic
from ppo.env_check import check_built, check_reset, step_checker
from ppo.logger import RunLogger
from ppo.minibatch_step import build_optimizer
from ppo.normalizer import RewardNormalizer
from ppo.restore import restore
from ppo.rollout import (TERM_TAGS, TRAIN_KEYS, EpisodeStats, check_finite, collect_rollout, episode_returns_plan_rows,
                          fill_storage)
from rollout_ranks import LearnerTeam, describe_rollout, run_rollout_rank, team_checkpoint
from ppo.storage import RolloutStorage
from ppo.update import checked_noise_std, ppo_update, update_plan_rows

OBS_GROUP = {"actor_obs": "policy", "critic_obs": "critic"}   # storage field -> observation group


def main(cfg: Config, typed: frozenset[str] | None = None) -> tuple[torch.nn.Module, dict[str, float], list]:
    """Train (or print the plan, with --dry-run); return the model, the last logged scalars and the sync plan.

    `typed`: the flags of the command line (cli). A resumed run then keeps its checkpoint's settings except
    these and the launch ones (configs/resume.py); None (a program's config) takes `cfg` as it is.

    Crosses ranks: every row of the sync plan it prints and returns, at that row's cadence (start-up, optimizer
    step, iteration, every K iterations, save), plus init_distributed's rendezvous and assign_roles' groups."""
    # ---- every check that needs neither a process group nor an env: nothing is built or written yet --
    rank, world = launch_rank_and_world()
    experiment = experiment_dir(cfg)             # from launch settings: final already
    restarted = launch_int("TORCHELASTIC_RESTART_COUNT", 0) > 0
    resume_path, run_dir = resolve_resume(cfg, experiment, typed_task(cfg, typed), cfg.env.name)
    checkpoint = load_checkpoint(resume_path, run_dir) if resume_path else None
    changed, kept = [], []            # from the command line a resumed run continues its own settings
    if checkpoint is not None and typed is not None:
        changed, kept = continue_saved_config(cfg, checkpoint["config"], typed, resume_path)
    env_seed = shared_env_seed(cfg, checkpoint)
    try:              # the split, too, of an --env.global-num-envs a resume took from its checkpoint: blamed on it
        envs_scope = resolve_num_envs(cfg, world)
        validate(cfg, world, typed or frozenset())   # typed: command-line flags, refused where they have no effect
    except UsageError as exc:
        raise blame_checkpoint(exc, kept, resume_path) from None
    if cfg.rollout.ranks and cfg.dist.device == "auto":
        cfg.dist.device = "cpu"       # rollout ranks stage everything on the host over gloo (docs/rollout_ranks.md)
    try:              # a kept --max-iterations or --env.global-num-envs the checkpoint refuses: blamed on it too
        validate_device(cfg, world, resolve_device(cfg.dist.device).type)
        done = checkpoint is not None and not check_resume_fits(checkpoint, cfg, resume_path, restarted)
    except UsageError as exc:
        raise blame_checkpoint(exc, kept, resume_path) from None
    check_writable_root(cfg.log.root)
    if run_dir is None:   # a new run's directory goes in the experiment's: another user's, or a file of that name
        check_writable_root(experiment, "--log.root/--log.experiment")
    if checkpoint is not None and rank == 0 and not done:
        if run_dir is not None and not cfg.dry_run:
            lock_run_dir(run_dir)     # before anything is built: a live run's directory is refused now
        if typed is not None:
            print(f"[syncppo] resuming with the settings of {resume_path}'s run"
                  + (f" (unlike the preset: {', '.join(kept)})" if kept else "")
                  + (f"; changed by this command line: {', '.join(changed)}" if changed else ""), flush=True)

    # ---- distributed set-up and roles; rollout ranks (--rollout.ranks) go their own way ------------
    info = init_distributed(cfg.dist.backend, cfg.dist.device, cfg.dist.timeout_s)
    agree_on_checkpoint(checkpoint, None if cfg.dry_run else cfg.log.root, settings_digest(cfg),   # own files
                        explain=lambda: differing_settings(cfg))
    if done:          # said after the agreement: a rank that loaded another checkpoint must not be left waiting
        if rank == 0:
            print(f"[syncppo] {resume_path} already reached --max-iterations {cfg.max_iterations}: done", flush=True)
        shutdown()
        return None, {}, []
    device, is_main = info.device, rank == 0
    if device.type == "cpu":
        keep_freed_host_memory()      # the update's activations stop page-faulting (glibc; see dist/setup.py)
    roles = assign_roles(rank, world, cfg.rollout.ranks, cfg.dist.timeout_s)
    start_iteration = checkpoint["iteration"] if checkpoint else 0
    if not roles.is_learner:
        copy, plan = run_rollout_rank(cfg, roles, device, checkpoint, start_iteration)
        shutdown()
        return copy, {}, plan
    comm.use_group(roles.learner_group)           # None (all ranks) when colocated

    # ---- build: env (or the rollout ranks' spec), model, optimizer, gradient sync, buffer rules -----
    seed = rank_seed(cfg.seed, rank)         # this rank's envs, sampling and minibatch shuffles
    seed_everything(seed)
    env = team = sampler = None
    if roles.colocated:
        try:
            env = make_env(cfg.env, device, seed=seed, base_seed=env_seed)
        except (ValueError, MissingSimulator) as exc:   # the adapters name the --env flag or the package to install
            raise UsageError(one_line(exc)) from exc      # a simulator's own error may span lines
        check_built(env, env_label(cfg), cfg.env.num_envs)   # before the model is built from its sizes
        obs_dims, num_actions, N, log_keys = env.obs_dims, env.num_actions, env.num_envs, tuple(env.log_keys)
        sampler = env.sampler         # with rollout ranks the sampler lives there (summed in their group)
    else:
        team = LearnerTeam(cfg, roles, device, start_iteration)
        obs_dims, num_actions, N, log_keys = (team.spec["obs_dims"], team.spec["num_actions"], team.num_envs,
                                              team.spec["log_keys"])
    model = build_actor_critic(cfg.policy, obs_dims, num_actions).to(device)
    optimizer = build_optimizer(model.parameters(), cfg.ppo, device)   # fused, device LR with --ppo.capture-step
    grad_sync = GradSync(model.parameters(), cfg.dist.grad_sync, cfg.dist.bucket_mb, num_extras=2,  # KL sum, count
                         unused=cfg.dist.unused_params)
    buffer_rules = resolve_buffer_policy(model, model.BUFFER_POLICY)
    reward_normalizer = (RewardNormalizer(N, cfg.ppo.gamma, cfg.ppo.reward_clip).to(device)
                         if cfg.ppo.normalize_rewards else None)
    also_verified = ([(reward_normalizer, resolve_buffer_policy(reward_normalizer, reward_normalizer.BUFFER_POLICY))]
                     if reward_normalizer is not None else [])   # its merged return statistics, beside the model's
    storage = RolloutStorage(cfg.ppo.num_steps, N, obs_dims, num_actions, device)
    shuffle = torch.Generator().manual_seed(seed)
    stateful = {"model": model, "optimizer": optimizer, "env": env, "reward_normalizer": reward_normalizer}
    if checkpoint is not None:
        restore(checkpoint, resume_path, stateful, shuffle, roles, device, cfg)
    obs = check_reset(env, env.reset(), env_label(cfg), device) if env is not None else None
    first = {f: obs[g] for f, g in OBS_GROUP.items()} if env is not None else team.spec["reset_obs"]
    for storage_field, normalizer in model.normalizers().items():
        normalizer.set_first_shift(first[storage_field].to(device))   # rank 0's shift wins in the broadcast
    broadcast_module(model)                       # same start everywhere (after a load too)
    if checkpoint is not None:
        verify_replicas(model, "parameters after checkpoint load", buffer_rules, also_verified)
    if team is not None:
        team.start(model, start_iteration)        # the rollout ranks' copies start from these weights

    T, learners = cfg.ppo.num_steps, roles.num_learners
    metric_keys = TRAIN_KEYS + log_keys           # one layout everywhere, or the metrics all-reduce mixes them up
    same_names_everywhere(sorted(metric_keys), "metrics", "the metric names differ",
                          "every rank's env must declare the same log_keys (envs/base.py)", RunError)
    plan = [*agree_plan_rows(), *broadcast_plan_rows(model), *update_plan_rows(model, grad_sync, cfg.ppo),
            *buffer_plan_rows(model, buffer_rules), *(reward_normalizer.plan_rows() if reward_normalizer else []),
            *sum_counts_plan_rows(sampler, cfg.dist.sampler_sync_every, cfg.log.save_every),
            names_plan_row("metrics"), *metrics_plan_rows(len(metric_keys) + len(STOP_KEYS), 2 + (team is not None)),
            *episode_returns_plan_rows(cfg.log.episode_returns, T, N),
            *(team.plan_rows() if team else []),
            *verify_plan_rows(cfg.dist.verify_every, checkpoint is not None),
            *checkpoint_plan_rows(rng_states(env, shuffle, device), cfg.log.save_every, env is not None)]
    if is_main:
        backend = info.backend if world > 1 else "none (one process: of --dist.* only device, unused-params apply)"
        print(f"[syncppo] world size {world}, backend {backend}, device {device} (one per rank); {envs_scope}\n"
              f"[syncppo] {roles.describe()}{'' if roles.colocated else describe_rollout(cfg)}\n"
              f"[syncppo] {learners} {('rank' + 's' * (learners > 1)) if roles.colocated else 'learner(s)'} x {N} envs "
              f"x {T} steps = {learners * N * T} transitions per iteration\n"
              f"[syncppo] {model.describe()}\n"
              f"{format_plan(plan, world, learners)}", flush=True)
    if cfg.dry_run:
        if team is not None:
            team.close()
        shutdown()
        return model, {}, plan
    stop = StopRequests(watch_launcher="TORCHELASTIC_RUN_ID" in os.environ)
    if is_main:
        run_dir = open_run_dir(run_dir, experiment, os.environ.get("TORCHELASTIC_RUN_ID"))
        logger = RunLogger(run_dir, cfg.max_iterations, start_iteration,   # continues the curves at start + 1
                           cfg.ppo.num_epochs * cfg.ppo.num_mini_batches)
        try:                          # what ran from here on, readable without torch
            with open(os.path.join(run_dir, f"config_{start_iteration}.json"), "w") as f:
                json.dump({"command": sys.argv, "world_size": world, "config": dataclasses.asdict(cfg)}, f, indent=1)
        except OSError as exc:
            raise RunError(f"could not write {run_dir}/config_{start_iteration}.json: {exc.strerror}") from None
        over = " (a restart before the run's first checkpoint: starting over)" if restarted and not resume_path else ""
        print(f"[syncppo] writing to {run_dir}{over}", flush=True)

    episodes = EpisodeStats(N, metric_keys, device)
    ledger_before = comm.ledger_snapshot()       # weight-serving threads count into the ledger meanwhile
    scalars: dict[str, float] = {}
    check_steps = step_checker(env, env_label(cfg), device, cfg.ppo.bootstrap_time_outs)
    for iteration in range(start_iteration, cfg.max_iterations):
        # ---- rollout: T steps of every local env (no communication), or the rollout ranks' batches ----
        t0 = time.time()
        episodes.start_iteration()
        if team is None:
            batch, obs = collect_rollout(model, env, obs, T, cfg.ppo.gamma, cfg.ppo.bootstrap_time_outs, episodes,
                                         record_returns=cfg.log.episode_returns, check=check_steps)
            check_finite(batch, env_label(cfg), rank, iteration + 1)    # before anything enters a normalizer
        else:
            batch, remote = team.receive(iteration)
            episodes.sums += remote["sums"].to(device)
            episodes.counts += remote["counts"].to(device)
            episodes.ended = list(batch.pop("episode_returns", torch.zeros(0, N)))
        fill_storage(storage, batch, model, reward_normalizer, cfg.ppo.gamma, cfg.ppo.lam,
                     recompute=team is not None and team.recompute)
        collection_time = finished(device) - t0

        # ---- update: E x M synchronized steps, then the once-per-iteration state syncs ------------
        t1 = time.time()
        if cfg.ppo.schedule == "linear":
            for group in optimizer.param_groups:
                group["lr"] = cfg.ppo.learning_rate * (1.0 - iteration / cfg.max_iterations)
        stats = ppo_update(model, optimizer, storage, grad_sync, cfg.ppo, generator=shuffle)
        sync_buffers(model, buffer_rules)
        if reward_normalizer is not None:
            reward_normalizer.update()
        if sampler is not None and (iteration + 1) % cfg.dist.sampler_sync_every == 0:
            sum_counts(sampler)
        if cfg.dist.verify_every and (iteration + 1) % cfg.dist.verify_every == 0:
            verify_replicas(model, buffer_rules=buffer_rules, also=also_verified)
        learning_time = finished(device) - t1

        # ---- metrics + the stop flags: one packed all-reduce of (sum, count) pairs; rank 0 writes --
        stepped = stats["skipped_steps"] < cfg.ppo.num_epochs * cfg.ppo.num_mini_batches   # no step: no loss to log
        for key, tag in TERM_TAGS.items():
            episodes.add(tag, stats[key] if stepped else 0.0, int(stepped))
        sums, counts = dict(zip(metric_keys, episodes.sums)), dict(zip(metric_keys, episodes.counts))
        for key, (flag, one) in stop.local_flags(device).items():
            sums[key], counts[key] = flag + (remote[key] if team else 0), one   # the rollout ranks' flags too
        # Declared ops: the slowest rank's collection; the update of the rank that waited least in it; the stalest batch
        maxima = {"Perf/collection_time": collection_time, "Perf/learning_time": -learning_time}
        scalars = reduce_metrics(sums, counts, maxima | ({"Perf/policy_lag": remote["lag"]} if team else {}))
        collection_time, learning_time = scalars["Perf/collection_time"], -scalars["Perf/learning_time"]
        returns = episodes.ended_returns() if cfg.log.episode_returns else []   # every rank's, on rank 0
        stop_signal, launcher_gone = (scalars.pop(key) > 0 for key in STOP_KEYS)
        scalars.update({"Loss/learning_rate": stats["learning_rate"],
                        **({"Policy/kl": stats["kl"], "Policy/grad_norm": stats["grad_norm"]} if stepped else {}),
                        "Policy/mean_noise_std": checked_noise_std(model, iteration + 1, stats["learning_rate"]),
                        "Perf/total_fps": learners * N * T / (collection_time + learning_time),
                        "Perf/learning_time": learning_time, "Train/nonfinite_skipped_steps": stats["skipped_steps"]})
        ledger = comm.ledger_snapshot()           # one read, so what is counted meanwhile goes to the next iteration
        for purpose, (calls, nbytes) in ledger.items():
            before = ledger_before.get(purpose, (0, 0))
            scalars[f"Comm/{purpose}_calls"], scalars[f"Comm/{purpose}_bytes"] = calls - before[0], nbytes - before[1]
        ledger_before = ledger
        if is_main:
            logger.log(scalars, iteration + 1, returns)
            if (iteration + 1) % cfg.log.print_every == 0 or iteration + 1 == cfg.max_iterations or stop_signal:
                logger.print_line(iteration, scalars)
        if launcher_gone:     # orphans: no launcher is left to restart or collect the job, so write nothing
            gone = RunError(stop.gone_message(iteration + 1))   # this rank's launcher, or another node's
            if team is not None:
                # Told to stop, so closed as after a last iteration: leaving before the rollout ranks read the stop
                # tore the groups down under them ("learner rank 0 died") and left the serving threads to the exit.
                try:
                    team.finish(model, iteration, stop=True, save=False)
                    team.close()
                except (RunError, comm.CollectiveError) as exc:   # a rollout rank failed too: the launcher comes first
                    raise gone from exc
            raise gone

        # ---- checkpoint: sampler counts summed, every rank's RNG gathered, rank 0 writes ----------
        last = iteration + 1 == cfg.max_iterations
        save = (iteration + 1) % cfg.log.save_every == 0 or last or stop_signal
        team_states = team.finish(model, iteration, stop_signal, save) if team is not None else None
        if save:
            if sampler is not None:
                sum_counts(sampler)
            rngs, env_state = gather_save_states(env, shuffle, device)     # env_state: the same on every rank
            if is_main:
                extra = {"env": env_state, "layout": [world, 0]} if team is None else \
                    team_checkpoint(team_states, team.spec, roles)
                path = os.path.join(run_dir, f"model_{iteration + 1}.pt")
                save_checkpoint(path, {**{k: v.state_dict() for k, v in stateful.items() if v is not None},
                                       "iteration": iteration + 1, "learning_rate": optimizer.param_groups[0]["lr"],
                                       "config": dataclasses.asdict(cfg), "rng": rngs, "env_seed": env_seed, **extra})
                print(f"[syncppo] saved {path}", flush=True)
        if stop_signal and not last:
            if is_main:
                launcher = " (under the same torchrun options)" if "TORCHELASTIC_RUN_ID" in os.environ else ""
                print(f"[syncppo] stopped on request (SIGINT/SIGTERM) after iteration {iteration + 1}; saved {path}; "
                      f"continue it in place{launcher} with: {resume_command(sys.argv[1:], run_dir)}", flush=True)
            break
    if is_main:
        logger.close()
        release_run_dirs()
    if team is not None:
        team.close()
    stop.restore_default_handlers()
    shutdown()
    return model, scalars, plan


def finished(device: torch.device) -> float:
    """The wall-clock time once `device` has run all it was given: on a GPU a phase's time then includes the
    work it queued, which would otherwise drain unseen in the next phase's first sync. One sync per phase."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


def first_on_node() -> bool:
    """Whether this is local rank 0, which says what every rank would (an unreadable LOCAL_RANK counts: main() then
    refuses it, and someone must say so)."""
    value = os.environ.get("LOCAL_RANK", "0")
    return not value.strip().isdecimal() or int(value) == 0


def cli(cfg: Config, argv: list[str] | None = None) -> int:
    """Run `main` with the flags typed in `argv` (None: none known); turn user errors into one line on stderr (status
    2) and run-time failures into one line (1); an unexpected exception prints its traceback and that line (1). Each
    tears the process group down at once. Crosses ranks: what `main` does (every row of its sync plan), nothing else."""
    try:
        main(cfg, None if argv is None else typed_flags(argv))
        return 0
    except UsageError as exc:        # identical on every rank: said once per node, unless only some ranks meet it
        code, failure, message, say = 2, exc, f"error: {exc}", first_on_node() if exc.say_here is None else exc.say_here
    except (RunError, comm.CollectiveError) as exc:
        code, failure, message, say = 1, exc, f"error: {exc}", True
    except KeyboardInterrupt as exc:     # a first Ctrl-C waits for the iteration's end only while training
        when = "by a second Ctrl-C" if isinstance(exc, SecondInterrupt) else "by Ctrl-C outside the training loop"
        message = f"error: interrupted {when}: nothing saved since the last checkpoint"
        code, failure, say = 130, exc, True
    except Exception as exc:         # a bug, not bad input: its traceback, then the same teardown as a run-time failure
        traceback.print_exc()       # (without it, other ranks blocked on this one waited out --dist.timeout-s)
        code, failure, say = 1, exc, True
        first = first_line(exc)
        said = f": {first}" if str(exc).strip() else ""        # not the type's name twice
        message = f"error: unexpected {type(exc).__name__} (traceback above){said}"
        if out_of_memory(exc):        # sizes the device cannot hold: not a bug, and the way out is a flag
            message = (f"error: out of memory (traceback above: where): {first}; this run's sizes need more memory "
                       f"than the device has: lower {env_count_flag(cfg)}, --ppo.num-steps, --policy.actor-hidden/"
                       "critic-hidden or the env's own sizes (tracking: --env.num-motions)")
    if say:
        print(f"{message}\n", end="", file=sys.stderr, flush=True)   # one write: no other thread's line inside
    tell_torchrun(message, after_peer=isinstance(failure, comm.CollectiveError))
    # A stop request means nothing once the run has failed: torchrun's SIGTERM to the ranks left must end them now
    # (the clean-up below may wait on a peer), not be noted for an iteration that never comes (then SIGKILL, 30 s on).
    StopRequests.restore_default_handlers()
    # The failure's frames hold gloo work objects; freed only at interpreter exit, after the process
    # group's threads, they can abort the process ("terminate called without an active exception"):
    # release them and tear the group down now. Every exception of the chain, causes and contexts alike: a
    # weight-serving thread's failure re-raised while a batch's wait failed has both, and the wait's frames kept
    # the learner's team, so the group its other rollout ranks waited in stayed up and the learner hung at exit.
    chain, seen = [failure], set()
    while chain:
        error = chain.pop()
        if error is not None and id(error) not in seen:
            seen.add(id(error))
            traceback.clear_frames(error.__traceback__)
            chain += [error.__cause__, error.__context__]
    shutdown()
    release_run_dirs()
    # Where exit handlers look for an uncaught exception: Isaac Lab's Kit ends the process with this status.
    ending = SystemExit(code)
    ending.__context__ = failure
    sys.last_exc = sys.last_value = ending
    return code


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    quiet = not first_on_node()        # tyro's help and parse errors: once per node, as ours
    try:
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext(), \
                contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
            config = tyro.extras.overridable_config_cli(cli_presets(sys.argv[1:]))
    except SystemExit as exc:
        if exc.code:                  # not --help
            tell_torchrun("error: the command line could not be parsed: see the parser's message (local rank 0)")
        raise
    code = cli(config, sys.argv[1:])
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # finalizing, Python resets a handler to SIG_DFL (130, unsaid)
    gc.freeze()     # else the exit's last collection walks every object torch made: 0.55 s a process, for nothing
    sys.exit(code)
