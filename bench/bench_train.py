"""Training throughput: syncppo vs RSL-RL, interleaved iteration by iteration, against the matmul limit.

    python bench/bench_train.py            # small (512 envs, (128, 128)) and large (4096 envs, (512, 256, 128))
    python bench/bench_train.py --quick    # fewer iterations (a few minutes)
    python bench/bench_train.py --device cuda --settings large --capture-step   # on a GPU (bench/gpu_check.sh)

Both learners run in this one process on the same `tracking` env settings, T, N, epochs, minibatches (of single
transitions, as RSL-RL's: the preset's are whole env trajectories), networks (a learned log std), LR schedule and
losses (RSL-RL: rsl-rl-lib, installed by `make bench`, configured in bench/rsl_rl_adapter.py). They take
turns one iteration at a time: syncppo's `train.main` in the main thread, RSL-RL's `OnPolicyRunner.learn` in a second
thread, passing a baton at each iteration's logging call, so exactly one of them runs at any moment and load from
other processes hits both alike. After every RSL-RL iteration the same thread times `torch.mm` for exactly the GEMM
shapes of one update (forward, grad-input and grad-weight of every Linear layer at the minibatch size): that sum is
the matmul limit of the update on this CPU, re-measured each round; the least-loaded round counts as the limit, so "%
of matmul limit" (limit over the median update time) is a lower bound on a loaded machine. Ratios are medians of
per-round ratios.

Both phases hold the same work for both learners: RSL-RL computes its GAE, the critic on the last observation and
the advantage normalization inside its learning clock, syncppo in collection, so that call (`compute_returns`) is
timed and moved to RSL-RL's collection (the update ratio of RSL-RL's own split is printed below the table).
What still differs is printed below each table (DIFFERENCES) rather than hidden.
Both learners draw from the one global torch RNG in turn, so neither reproduces its standalone run.
The host-memory setting `train.main` applies on CPU (glibc, process-wide, dist/setup.py) holds for both
from syncppo's start-up on, before either learner's first iteration. RSL-RL's own scripts keep glibc's defaults,
which map large activations fresh at every minibatch: at the large setting its update took 18.3 s under them
and 13.3 s under this setting (docs/benchmarks.md).
syncppo at 2 ranks (torchrun, small setting, full run only) is timed separately for the scaling row.

On CUDA (`--device cuda`) both learners and the env run on the GPU, on its default stream, where small networks
are bound by kernel launches and host syncs rather than FLOPs, and `--capture-step` runs syncppo's sync-free,
CUDA-graph minibatch step (`--ppo.capture-step`). Every clock read waits for the device: syncppo's phase clocks
sync (train.finished); RSL-RL's do not, so the rollout work still queued when its collection clock stops is drained
at `compute_returns` and counted as collection, and its update's queued work is drained at its logging call and
counted as update; each learner drains the device before it passes the baton, so neither's work runs on the
other's clock. The matmul limit there is the update's GEMMs alone, queued back to back between two syncs (a sync
around each shape would time a host round trip per GEMM): the update also runs elementwise kernels between them,
so on a GPU "% of matmul limit" is the GEMMs' share of the update, not a distance to a roofline.
Designed and tested on CPU with the device syncs faked; not yet run on a GPU.
"""

import argparse
import contextlib
import importlib.metadata
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from configs import preset, validate  # noqa: E402
from dist.errors import UsageError, first_line, out_of_memory  # noqa: E402
from bench._common import omp_threads, refuse_repeats, refuse_torchrun, run_child, stopped_main  # noqa: E402
from bench.rsl_rl_adapter import rsl_rl_runner  # noqa: E402
from envs import make_env  # noqa: E402

SETTINGS = {"small": (512, (128, 128)), "large": (4096, (512, 256, 128))}
# (iterations, warm-up iterations left out of the medians) per setting. The first iteration holds each learner's
# allocations, cuBLAS handle and heuristics and, with --capture-step, the 3 eager steps and the graph's recording
# (all in the first update: 20 minibatch steps); on CUDA the second is left out too, and rounds are cheap there.
ITERATIONS = {"cpu": {"small": (20, 3), "large": (6, 2)}, "cuda": {"small": (20, 3), "large": (10, 3)},
              "quick": {"small": (8, 2), "large": (3, 1)}}
