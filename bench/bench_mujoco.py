"""The `mujoco` preset (CleanRL's ppo_continuous_action setting) next to CleanRL's published returns.

Each run is a fresh `train.py mujoco` process: 1 rank (python) or W ranks (torchrun, gloo on CPU) with
the same global batch, i.e. --ppo.num-steps 2048 / W per rank, so every configuration sees 2048
transitions and 32 minibatches of 64 per iteration.

    python bench/bench_mujoco.py                                   # 3 tasks x 3 seeds x {1, 2} ranks, 1M steps: hours
    python bench/bench_mujoco.py --tasks Hopper-v4 --seeds 1 --ranks 1
    python bench/bench_mujoco.py --table-only                      # print the table of the runs done so far

Final return of a run: the mean of Train/mean_reward (raw episodic return of the episodes that ended
in an iteration) over its last --last-iterations iterations. The table shows the mean +- std (numpy's,
ddof 0) of that over seeds, and the wall time per run (process start to exit). Results are appended to
ROOT/results.jsonl as each run finishes, so a long background job can be read while it runs, and
finished runs are not repeated.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import time

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def final_return(root: str, last_iterations: int) -> float:
    (events,) = glob.glob(os.path.join(root, "mujoco", "*", "events.out.tfevents.*"))
    accumulator = EventAccumulator(events, size_guidance={"scalars": 0})
    accumulator.Reload()
    returns = [event.value for event in accumulator.Scalars("Train/mean_reward")]
    return float(np.mean(returns[-last_iterations:]))


def run(task: str, ranks: int, seed: int, total_steps: int, args) -> dict:
    root = os.path.join(args.root, run_key(task, ranks, seed, total_steps))
    os.makedirs(root, exist_ok=True)
    iterations = total_steps // GLOBAL_STEPS_PER_ITERATION
    command = train_command(task, ranks, seed, iterations, root)
    log_path = os.path.join(root, "train.log")
    print(f"[bench] {' '.join(command)}  > {log_path}", flush=True)
    start = time.time()
    with open(log_path, "w") as log:
        code = subprocess.call(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    wall = time.time() - start
    if code:
        raise RuntimeError(f"{task} ranks {ranks} seed {seed} exited with {code}; see {log_path}")
    return {"key": run_key(task, ranks, seed, total_steps), "task": task, "ranks": ranks, "seed": seed,
            "steps": iterations * GLOBAL_STEPS_PER_ITERATION, "final_return": final_return(root, args.last_iterations),
            "wall_s": wall}


def load_results(path: str) -> dict[str, dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["key"]: r for r in map(json.loads, f)}


def spread(returns: np.ndarray) -> str:
    return f"{returns.mean():.2f} ± {returns.std():.2f}" if len(returns) > 1 else f"{returns[0]:.2f} (one seed)"


def table(results: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["task"], r["ranks"], r["steps"]), []).append(r)
    lines = ["| task | ranks x steps/rank | env steps | seeds | final return (mean ± std) | CleanRL (1M) "
             "| wall time per run |", "|---|---|---|---|---|---|---|"]
    for (task, ranks, steps), runs in sorted(groups.items()):
        returns = np.array([r["final_return"] for r in runs])
        walls = np.array([r["wall_s"] for r in runs]) / 60
        published = "{:.2f} ± {:.2f}".format(*CLEANRL[task]) if task in CLEANRL else "-"
        lines.append(f"| {task} | {ranks} x {GLOBAL_STEPS_PER_ITERATION // ranks} | {steps:,} | "
                     f"{', '.join(str(r['seed']) for r in runs)} | {spread(returns)} | "
                     f"{published} | {walls.mean():.1f} min |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(CLEANRL), help="gymnasium task ids")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="base seeds (--seed)")
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2], help="world sizes, same global batch")
    parser.add_argument("--total-steps", type=int, default=1_000_000, help="env steps per run (all ranks)")
    parser.add_argument("--last-iterations", type=int, default=10, help="iterations averaged into the final return")
    parser.add_argument("--root", default=os.path.join(REPO, "runs", "bench_mujoco"), help="runs and results.jsonl")
    parser.add_argument("--table-only", action="store_true", help="print the table of finished runs and exit")
    args = parser.parse_args()
    for ranks in args.ranks:
        if ranks < 1 or GLOBAL_STEPS_PER_ITERATION % ranks:
            parser.error(f"--ranks {ranks}: must divide the {GLOBAL_STEPS_PER_ITERATION} steps per iteration")
    if args.total_steps < GLOBAL_STEPS_PER_ITERATION * args.last_iterations:
        parser.error(f"--total-steps must cover --last-iterations x {GLOBAL_STEPS_PER_ITERATION} steps")

    results_path = os.path.join(args.root, "results.jsonl")
    results = load_results(results_path)
    if not args.table_only:
        os.makedirs(args.root, exist_ok=True)
        for task in args.tasks:
            for ranks in args.ranks:
                for seed in args.seeds:
                    key = run_key(task, ranks, seed, args.total_steps)
                    if key in results:
                        continue
                    results[key] = run(task, ranks, seed, args.total_steps, args)
                    with open(results_path, "a") as f:
                        f.write(json.dumps(results[key]) + "\n")
                    print(f"[bench] {key}: final return {results[key]['final_return']:.2f}, "
                          f"{results[key]['wall_s'] / 60:.1f} min", flush=True)
    print(table(list(results.values())))


if __name__ == "__main__":
    main()
