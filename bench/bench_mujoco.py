"""The `mujoco` preset (CleanRL's ppo_continuous_action setting) next to CleanRL's published returns.

Each run is a fresh `train.py mujoco` process: 1 rank (python) or W ranks (torchrun, gloo on CPU) with
the same global batch, i.e. --ppo.num-steps 2048 / W per rank, so every configuration sees 2048
transitions and 32 minibatches of 64 per iteration.

    python bench/bench_mujoco.py                                   # 3 tasks x 3 seeds x {1, 2} ranks, 1M steps: hours
    python bench/bench_mujoco.py --tasks Hopper-v4 --seeds 1 --ranks 1
    python bench/bench_mujoco.py --table-only                      # print the table of the runs done so far

Final return of a run, two ways, both from raw (unnormalized) episodic returns:
  - CleanRL's statistic (openrlbenchmark): the mean of the last --last-episodes (100) episodes the run
    finished, read from the Episode/return scalars rank 0 writes for each finished episode (with 2 ranks:
    every rank's, gathered to rank 0; until 2026-12-02 rank 0's envs alone);
  - the mean of Train/mean_reward (episodes ended in an iteration, all ranks) over the last
    --last-iterations (10) iterations.
The table shows the mean +- population std (ddof 0, as CleanRL's table) of each over seeds, CleanRL's
published number beside it, and the wall time per run (process start to exit). Results are appended
to ROOT/results.jsonl as each run finishes (with the gymnasium, mujoco and torch versions), so a long
background job can be read while it runs, and finished runs are not repeated. --jobs 2 runs two
configurations at a time (one per core for 1-rank runs); --jobs x the largest --ranks is held to 4 ranks per CPU core.
"""

import argparse
import concurrent.futures
import glob
import json
import os
import subprocess
import sys
import threading
import time
from importlib.metadata import version

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench._common import refuse_repeats, refuse_torchrun, run_child, stop_all, stopped_main  # noqa: E402
from configs import preset  # noqa: E402
from dist.log_root import check_writable_root  # noqa: E402
from dist.errors import UsageError  # noqa: E402

CLEANRL = {"HalfCheetah-v4": (1442.64, 46.03), "Walker2d-v4": (2287.95, 571.78), "Hopper-v4": (2382.86, 271.74)}
GLOBAL_STEPS_PER_ITERATION = 2048


def run_key(task: str, ranks: int, seed: int, total_steps: int) -> str:
    return f"{task}/ranks{ranks}/seed{seed}/steps{total_steps}"


