"""Rollout ranks (`--rollout.ranks`): colocated vs 1 learner + 1 rollout rank, weight-sync bytes and time, learning.

    python bench/bench_rollout.py            # all three parts (about an hour on 2 loaded cores)
    python bench/bench_rollout.py --quick    # throughput on tracking and one weight-sync case (1-2 minutes)
    python bench/bench_rollout.py --parts sync learning --out bench/out/rollout

Every number comes from real `torchrun --nproc-per-node 2 train.py ...` jobs (gloo, 2 processes, one
thread each), read back from the TensorBoard file the learner writes.

1. Throughput. Per round, one job per variant, back to back (colocated, sync, async, colocated, ...),
   so load from other processes hits all variants alike; ratios are medians of per-round ratios. The
   variants see the same transitions per iteration: colocated 2 ranks x N/2 envs x T steps, 1 + 1 with
   N envs x T on the rollout rank (mujoco: 1 env, T/2 steps per colocated rank, as bench_mujoco.py).
   Iteration time is the gap between the learner's consecutive TensorBoard writes (everything: wait,
   update, weight sync, logging); the first WARMUP iterations are dropped.
   What "collection" and "update" mean on a learner with rollout ranks: its Perf/collection_time is
   the time it waited for the batch (plus GAE on it), Perf/learning_time the PPO update. The rollout
   rank's own collection time is not logged, so C is measured as the learner's wait in sync mode, where
   the rollout rank starts collecting only once it has the new weights: C = weight receive + collection
   + batch transfer (+ GAE). U is the learner's update time in the async job. Overlap of async mode =
   async iteration time / max(C, U), from jobs of the same round (1.0 = perfect overlap).
2. Weight sync. 1 + 1 sync-mode jobs with --rollout.sync patch and bucket, fp32 and bf16 copies, at the
   tracking preset's LR (adaptive from 1e-3) and SONIC's (2e-5 in [1e-5, 2e-4]). Bytes per iteration
   are the learner's ledger (Comm/weight_sync_bytes); the adaptive schedule takes SONIC's 2e-5 to its
   2e-4 cap within the first iteration, so a fixed 2e-5 shows a truly small LR. The patch jobs save
   every iteration; their weight sequence is then replayed through sync/'s patch and bucket syncers
   (2 gloo processes, both modes on each version, which goes first alternating by version) to time sender sync() and
   receiver apply(), and the share of changed elements is counted from the checkpoints directly (bits that
   differ in the copy's dtype: parameters in --rollout.dtype, buffers as they are) and checked against
   patch's own count.
3. Learning. The tracking preset, 400 iterations, async 1 + 1 (512 envs) vs colocated 2 ranks x 256
   envs (the same 12,288 transitions per iteration), 2 seeds each, two jobs at a time under nice; and
   async with recompute off (ratio and KL against the stale copy) and on (the default: the learner's weights).
   Return = mean Train/mean_reward of the last 10 iterations. Finished jobs under --out are reused.

Ctrl-C or SIGTERM stops the jobs running (SIGTERM to torchrun, which stops its ranks), removes this run's run_*
folder (a failed job keeps it, to look at) and exits 130 or 143 with one line.
"""

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench._common import (free_port, rank_answers, rank_signals, refuse_repeats, run_child, stop_all,  # noqa: E402
                           refuse_torchrun, stop_processes, stopped_main)
from configs.config import PolicyConfig  # noqa: E402
from ppo.actor_critic import build_actor_critic  # noqa: E402
from sync import WeightSyncConfig, make_weight_syncer  # noqa: E402

WARMUP = 3          # iterations dropped from timing (start-up, async pipeline filling)
ANSWER_S = 600      # replay's wait for a rank's answer (from the start or the previous answer)
VARIANTS = {"colocated": [], "sync": ["--rollout.ranks", "1", "--rollout.mode", "sync"],
            "async": ["--rollout.ranks", "1", "--rollout.mode", "async", "--rollout.max-staleness", "1"]}
# Same transitions per iteration in every variant: (colocated flags per rank, 1 + 1 flags for the rollout rank).
WORKLOADS = {"tracking": (["--env.num-envs", "256"], ["--env.num-envs", "512"]),
             "mujoco": (["--ppo.num-steps", "1024"], ["--ppo.num-steps", "2048"])}