DIFFERENCES = (
    "RSL-RL normalizes advantages in compute_returns (here its collection), syncppo in its update: two reductions",
    "RSL-RL clips the actor's and the critic's gradients each to max_grad_norm, syncppo one global norm over both "
    "(its distributed rule): same FLOPs, a slightly different step",
    "time-out bootstrap: RSL-RL adds gamma * V(the step's first observation), a value it has; syncppo "
    "gamma * V(final observation before the reset), a critic forward on the timed-out envs (collection)",
    "RSL-RL reads each step's outputs for NaN on the host (per observation group, rewards, dones: 4 reads), "
    "syncppo the rollout's for non-finite values once (collection)",
    "minibatches: syncppo draws a new permutation every epoch, RSL-RL one per update (same sizes, same gathers)",
)


class Baton:
    """Strict alternation between named runners; a runner that finishes drops out of the rotation."""

    def __init__(self, names: list[str]):
        self.order, self.turn, self.cond = list(names), names[0], threading.Condition()

    def wait_turn(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == name)

    def pass_on(self, name: str, finished: bool = False) -> None:
        with self.cond:
            i = self.order.index(name)
            nxt = self.order[(i + 1) % len(self.order)]
            if finished:
                self.order.remove(name)
            self.turn = nxt if self.order else None
            self.cond.notify_all()
        if not finished:
            self.wait_turn(name)


def gemm_shapes(in_dims: dict[str, int], hidden: tuple[int, ...], num_actions: int, batch: int) -> list:
    """(M, K, N) of every matmul in one minibatch step: per Linear layer the forward x @ W^T, the weight
    gradient g^T @ x and (except the first layer, whose input needs no gradient) the input gradient g @ W."""
    shapes = []
    for net, out in (("policy", num_actions), ("critic", 1)):
        dims = [in_dims[net], *hidden, out]
        for layer, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            shapes += [(batch, d_in, d_out), (d_out, batch, d_in)]
            if layer > 0:
                shapes.append((batch, d_out, d_in))
    return shapes


def matmul_limit_seconds(shapes: list, device: torch.device) -> float:
    """Seconds for one pass of torch.mm over `shapes`, on this thread or GPU. On CPU the sum of each shape's best of
    3 (operands made one shape at a time: the large setting's take 0.6 GB together). On a GPU the best of 3
    whole passes queued back to back between two syncs, as an update queues its GEMMs: a sync around each shape would
    add a host round trip per GEMM, the size of a small GEMM's own time."""
    if device.type == "cuda":
        operands = [(torch.randn(m, k, device=device), torch.randn(k, n, device=device)) for m, k, n in shapes]
        for a, b in operands:
            torch.mm(a, b)          # first calls: cuBLAS heuristics and workspace, outside the clock
        best = float("inf")
        for _ in range(3):
            _synchronize(device)
            t = time.perf_counter()
            for a, b in operands:
                torch.mm(a, b)
            _synchronize(device)
            best = min(best, time.perf_counter() - t)
        return best
    total = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
        total += best
    return total


def progress(learner: str, iteration: int, collect: float, update: float, extra: str = "") -> None:
    """One iteration's phase times on stderr (both learners' stdout is silenced), written as it ends."""
    print(f"[bench_train] {learner} iteration {iteration}: collection {collect:.4f} s, update {update:.4f} s{extra}",
          file=sys.stderr, flush=True)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StopRslRl(Exception):
    """Raised inside RSL-RL's logging call to end its learn() when syncppo stopped on request; anything else RSL-RL
    raises (an InterruptedError of its own included) is a failure the bench reports."""