def train_command(task: str, ranks: int, seed: int, iterations: int, root: str) -> list[str]:
    flags = ["mujoco", "--env.task", task, "--seed", str(seed), "--max-iterations", str(iterations),
             "--ppo.num-steps", str(GLOBAL_STEPS_PER_ITERATION // ranks), "--log.root", root, "--log.print-every", "10"]
    if ranks == 1:
        return [sys.executable, "train.py", *flags]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--standalone", "--nproc-per-node", str(ranks), "train.py", *flags]


def final_returns(root: str, last_episodes: int, last_iterations: int) -> dict:
    """CleanRL's statistic (mean of the last `last_episodes` episodic returns) and the mean of the
    per-iteration mean return over the last `last_iterations` iterations, from the run's TensorBoard file."""
    # The newest run directory: an interrupted earlier attempt of the same run may have left its own.
    events = sorted(glob.glob(os.path.join(root, "mujoco", "*", "events.out.tfevents.*")))[-1]
    accumulator = EventAccumulator(events, size_guidance={"scalars": 0})   # 0: keep every value
    accumulator.Reload()
    episodes = [event.value for event in accumulator.Scalars("Episode/return")]   # in the order they ended
    if len(episodes) < last_episodes:
        raise RuntimeError(f"{root}: only {len(episodes)} episodes finished, "
                           f"fewer than --last-episodes {last_episodes}")
    iterations = [event.value for event in accumulator.Scalars("Train/mean_reward")]
    return {"last_episodes_return": float(np.mean(episodes[-last_episodes:])), "episodes": len(episodes),
            "last_iterations_return": float(np.mean(iterations[-last_iterations:]))}


def run(task: str, ranks: int, seed: int, total_steps: int, args) -> dict:
    root = os.path.join(args.root, run_key(task, ranks, seed, total_steps))
    os.makedirs(root, exist_ok=True)
    iterations = total_steps // GLOBAL_STEPS_PER_ITERATION
    command = train_command(task, ranks, seed, iterations, root)
    log_path = os.path.join(root, "train.log")
    print(f"[bench] {' '.join(command)}  > {log_path}", flush=True)
    start = time.time()
    with open(log_path, "w") as log:
        code = run_child(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    wall = time.time() - start
    if code:     # one line, not a traceback: the reason is in the run's log
        raise SystemExit(f"bench_mujoco: {task} ranks {ranks} seed {seed} exited with {code}; see {log_path}")
    try:     # too few episodes for --last-episodes: one line, as with_windows says it, not a thread's traceback
        returns = final_returns(root, args.last_episodes, args.last_iterations)
    except RuntimeError as exc:
        raise SystemExit(f"bench_mujoco: {exc}; lower --last-episodes") from None
    return {"key": run_key(task, ranks, seed, total_steps), "task": task, "ranks": ranks, "seed": seed,
            "steps": iterations * GLOBAL_STEPS_PER_ITERATION, "wall_s": wall, "versions": VERSIONS,
            "windows": [args.last_episodes, args.last_iterations], **returns}


def with_windows(results: dict[str, dict], args) -> list[dict]:
    """The results with their statistics over this command's --last-episodes and --last-iterations, recomputed
    from each run's TensorBoard file (the table's headers name these windows, whatever a run was recorded with)."""
    out = []
    for key, result in results.items():
        root = os.path.join(args.root, key)
        windows = [args.last_episodes, args.last_iterations]
        if glob.glob(os.path.join(root, "mujoco", "*", "events.out.tfevents.*")):
            try:
                result = {**result, **final_returns(root, *windows), "windows": windows}
            except RuntimeError as exc:
                raise SystemExit(f"bench_mujoco: {exc}") from None
        elif result.get("windows") != windows:
            raise SystemExit(f"bench_mujoco: {key} was recorded over windows {result.get('windows', 'unknown')} "
                             f"(last episodes, iterations) and its TensorBoard file is gone; pass those windows")
        out.append(result)
    return out


def load_results(path: str) -> dict[str, dict]:
    if not os.path.exists(path):
        return {}
    records, number = [], 0
    try:       # a run killed while its line was appended leaves half a line: one line naming it, not a traceback
        with open(path, "rb") as f:       # bytes: a line that is not UTF-8 fails at its own number
            for number, line in enumerate(f, 1):
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("key"), str):
                    raise ValueError("not a record with a 'key'")
                records.append(record)
    except OSError as exc:
        raise SystemExit(f"bench_mujoco: {path} cannot be read ({exc.strerror or exc}); pick another --root")
    except ValueError as exc:      # json's and the codec's errors too
        raise SystemExit(f"bench_mujoco: {path} line {number} is not a result this bench wrote ({exc}); delete that "
                         f"line, or pick another --root") from None
    old = [r["key"] for r in records if "last_episodes_return" not in r]
    if old:   # written before the episode statistic existed, by an older mujoco preset: run them again
        print(f"[bench] ignoring {len(old)} results of an older bench version in {path}: {', '.join(old)}")
    return {r["key"]: r for r in records if "last_episodes_return" in r}


VERSIONS = {name: version(name) for name in ("gymnasium", "mujoco", "torch")}


def spread(returns: np.ndarray) -> str:
    """Mean ± population std (ddof 0) over seeds, as CleanRL's table; one seed is marked as such."""
    return f"{returns.mean():.2f} ± {returns.std():.2f}" if len(returns) > 1 else f"{returns[0]:.2f} (one seed)"


def verdict(returns: np.ndarray, task: str) -> str:
    """Whether the seeds' mean is within one of CleanRL's standard deviations of its mean, or above it."""
    if task not in CLEANRL or len(returns) < 2:
        return "-"
    mean, std = CLEANRL[task]
    return "yes" if returns.mean() >= mean - std else f"no ({(mean - returns.mean()) / std:.1f} std below)"


def table(results: list[dict], last_episodes: int, last_iterations: int) -> str:
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["task"], r["ranks"], r["steps"]), []).append(r)
    lines = [f"| task | ranks x steps/rank | env steps | seeds | last {last_episodes} episodes (CleanRL's statistic) "
             f"| last {last_iterations} iterations | CleanRL (1M) | within CleanRL's std | wall time per run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (task, ranks, steps), runs in sorted(groups.items()):
        runs.sort(key=lambda r: r["seed"])
        episodes = np.array([r["last_episodes_return"] for r in runs])
        iterations = np.array([r["last_iterations_return"] for r in runs])
        walls = np.array([r["wall_s"] for r in runs]) / 60
        published = "{:.2f} ± {:.2f}".format(*CLEANRL[task]) if task in CLEANRL else "-"
        lines.append(f"| {task} | {ranks} x {GLOBAL_STEPS_PER_ITERATION // ranks} | {steps:,} | "
                     f"{', '.join(str(r['seed']) for r in runs)} | {spread(episodes)} | {spread(iterations)} | "
                     f"{published} | {verdict(episodes, task)} | {walls.mean():.1f} min |")
    versions = sorted({json.dumps(r["versions"], sort_keys=True) for r in results})
    lines.append("versions: " + "; ".join(named_versions(json.loads(v)) for v in versions))
    return "\n".join(lines)


def named_versions(versions: dict) -> str:
    """A run's versions as the table's versions line and its refusals write them (`gymnasium 1.0.0, torch ...`)."""
    return ", ".join(f"{name} {value}" for name, value in versions.items())


def check_rows(results: list[dict], path: str) -> None:
    """Refuse a table row (task, ranks, whole-iteration steps) whose runs are not seeds of one setting: one seed twice
    (two --total-steps that round to one iteration count give one training command: the same run twice), or runs
    under other gymnasium, mujoco or torch versions. The row would average them as independent seeds, and shows
    neither the keys nor which run had which versions."""
    rows: dict[tuple, list[dict]] = {}
    for r in sorted(results, key=lambda r: r["key"]):
        rows.setdefault((r["task"], r["ranks"], r["steps"]), []).append(r)
    for (task, ranks, steps), runs in rows.items():
        for i, r in enumerate(runs):
            for other in runs[:i]:
                if other["seed"] == r["seed"]:
                    reason = f"are seed {r['seed']} twice"
                elif other["versions"] != r["versions"]:
                    theirs, its = named_versions(other["versions"]), named_versions(r["versions"])
                    reason = f"ran under other versions ({theirs}; {its})"
                else:
                    continue
                raise SystemExit(f"bench_mujoco: {other['key']} and {r['key']} {reason} in one table row ({task}, "
                                 f"ranks {ranks}, {steps:,} steps); delete the lines of one from {path}, or pass "
                                 f"another --root")


def check_tasks(parser: argparse.ArgumentParser, tasks: list[str]) -> None:
    """Refuse a task id gymnasium does not know (train.py would exit on it after the run started)."""
    import gymnasium     # only here: --table-only does not need it
    for task in tasks:
        try:
            gymnasium.spec(task)
            space = gymnasium.make(task).action_space     # train.py's adapter takes 1-D continuous actions only
        except gymnasium.error.Error as exc:
            parser.error(f"--tasks {task!r}: {exc}")
        if not isinstance(space, gymnasium.spaces.Box) or len(space.shape) != 1:
            parser.error(f"--tasks {task!r}: needs a 1-D continuous (Box) action space, got {space}")


def check_rounding(parser: argparse.ArgumentParser, results: dict[str, dict], args, path: str) -> None:
    """Refuse a --total-steps that rounds (down to whole iterations) to the step count of recorded runs of another
    --total-steps of the same task and ranks: keyed apart, run again, they would share one table row (seeds 1, 1)."""
    steps = args.total_steps // GLOBAL_STEPS_PER_ITERATION * GLOBAL_STEPS_PER_ITERATION
    for key, r in results.items():
        typed = key.rpartition("/steps")[2]
        if (r.get("task") in args.tasks and r.get("ranks") in args.ranks and r.get("steps") == steps
                and typed != str(args.total_steps)):
            parser.error(f"--total-steps {args.total_steps} rounds to {steps:,} steps, as --total-steps {typed} of "
                         f"the runs recorded in {path} does: one table row would hold both; pass --total-steps "
                         f"{typed} (or another --root)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(CLEANRL), help="gymnasium task ids")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="base seeds (--seed)")
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2], help="world sizes, same global batch")
    parser.add_argument("--total-steps", type=int, default=1_000_000, help="env steps per run (all ranks)")
    parser.add_argument("--last-episodes", type=int, default=100, help="episodes averaged into CleanRL's statistic")
    parser.add_argument("--last-iterations", type=int, default=10, help="iterations averaged into the second statistic")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each rank is one process)")
    parser.add_argument("--root", default=os.path.join(REPO, "runs", "bench_mujoco"), help="runs and results.jsonl")
    parser.add_argument("--table-only", action="store_true", help="print the table of finished runs and exit")
    args = parser.parse_args()
    refuse_torchrun(parser)
    for flag, values in (("--tasks", args.tasks), ("--seeds", args.seeds), ("--ranks", args.ranks)):
        refuse_repeats(parser, flag, values)    # the same run twice (at once with --jobs 2: into one run directory)
    minibatches = preset("mujoco").ppo.num_mini_batches       # of transitions, at least 2 each (per-minibatch std)
    for ranks in args.ranks:
        if ranks < 1 or GLOBAL_STEPS_PER_ITERATION % ranks:
            parser.error(f"--ranks {ranks}: must divide the {GLOBAL_STEPS_PER_ITERATION} steps per iteration")
        steps = GLOBAL_STEPS_PER_ITERATION // ranks
        if steps % minibatches or steps < 2 * minibatches:
            parser.error(f"--ranks {ranks}: each rank's {steps} steps must split into "
                         f"the mujoco preset's {minibatches} minibatches of at least 2; use at most "
                         f"{GLOBAL_STEPS_PER_ITERATION // (2 * minibatches)} ranks")
    for flag, value in (("--jobs", args.jobs), ("--last-episodes", args.last_episodes),
                        ("--last-iterations", args.last_iterations)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    cores, most = os.cpu_count(), args.jobs * max(args.ranks)    # --jobs runs at once, each up to max(--ranks)
    if cores and most > 4 * cores and not args.table_only:    # the Makefile's NPROC bound: each rank is a process
        parser.error(f"--jobs {args.jobs} x --ranks {max(args.ranks)} is {most} ranks at a time, more than this "
                     f"machine can host: at most 4 per CPU core ({cores} cores, so {4 * cores} ranks)")
    if args.total_steps < GLOBAL_STEPS_PER_ITERATION * args.last_iterations:
        parser.error(f"--total-steps must cover --last-iterations x {GLOBAL_STEPS_PER_ITERATION} steps")
    top = 2**32 - 1                        # train.py's --seed range (each rank derives its own by rank_seed)
    bad = [seed for seed in args.seeds if not 0 <= seed <= top]
    if bad:
        parser.error(f"--seeds must be in [0, {top}], got {', '.join(map(str, bad))}")
    try:
        check_writable_root(args.root, "--root", write=not args.table_only)
    except UsageError as exc:
        parser.error(str(exc))
    args.root = os.path.abspath(args.root)    # train.py runs in the repository: a relative --root, read from here,
    # would put each run's logs under the repository, and the bench fail to find them (an IndexError) once it ended
    if not args.table_only:
        check_tasks(parser, args.tasks)

    results_path = os.path.join(args.root, "results.jsonl")
    results = load_results(results_path)
    if not args.table_only:
        os.makedirs(args.root, exist_ok=True)
        check_rounding(parser, results, args, results_path)
        todo = [(task, ranks, seed) for task in args.tasks for ranks in args.ranks for seed in args.seeds
                if run_key(task, ranks, seed, args.total_steps) not in results]
        lock, failed = threading.Lock(), threading.Event()

        def run_and_record(task, ranks, seed):
            if failed.is_set():         # a run failed: start no queued one
                return
            try:
                result = run(task, ranks, seed, args.total_steps, args)
            except BaseException:
                failed.set()
                raise
            with lock:
                results[result["key"]] = result
                with open(results_path, "a") as f:
                    f.write(json.dumps(result) + "\n")
                print(f"[bench] {result['key']}: last {args.last_episodes} episodes "
                      f"{result['last_episodes_return']:.2f}, "
                      f"last {args.last_iterations} iterations {result['last_iterations_return']:.2f}, "
                      f"{result['wall_s'] / 60:.1f} min", flush=True)

        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            try:
                for future in [pool.submit(run_and_record, *job) for job in todo]:
                    future.result()
            except KeyboardInterrupt:    # Ctrl-C, SIGTERM: else the pool's exit waits for every run (hours)
                failed.set()
                stop_all()
                raise
    if not results:
        raise SystemExit(f"bench_mujoco: no finished runs in {os.path.join(args.root, 'results.jsonl')}")
    finished = with_windows(results, args)
    check_rows(finished, results_path)
    print(table(finished, args.last_episodes, args.last_iterations))


if __name__ == "__main__":
    stopped_main("bench_mujoco", main)