LRS = {"tracking LR (adaptive from 1e-3)": [],
       "SONIC LR (2e-5 in [1e-5, 2e-4])": ["--ppo.learning-rate", "2e-5", "--ppo.lr-min", "1e-5",
                                           "--ppo.lr-max", "2e-4"],
       "fixed 2e-5 (SONIC's start, not adapted)": ["--ppo.learning-rate", "2e-5", "--ppo.schedule", "fixed"]}
QUIET = ["--dist.verify-every", "0", "--log.print-every", "1000"]


# ---- jobs ------------------------------------------------------------------------------------------------

def train(preset: str, flags: list[str], root: str, name: str, nice: int = 0) -> str:
    """Run one 2-process torchrun job to the end; return its run directory (raise with the log tail if it failed)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = ["nice", "-n", str(nice), torchrun, "--standalone", "--nproc-per-node", "2", "train.py", preset, *flags,
           "--log.root", root, "--log.experiment", name]
    os.makedirs(root, exist_ok=True)
    log = os.path.join(root, f"{name}.log")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(log, "w") as out:
        code = run_child(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if code:
        with open(log) as f:
            tail = "".join(f.readlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {code}:\n{tail}")
    return sorted(glob.glob(os.path.join(root, name, "*", "")))[-1]


def scalars(run_dir: str) -> dict[str, list]:
    """Every scalar the learner wrote: tag -> [(step, wall_time, value)] in step order."""
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def steady(series: list, skip: int = WARMUP) -> list[float]:
    return [value for _, _, value in series[skip:]]


def median_ratio(pairs) -> float:
    return statistics.median(a / b for a, b in pairs)


# ---- 1. throughput ---------------------------------------------------------------------------------------

def throughput(args, root: str) -> None:
    for preset in args.envs:
        coloc_flags, rollout_flags = WORKLOADS[preset]
        iterations = args.iterations[preset]
        rounds = []
        for r in range(args.rounds):
            row = {}
            for variant, flags in VARIANTS.items():
                extra = coloc_flags if variant == "colocated" else rollout_flags
                run_dir = train(preset, [*flags, *extra, *QUIET, "--max-iterations", str(iterations),
                                         "--log.save-every", str(iterations), "--seed", str(r + 1)],
                                root, f"{preset}_{variant}_r{r}")
                s = scalars(run_dir)
                walls = [w for _, w, _ in s["Perf/total_fps"]]
                gaps = [b - a for a, b in zip(walls, walls[1:])][WARMUP - 1:]
                row[variant] = {"iteration": statistics.median(gaps),
                                "wait": statistics.median(steady(s["Perf/collection_time"])),
                                "update": statistics.median(steady(s["Perf/learning_time"]))}
            rounds.append(row)
            print(f"  {preset} round {r + 1}/{args.rounds}: " + ", ".join(
                f"{v} {row[v]['iteration']:.2f} s/it" for v in VARIANTS), flush=True)
        transitions = {"tracking": 512 * 24, "mujoco": 2048}[preset]
        print(f"\n{preset}: {transitions} transitions per iteration, {iterations} iterations per job, "
              f"first {WARMUP} dropped, {args.rounds} round(s); medians over rounds")
        print(f"| variant | env-steps/s | iteration (s) | learner wait (s) | learner update (s) | steps/s vs colocated "
              f"| iteration / (C + U) | iteration / max(C, U) |")
        print("|---|---|---|---|---|---|---|---|")
        for variant in VARIANTS:
            med = {k: statistics.median(row[variant][k] for row in rounds) for k in ("iteration", "wait", "update")}
            vs = median_ratio((row["colocated"]["iteration"], row[variant]["iteration"]) for row in rounds)
            if variant == "colocated":
                sum_ratio = max_ratio = "-"
            else:   # C: the sync job's wait (rollout rank's receive + collect + send); U: this job's update
                sums = median_ratio((row[variant]["iteration"], row["sync"]["wait"] + row[variant]["update"])
                                    for row in rounds)
                peaks = median_ratio((row[variant]["iteration"], max(row["sync"]["wait"], row[variant]["update"]))
                                     for row in rounds)
                sum_ratio, max_ratio = f"{sums:.2f}", f"{peaks:.2f}"
            print(f"| {variant} | {transitions / med['iteration']:,.0f} | {med['iteration']:.2f} | {med['wait']:.2f} | "
                  f"{med['update']:.2f} | {vs:.2f}x | {sum_ratio} | {max_ratio} |")
        print("C = learner wait in the sync job (rollout rank: weights in, collect, batch out); U = learner update "
              "of the job in that row. Colocated 'wait' is its own collection of N/2 envs on each rank.\n", flush=True)


# ---- 2. weight sync --------------------------------------------------------------------------------------

def changed_share(before: dict, after: dict, dtypes: dict) -> tuple[int, int]:
    """(elements whose bits differ once cast to the copy's dtypes, all elements) between two versions."""
    changed = total = 0
    for key, dtype in dtypes.items():
        old, new = before[key].reshape(-1).to(dtype), after[key].reshape(-1).to(dtype)
        size = old.element_size()
        changed += int((old.view(torch.uint8).view(-1, size) != new.view(torch.uint8).view(-1, size)).any(1).sum())
        total += old.numel()
    return changed, total


def receiver_model(state: dict, policy: dict, dtype: torch.dtype):
    """The rollout rank's policy copy for this checkpoint: same architecture, parameters in `dtype`."""
    obs_dims = {"policy": state["actor.0.weight"].shape[1], "critic": state["critic.0.weight"].shape[1]}
    model = build_actor_critic(PolicyConfig(**policy), obs_dims, state["log_std"].shape[0])
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def replay_order(version: int) -> tuple[str, str]:
    """The syncers in the order they run on `version`: patch first on even versions, bucket on odd, so that what a
    version's first sync pays (e.g. caches cold after torch.load) falls on both alike. The version alone decides
    it, so both ranks run the same order."""
    return ("patch", "bucket") if version % 2 == 0 else ("bucket", "patch")


def replay_rank(rank: int, port: int, paths: list[str], dtype_name: str, queue) -> None:
    """Rank 0 sends the checkpoints' weights version by version, rank 1 applies them; patch and bucket both run on
    every version, in replay_order. Crosses ranks: sync/'s messages, and one barrier before each timed call."""
    rank_signals()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    first = torch.load(paths[0], map_location="cpu", weights_only=False)
    model = receiver_model(first["model"], first["config"]["policy"], dtype)
    syncers = {mode: make_weight_syncer(WeightSyncConfig(type=mode), 0, [1], dist.new_group([0, 1]))
               for mode in ("patch", "bucket")}
    times = {mode: [] for mode in syncers}
    stats = {mode: [] for mode in syncers}
    for mode, syncer in syncers.items():
        if rank == 0:
            syncer.init_sender(first["model"], None, 1)
            syncer.sync(first["model"], 2)             # so that bucket, like patch, starts from the first weights
        else:
            syncer.init_receiver(model)
            syncer.apply(model)
    for version, path in enumerate(paths[1:], start=3):
        state = torch.load(path, map_location="cpu", weights_only=False)["model"] if rank == 0 else None
        for mode in replay_order(version):
            syncer = syncers[mode]
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                s = syncer.sync(state, version)
                stats[mode].append((s.wire_bytes, s.changed_elements))
            else:
                syncer.apply(model)
            times[mode].append(time.perf_counter() - t0)
    queue.put((rank, times, stats))
    dist.barrier()
    dist.destroy_process_group()


def replay(paths: list[str], dtype_name: str) -> dict:
    ctx, port = mp.get_context("spawn"), free_port()
    queue = ctx.Queue()
    procs = [ctx.Process(target=replay_rank, args=(r, port, paths, dtype_name, queue)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        # a rank that died before its answer (its partner then fails or waits in a collective) sends none: waiting
        # out ANSWER_S for it took 10 minutes and hid its exit code
        results = {rank: (times, stats) for rank, times, stats in rank_answers(procs, queue, len(procs), ANSWER_S)}
        for p in procs:
            p.join()
            if p.exitcode:
                raise RuntimeError(f"rank exited with {p.exitcode}")
    except RuntimeError as exc:
        raise RuntimeError(f"replay {exc}") from None
    finally:     # Ctrl-C, SIGTERM or a failed rank: its partner would wait in a collective
        stop_processes(procs)
    return {"send": results[0][0], "apply": results[1][0], "stats": results[0][1]}


def weight_sync(args, root: str) -> None:
    rows = []
    for lr_name, lr_flags in args.lrs.items():
        for dtype in args.dtypes:
            per_mode = {}
            for mode in ("patch", "bucket"):
                name = f"ws_{len(rows)}_{mode}_{dtype}"
                flags = [*VARIANTS["sync"], *lr_flags, *QUIET, "--rollout.sync", mode, "--rollout.dtype", dtype,
                         "--max-iterations", str(args.sync_iterations),
                         "--log.save-every", "1" if mode == "patch" else str(args.sync_iterations)]
                run_dir = train("tracking", flags, root, name)
                s = scalars(run_dir)
                per_mode[mode] = {"bytes": statistics.median(steady(s["Comm/weight_sync_bytes"], 1)),
                                  "series": steady(s["Comm/weight_sync_bytes"], 0),
                                  "calls": statistics.median(steady(s["Comm/weight_sync_calls"], 1)),
                                  "lr": statistics.median(steady(s["Loss/learning_rate"], 0))}
                if mode == "patch":
                    paths = sorted(glob.glob(os.path.join(run_dir, "model_*.pt")),
                                   key=lambda p: int(p.rsplit("_", 1)[1][:-3]))
            states = [torch.load(p, map_location="cpu", weights_only=False)["model"] for p in paths]
            first = torch.load(paths[0], map_location="cpu", weights_only=False)
            copy = receiver_model(first["model"], first["config"]["policy"], getattr(torch, dtype))
            dtypes = {k: v.dtype for k, v in copy.state_dict().items()}
            counts = [changed_share(a, b, dtypes) for a, b in zip(states, states[1:])]
            timed = replay(paths, dtype)
            patch_changed = [c for _, c in timed["stats"]["patch"]]
            # The ledger logged at iteration k + 1 holds version k - 1 (sent after iteration k's log line); the
            # replay's patches are versions 2..N (model_2.pt ...), so they match the ledger from iteration 3 on.
            n = len(paths)
            same_bytes = ([b for b, _ in timed["stats"]["patch"]][:n - 2] == per_mode["patch"]["series"][2:n] and
                          {b for b, _ in timed["stats"]["bucket"]} == set(per_mode["bucket"]["series"][2:n]))
            agree = patch_changed == [c for c, _ in counts] and same_bytes
            rows.append({"lr": lr_name, "dtype": dtype, "modes": per_mode, "agree": agree,
                         "share": statistics.median(c / t for c, t in counts),
                         "send_ms": {m: 1e3 * statistics.median(timed["send"][m]) for m in ("patch", "bucket")},
                         "apply_ms": {m: 1e3 * statistics.median(timed["apply"][m]) for m in ("patch", "bucket")}})
            r = rows[-1]
            print(f"  {lr_name}, {dtype}: {100 * r['share']:.1f}% changed, "
                  f"patch {r['modes']['patch']['bytes']:,.0f} B, "
                  f"bucket {r['modes']['bucket']['bytes']:,.0f} B per iteration", flush=True)
    print(f"\nweight sync per iteration (tracking model, 1 + 1 sync mode, {args.sync_iterations} iterations per job; "
          f"medians over iterations)")
    print("| learning rate | copy | median LR | elements changed | patch bytes | bucket bytes | patch / bucket bytes | "
          "patch sync + apply (ms) | bucket sync + apply (ms) | patch / bucket apply time | messages patch / bucket |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p, b = r["modes"]["patch"], r["modes"]["bucket"]
        print(f"| {r['lr']} | {r['dtype']} | {p['lr']:.1e} | {100 * r['share']:.1f}% | {p['bytes']:,.0f} | "
              f"{b['bytes']:,.0f} | {p['bytes'] / b['bytes']:.2f} | "
              f"{r['send_ms']['patch']:.2f} + {r['apply_ms']['patch']:.2f} "
              f"| {r['send_ms']['bucket']:.2f} + {r['apply_ms']['bucket']:.2f} | "
              f"{r['apply_ms']['patch'] / r['apply_ms']['bucket']:.2f} | {p['calls']:.0f} / {b['calls']:.0f} |")
    print("Bytes: the learner's ledger (Comm/weight_sync_bytes) of the job in that mode. Time: the patch job's weights "
          "replayed through both syncers, alternating which goes first; sync = sender's call, apply = receiver's "
          "(from a common barrier, so it includes waiting for the data). Elements changed: bits differing between "
          "consecutive versions in the copy's dtype, over the whole state_dict.")
    for r in rows:
        print(f"check {r['lr']}, {r['dtype']}: patch's changed-element counts == the checkpoint diff and replayed "
              f"bytes == the training jobs' ledger, version by version: {'yes' if r['agree'] else 'NO'}")
    print(flush=True)


# ---- 3. learning -----------------------------------------------------------------------------------------

def learning(args, root: str) -> None:
    variants = {"colocated": ("coloc", ["--env.num-envs", "256"]),
                "async --rollout.recompute off": ("async", [*VARIANTS["async"], "--rollout.recompute", "off"]),
                "async (recompute on, the default)": ("asyncrc", VARIANTS["async"])}
    jobs = {(variant, seed): [*flags, "--seed", str(seed), "--log.print-every", "50"]
            for seed in args.seeds for variant, (_, flags) in variants.items()}

    def run(key):
        variant, seed = key
        name = f"{variants[variant][0]}_s{seed}"
        done = glob.glob(os.path.join(root, name, "*", "model_400.pt"))
        run_dir = os.path.dirname(sorted(done)[-1]) if done else train("tracking", jobs[key], root, name, nice=10)
        s = scalars(run_dir)
        rewards = [v for _, _, v in s["Train/mean_reward"]]
        walls = [w for _, w, _ in s["Train/mean_reward"]]
        return key, statistics.fmean(rewards[-10:]), len(rewards), walls[-1] - walls[0]

    with ThreadPoolExecutor(2) as pool:     # two 2-process jobs at a time
        try:
            results = dict((k, v) for k, *v in pool.map(run, jobs))
        except BaseException:
            stop_all()      # else the pool's exit waits for its running and queued jobs (an hour)
            raise
    print("\nlearning: tracking preset, 400 iterations, 12,288 transitions per iteration; return = mean "
          "Train/mean_reward of the last 10 iterations")
    print("| variant | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean | wall (min, 2 jobs at a time) |")
    print("|---|" + "---|" * (len(args.seeds) + 2))
    for variant in variants:
        values = [results[(variant, s)][0] for s in args.seeds]
        walls = [results[(variant, s)][2] / 60 for s in args.seeds]
        print(f"| {variant} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {statistics.fmean(values):.1f} | "
              + " / ".join(f"{w:.1f}" for w in walls) + " |")
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tracking throughput, one round, one weight-sync case")
    parser.add_argument("--parts", nargs="+", choices=("throughput", "sync", "learning"), default=None)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "out", "rollout"),
                        help="run directories; learning jobs that finished here are reused")
    args = parser.parse_args()
    refuse_torchrun(parser)
    refuse_repeats(parser, "--parts", args.parts or [])
    if args.quick:
        args.parts = args.parts or ["throughput", "sync"]
        args.envs, args.rounds, args.iterations = ["tracking"], 1, {"tracking": 7}
        args.lrs, args.dtypes, args.sync_iterations = {k: v for k, v in list(LRS.items())[:1]}, ["float32"], 4
        if "learning" in args.parts:      # it has no quick size: 400-iteration jobs would run under a "smoke run"
            parser.error("--quick has no learning part (its jobs run 400 iterations, about an hour): drop --quick or "
                         "leave learning out of --parts")
    else:
        args.parts = args.parts or ["throughput", "sync", "learning"]
        args.envs, args.rounds, args.iterations = ["tracking", "mujoco"], 2, {"tracking": 14, "mujoco": 8}
        args.lrs, args.dtypes, args.sync_iterations = LRS, ["float32", "bfloat16"], 12
    args.seeds = [1, 2]
    # The jobs run in the repository: a relative --out would put their runs there, not where this reads them ('':
    # left as it is, refused below).
    args.out = os.path.abspath(args.out) if args.out else args.out
    try:      # a file of that name, a read-only place (/proc, where root's makedirs passes): one line, before any job
        os.makedirs(args.out, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix="run_", dir=args.out)   # throughput and sync jobs: removed when done
    except OSError as exc:
        parser.error(f"--out {args.out!r} cannot hold run directories ({exc.strerror or type(exc).__name__})")
    print(f"bench_rollout: {', '.join(args.parts)}; runs under {scratch}; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores at start" + ("; --quick: one round, the ratios move by tens of percent "
                                                   "from run to run" if args.quick else ""), flush=True)
    try:
        if "throughput" in args.parts:
            throughput(args, os.path.join(scratch, "throughput"))
        if "sync" in args.parts:
            weight_sync(args, os.path.join(scratch, "sync"))
    except KeyboardInterrupt:    # Ctrl-C or SIGTERM: stopped on purpose, its jobs' directories are nothing to look at
        stop_all()
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    except BaseException:
        print(f"bench_rollout: the jobs' run directories are kept in {scratch}", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(scratch)
    if "learning" in args.parts:
        learning(args, os.path.join(args.out, "learning"))
    print(f"load average {os.getloadavg()[0]:.1f} at the end", flush=True)


if __name__ == "__main__":
    stopped_main("bench_rollout", main)