def run_interleaved(cfg, tmp: str, limit_shapes: list, device: torch.device) -> dict[str, list]:
    """Per iteration: syncppo (collect, update) s; RSL-RL (collect, update, of which compute_returns) s with its
    compute_returns moved from update to collect; the matmul limit s. Each round is also printed to stderr as it
    ends, so that a run stopped by a time box still leaves its rounds."""
    rows = {"syncppo": [], "rsl-rl": [], "limit": []}
    baton = Baton(["syncppo", "rsl-rl"])
    cfg.log.root, cfg.log.print_every, cfg.log.save_every = os.path.join(tmp, "syncppo"), 10**6, 10**6

    class TimedLogger(train.RunLogger):          # train.main logs once per iteration on rank 0
        def log(self, scalars, step, episode_returns=()):
            super().log(scalars, step, episode_returns)
            rows["syncppo"].append((scalars["Perf/collection_time"], scalars["Perf/learning_time"]))
            _synchronize(device)     # the metrics' kernels, queued after the phase clocks, not on RSL-RL's clock
            progress("syncppo", len(rows["syncppo"]), *rows["syncppo"][-1])
            baton.pass_on("syncppo")

    torch.manual_seed(cfg.seed)
    runner = rsl_rl_runner(cfg, os.path.join(tmp, "rsl"), device)
    rsl_log, rsl_returns, moved = runner.logger.log, runner.alg.compute_returns, []

    def timed_returns(obs):
        # RSL-RL reads its collection clock, then calls this inside its learning clock. The sync first drains the
        # rollout's kernels still queued at that clock read; then GAE, the critic on the last observation and the
        # advantage normalization, which syncppo counts in collection. All of it moves to RSL-RL's collection.
        start = time.perf_counter()
        _synchronize(device)
        rsl_returns(obs)
        _synchronize(device)
        moved.append(time.perf_counter() - start)
    runner.alg.compute_returns = timed_returns

    def timed_rsl_log(**kw):
        if not thread_may_run_alone:
            raise StopRslRl   # syncppo stopped on request (Ctrl-C, SIGTERM): RSL-RL stops with it
        # RSL-RL's learning clock stops while its last optimizer step may still run on a GPU; syncppo's phase clocks
        # wait for the device (train.finished), so the drain counts as RSL-RL's update too. ~0 on CPU.
        start = time.perf_counter()
        _synchronize(device)
        drain = time.perf_counter() - start
        rsl_log(**kw)
        returns = moved.pop()
        rows["rsl-rl"].append((kw["collect_time"] + returns, kw["learn_time"] - returns + drain, returns))
        rows["limit"].append(cfg.ppo.num_epochs * cfg.ppo.num_mini_batches * matmul_limit_seconds(limit_shapes, device))
        _synchronize(device)     # the logging's kernels, not on syncppo's clock
        progress("rsl-rl", len(rows["rsl-rl"]), *rows["rsl-rl"][-1][:2], f", matmul limit {rows['limit'][-1]:.4f} s")
        baton.pass_on("rsl-rl")
    runner.logger.log = timed_rsl_log

    errors, thread_may_run_alone = [], True

    def rsl_thread():
        try:
            baton.wait_turn("rsl-rl")
            runner.learn(cfg.max_iterations)
        except StopRslRl:
            pass
        except BaseException as exc:   # surfaced in the main thread below
            errors.append(exc)
        finally:
            baton.pass_on("rsl-rl", finished=True)

    original, on_sigterm = train.RunLogger, signal.getsignal(signal.SIGTERM)
    train.RunLogger = TimedLogger
    # One redirect for both threads (sys.stdout is process-wide): both learners print every iteration.
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        thread = threading.Thread(target=rsl_thread, daemon=True)
        thread.start()
        try:
            train.main(cfg)
        finally:
            train.RunLogger = original
            signal.signal(signal.SIGTERM, on_sigterm)   # train.main leaves it at its default: no cleanup after
            thread_may_run_alone = len(rows["syncppo"]) == cfg.max_iterations
            baton.pass_on("syncppo", finished=True)
            thread.join()
    if errors:
        raise errors[0]
    if not thread_may_run_alone:   # a cut run's few rounds would print as a table of the bench's
        print(f"bench_train.py: stopped on request after {len(rows['syncppo'])} of {cfg.max_iterations} iterations; "
              "no table", file=sys.stderr)
        raise SystemExit(130)
    return rows


def two_rank_rate(preset_name: str, num_envs: int, iterations: int, warmup: int, tmp: str) -> float:
    """env-steps/s of syncppo at 2 ranks (torchrun), median over iterations after `warmup`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    root = os.path.join(tmp, "two-ranks")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "train.py", preset_name, "--max-iterations",
           str(iterations), "--env.num-envs", str(num_envs), "--log.root", root, "--log.print-every", str(10**6),
           "--log.save-every", str(10**6), "--ppo.minibatch-unit", "transition"]    # as the table's rows
    # Its output goes to a log, shown if it fails: a torchrun stopped with the bench prints a traceback of its own.
    with open(os.path.join(tmp, "two-ranks.log"), "w+") as log:
        code = run_child(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), stdout=log,
                         stderr=subprocess.STDOUT)
        if code:
            log.seek(0)
            sys.stderr.write(log.read())
            raise subprocess.CalledProcessError(code, cmd)
    events = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.startswith("events.out")][0]
    acc = EventAccumulator(events)
    acc.Reload()
    return median([e.value for e in acc.Scalars("Perf/total_fps")[warmup:]])


def median(xs):
    """The median; of an even count, the mean of the two middle values (not the upper one: with the 2 rounds of
    `--quick` large, that was the larger ratio)."""
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def rsl_rl_version() -> str:
    """The installed rsl-rl-lib's version, for the table (requirements-dev.txt pins 5.5.1; another may be installed)."""
    try:
        return importlib.metadata.version("rsl-rl-lib")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def report(name: str, cfg, rows: dict, warmup: int, limit_shapes: list, device: torch.device) -> None:
    n = min(len(rows["syncppo"]), len(rows["rsl-rl"]), len(rows["limit"]))
    sp, rl = rows["syncppo"][warmup:n], rows["rsl-rl"][warmup:n]
    per_it = cfg.env.num_envs * cfg.ppo.num_steps
    flops = cfg.ppo.num_epochs * cfg.ppo.num_mini_batches * sum(2 * m * k * n for m, k, n in limit_shapes)
    limit = min(rows["limit"])    # the machine's limit: its least-loaded measurement (so % below is a lower bound)
    where = "CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
    step = ", syncppo with --ppo.capture-step" if cfg.ppo.capture_step else ""
    # On a GPU the update also launches elementwise kernels between its GEMMs: the % is the GEMMs' share of it.
    how, pct_label = (("each shape's best of 3", "") if device.type == "cpu" else
                      ("queued back to back, best of 3", " (GPU: GEMMs' share of the update, not a roofline)"))
    print(f"\n{name}: tracking on {where}{step}, {cfg.env.num_envs} envs x {cfg.ppo.num_steps} steps, "
          f"{cfg.ppo.num_epochs} epochs x {cfg.ppo.num_mini_batches} minibatches, MLP {cfg.policy.actor_hidden} "
          f"(actor and critic), {len(sp)} interleaved rounds after {warmup} warm-up, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; update GEMMs {flops / 1e9:.1f} GFLOP, "
          f"matmul limit {flops / limit / 1e9:.0f} GFLOP/s (torch.mm, same shapes, {how}); RSL-RL's compute_returns "
          f"counted as its collection, as syncppo counts its GAE")
    print(f"| learner | env-steps/s | collection s/it | update s/it | update GFLOP/s | % of matmul limit{pct_label} | "
          "steps/s vs RSL-RL | update vs RSL-RL |")
    print("|---|---|---|---|---|---|---|---|")
    for label, mine in (("syncppo", sp), (f"rsl-rl {rsl_rl_version()}", rl)):
        fps_ratio = median([(r[0] + r[1]) / (m[0] + m[1]) for m, r in zip(mine, rl)])
        upd_ratio = median([m[1] / r[1] for m, r in zip(mine, rl)])
        update = median([m[1] for m in mine])
        print(f"| {label} | {median([per_it / (m[0] + m[1]) for m in mine]):,.0f} | "
              f"{median([m[0] for m in mine]):.3f} | {update:.3f} | {median([flops / m[1] for m in mine]) / 1e9:.1f} | "
              f"{100 * limit / update:.0f}% | {fps_ratio:.2f}x | {upd_ratio:.2f}x |")


def report_notes(rows: dict, warmup: int) -> None:
    """Below the table: the update ratio with RSL-RL's own split of its phases, then what still differs."""
    n = min(len(rows["syncppo"]), len(rows["rsl-rl"]))
    sp, rl = rows["syncppo"][warmup:n], rows["rsl-rl"][warmup:n]
    own = median([m[1] / (r[1] + r[2]) for m, r in zip(sp, rl)])
    print(f"\nWith RSL-RL's own split (compute_returns inside its learning clock, as its learn_time logs it; the "
          f"update column's definition before 2026-12-02): RSL-RL update {median([r[1] + r[2] for r in rl]):.3f} "
          f"s/it, syncppo's update {own:.2f}x of it. Still different:")
    for line in DIFFERENCES:
        print(f"- {line}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations, no 2-rank row (a few minutes)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both learners and the env run")
    parser.add_argument("--num-envs", type=int, default=None, help="envs per learner instead of the setting's")
    parser.add_argument("--capture-step", action="store_true",
                        help="syncppo with --ppo.capture-step (a CUDA graph on a GPU; on CPU the same sync-free step, "
                             "uncaptured)")
    args = parser.parse_args()
    refuse_torchrun(parser)
    refuse_repeats(parser, "--settings", args.settings)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    device = torch.device(args.device)
    torch.set_num_threads(omp_threads(parser))
    iterations = ITERATIONS["quick" if args.quick else args.device]
    configs = {}
    for name in args.settings:          # every flag checked before either learner starts
        num_envs, hidden = SETTINGS[name]
        cfg = preset("tracking")
        cfg.env.num_envs = num_envs if args.num_envs is None else args.num_envs   # 0 is an error, not "unset"
        cfg.max_iterations = iterations[name][0]
        cfg.policy.actor_hidden = cfg.policy.critic_hidden = hidden
        cfg.ppo.minibatch_unit = "transition"     # RSL-RL's minibatches (the preset's are whole env trajectories)
        cfg.dist.device, cfg.ppo.capture_step = args.device, args.capture_step
        try:
            validate(cfg)
        except UsageError as exc:
            parser.error(str(exc).replace("--env.num-envs", "--num-envs"))
        configs[name] = cfg
    try:              # then the baseline: one line, not a traceback once the first setting is built
        import rsl_rl  # noqa: F401
    except ImportError:
        parser.error("RSL-RL is not installed: make bench installs it (or: pip install rsl-rl-lib==5.5.1)")
    try:
        bench(args, configs, iterations, device)
    except Exception as exc:     # as train.py: sizes this machine cannot hold are a flag to lower, not a traceback
        if not out_of_memory(exc):
            raise
        sys.exit(f"bench_train: out of memory: {first_line(exc)}; lower --num-envs (or leave out --settings large)")


def bench(args, configs: dict, iterations: dict, device: torch.device) -> None:
    """Each setting's table (and, for the full small run on CPU, the 2-rank row), then the notes below it."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in configs.items():
            env = make_env(cfg.env, torch.device("cpu"), seed=cfg.seed, base_seed=cfg.seed)
            batch = cfg.env.num_envs * cfg.ppo.num_steps // cfg.ppo.num_mini_batches
            shapes = gemm_shapes(env.obs_dims, cfg.policy.actor_hidden, env.num_actions, batch)
            rows = run_interleaved(cfg, os.path.join(tmp, name), shapes, device)
            report(name, cfg, rows, iterations[name][1], shapes, device)
            if name == "small" and not args.quick and device.type == "cpu":
                fps = two_rank_rate("tracking", cfg.env.num_envs, iterations[name][0], iterations[name][1], tmp)
                print(f"| syncppo, 2 ranks (torchrun, run after the table) | {fps:,.0f} | | | | | | |")
            report_notes(rows, iterations[name][1])


if __name__ == "__main__":
    stopped_main("bench_train", main)
