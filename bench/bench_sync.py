"""Weight sync side by side: patch vs bucket vs a naive per-tensor dist.send of the state_dict.

Two gloo ranks on CPU (rank 0 sends, rank 1 receives). patch runs at several densities (the fraction of
elements changed since the last sync); bucket and naive send everything whatever changed. A second table
gives patch's bytes against the information limit for fp32 and bf16 receivers. Optionally, the density a
real PPO iteration of the `tracking` preset produces, from consecutive checkpoints of train.py.

    python bench/bench_sync.py              # ~10M parameters: time and bytes tables, ~10 s on 2 cores
    python bench/bench_sync.py --quick      # ~1M parameters, three densities: seconds
    python bench/bench_sync.py --ppo        # also train 3 iterations of `tracking` and sync its checkpoints
    python bench/bench_sync.py --checkpoints a/model_1.pt a/model_2.pt a/model_3.pt   # PPO part from these
    python bench/bench_sync.py --device cuda   # weights and patch snapshot on the GPU (both ranks share it)

With `--device cuda` the time table's weights live on the GPU: the sender's change detection and checksums
run there against a CUDA snapshot (`patch.snapshot_device=cuda`), frames still travel over gloo through
the host, and naive copies each tensor to the host, sends it, and copies it back into the receiver's GPU
weights. (NCCL cannot run two ranks on one GPU.) The bytes table does not depend on the device.

Times are wall clock from a barrier before the sender's sync() / receiver's apply() to a barrier after
both returned. Each ratio is the median over pairs (naive, then the mode right after it) in one run, after
one untimed warm-up pair per row.
Bytes are against the information limit: for k changed elements out of n, k value bytes plus
log2(C(n, k)) / 8 bytes for the positions, per tensor, in the receiver's dtype.
"""

import argparse
import atexit
import glob
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._common import (free_port, rank_answers, rank_signals, refuse_torchrun, run_child,  # noqa: E402
                           stop_processes, stopped_main)
from dist.checkpoint_read import read_checkpoint  # noqa: E402
from dist.errors import UsageError  # noqa: E402
from sync import BucketConfig, PatchConfig, WeightSyncConfig, make_weight_syncer  # noqa: E402
from sync.encodings import _bits as as_bits  # noqa: E402

BUCKET_SIZE = 128 * 2**20


def mlp_state(width: int, layers: int, seed: int = 0, device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(layers):
        state[f"layers.{i}.weight"] = (torch.randn(width, width, generator=g) / width**0.5).to(device)
        state[f"layers.{i}.bias"] = torch.zeros(width, device=device)
    return state


SIZES = {"1M": (500, 4), "10M": (1400, 5), "100M": (4096, 6)}


def perturb(state: dict, density: float, g: torch.Generator) -> None:
    """Change about `density` of all elements (random positions) by a small visible amount."""
    for value in state.values():
        flat = value.view(-1)
        if density >= 1.0:
            flat.add_(torch.randn(flat.numel(), generator=g).mul_(1e-3).to(flat.device))
        else:
            index = torch.randint(flat.numel(), (max(1, int(density * flat.numel())),), generator=g)
            flat[index.to(flat.device)] += torch.randn(index.numel(), generator=g).mul_(1e-3).to(flat.device)


def information_limit(before: dict, after: dict) -> float:
    """Bytes no encoding can beat: per tensor, k changed values plus log2(C(n, k)) bits for their positions."""
    total = 0.0
    for key, old in before.items():
        n, k = old.numel(), int((as_bits(old) != as_bits(after[key])).sum())
        total += k * old.element_size() + (math.lgamma(n + 1) - math.lgamma(k + 1)
                                           - math.lgamma(n - k + 1)) / math.log(2) / 8
    return total


def timed(fn, prepare=lambda: None) -> float:
    """Wall time of fn, measured between barriers (after the GPU finished, if any) so it covers both ranks.
    Crosses ranks: two barriers per call, and what fn sends."""
    prepare()
    synchronize()
    dist.barrier()
    start = time.perf_counter()
    fn()
    synchronize()
    dist.barrier()
    return time.perf_counter() - start


def synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def naive_send(state: dict, rank: int) -> None:
    """The baseline: one blocking dist.send per tensor, received straight into the model (on a GPU: through
    a host copy each way, as gloo sends from host memory). Crosses ranks: every tensor, once per call."""
    for value in state.values():
        if value.device.type == "cpu":
            dist.send(value, dst=1) if rank == 0 else dist.recv(value, src=0)
        elif rank == 0:
            dist.send(value.cpu(), dst=1)
        else:
            staged = torch.empty(value.shape, dtype=value.dtype)
            dist.recv(staged, src=0)
            value.copy_(staged)


def versions():
    return iter(range(1, 10**9))


def bench_time(rank: int, name: str, densities: list, repeats: int, device: str = "cpu") -> list:
    """Time of bucket and of patch at each density against naive, fp32 on both sides. Each measurement is a
    pair (naive, then the mode right after it): the ratio is the median over `repeats` pairs, so load from
    other processes, which drifts slowly, cancels. Each row first runs one untimed warm-up pair (its times and
    changed count discarded), so that first-use costs (the receiver's staging buffers, page faults) fall in no
    measured pair. Crosses ranks: sync/'s init per mode, then per pair (the warm-up one too) a naive send of the
    state and one sync() -> apply(), each between barriers (`timed`)."""
    state = mlp_state(*SIZES[name], seed=rank, device=device)
    numel = sum(v.numel() for v in state.values())
    g, version = torch.Generator().manual_seed(1), versions()
    syncers = {}
    for mode in ("bucket", "patch"):
        cfg = WeightSyncConfig(type=mode, bucket=BucketConfig(bucket_size=BUCKET_SIZE),
                               patch=PatchConfig(snapshot_device=device))
        syncers[mode] = make_weight_syncer(cfg, 0, [1])
        syncers[mode].init_sender(state) if rank == 0 else syncers[mode].init_receiver(state)
    rows = []
    for mode, density in [("bucket", 1.0)] + [("patch", d) for d in densities]:
        syncer = syncers[mode]
        changed = []

        def prepare():
            if rank == 0 and mode == "patch":
                perturb(state, density, g)

        def run():
            if rank == 0:
                changed.append(syncer.sync(state, next(version)).changed_elements)
            else:
                syncer.apply(state)
        timed(lambda: naive_send(state, rank)), timed(run, prepare)     # warm-up pair: not measured
        changed.clear()
        pairs = [(timed(lambda: naive_send(state, rank)), timed(run, prepare)) for _ in range(repeats)]
        ratios = sorted(b / a for a, b in pairs)
        rows.append(dict(model=name, mode=mode, density=(sum(changed) / len(changed) / numel) if changed else 0,
                         naive=statistics.median(a for a, _ in pairs), seconds=statistics.median(b for _, b in pairs),
                         ratio=statistics.median(ratios), low=ratios[0], high=ratios[-1]))
    return rows


def bench_bytes(rank: int, name: str, densities: list) -> list:
    """Wire bytes of patch against the information limit, per density and receiver dtype (fp32 sender).
    Crosses ranks: sync/'s init per receiver dtype, then one patch per density."""
    rows = []
    for receiver_dtype in (torch.float32, torch.bfloat16):
        state = mlp_state(*SIZES[name], seed=0)
        model = {k: v.to(receiver_dtype, copy=True) for k, v in state.items()}
        syncer = make_weight_syncer(WeightSyncConfig(type="patch"), 0, [1])
        syncer.init_sender(state) if rank == 0 else syncer.init_receiver(model)
        g, version = torch.Generator().manual_seed(2), versions()
        for density in densities:
            if rank == 0:
                before = {k: v.to(receiver_dtype, copy=True) for k, v in state.items()}
                perturb(state, density, g)
                stats = syncer.sync(state, next(version))
                limit = information_limit(before, {k: v.to(receiver_dtype) for k, v in state.items()})
                numel = sum(v.numel() for v in state.values())
                rows.append(dict(model=name, receiver=str(receiver_dtype)[6:], nominal=density,
                                 density=stats.changed_elements / numel,
                                 wire=stats.wire_bytes, limit=limit, ratio=stats.wire_bytes / limit))
            else:
                syncer.apply(model)
    return rows


def checkpoint_models(paths: list) -> list:
    """The 'model' state_dict of each train.py checkpoint; ValueError names the first file that is not one, or whose
    model differs from the first file's in its keys, shapes or dtypes (a checkpoint of another preset)."""
    models, first, last = [], None, None
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"--checkpoints {path!r} " + ("is not a regular file" if os.path.exists(path) else
                                                           "does not exist"))

        def usable(state, path=path) -> None:
            model = state.get("model") if isinstance(state, dict) else None
            if not isinstance(model, dict) or not model or not all(isinstance(v, torch.Tensor) for v in model.values()):
                raise ValueError(f"--checkpoints {path!r} is not a train.py checkpoint (no 'model' state_dict entry)")
        try:      # the checks of --resume too: CRC-32s (a flipped bit would be timed as a change), no nan or inf
            state = read_checkpoint(path, "--checkpoints", "use", usable)
        except OSError as exc:
            raise ValueError(f"--checkpoints {path!r} cannot be read ({exc.strerror})") from None
        except UsageError as exc:
            raise ValueError(str(exc)) from None
        model = state["model"]
        layout = {k: (tuple(v.shape), v.dtype) for k, v in model.items()}
        first = first or layout
        if layout != first:
            key = next(k for k in sorted(layout.keys() | first.keys()) if layout.get(k) != first.get(k))
            raise ValueError(f"--checkpoints {path!r}: its model differs from {paths[0]!r}'s at {key!r} "
                             f"({layout.get(key, 'missing')} vs {first.get(key, 'missing')}); pass consecutive "
                             f"checkpoints of one run")
        iteration = state.get("iteration")     # the same file twice, or out of order, would time no change
        if models and isinstance(iteration, int) and isinstance(last, int) and iteration <= last:
            raise ValueError(f"--checkpoints {path!r} is of iteration {iteration}, not after "
                             f"{paths[len(models) - 1]!r}'s {last}: pass consecutive checkpoints of one run, in order")
        models.append(model)
        last = iteration
    return models


def bench_checkpoints(rank: int, paths: list) -> list:
    """Sync consecutive PPO checkpoints (the actor-critic state_dict) with patch and bucket. Crosses ranks: per
    receiver dtype and mode, sync/'s init, then one timed update per checkpoint after the first."""
    states = checkpoint_models(paths)
    rows = []
    for receiver_dtype in (torch.float32, torch.bfloat16):
        for mode in ("patch", "bucket"):
            sender_state = {k: v.clone() for k, v in states[0].items()}
            receiver_state = {k: v.to(receiver_dtype) if v.dtype == torch.float32 else v.clone()
                              for k, v in states[0].items()}
            syncer = make_weight_syncer(WeightSyncConfig(type=mode), 0, [1])
            syncer.init_sender(sender_state) if rank == 0 else syncer.init_receiver(receiver_state)
            for version, state in enumerate(states[1:], start=1):
                seconds = timed(lambda: syncer.sync(state, version) if rank == 0 else syncer.apply(receiver_state))
                if rank == 1:
                    expected = {k: v.to(receiver_dtype) if v.dtype == torch.float32 else v for k, v in state.items()}
                    assert all(torch.equal(as_bits(receiver_state[k]), as_bits(expected[k])) for k in expected)
                numel = sum(v.numel() for v in state.values())
                names = [os.path.basename(path).removesuffix(".pt") for path in paths[version - 1:version + 1]]
                rows.append(dict(step=f"{str(receiver_dtype)[6:]} {names[0]} -> {names[1]}", mode=mode,
                                 density=syncer.stats.changed_elements / numel if rank == 0 else 0,
                                 wire=syncer.stats.wire_bytes if rank == 0 else 0, seconds=seconds))
    return rows


def worker(rank: int, port: int, args, queue) -> None:
    """One of the two ranks: join the gloo group, run every table, rank 0 hands them back. Crosses ranks: the
    rendezvous, the tables' messages (bench_time, bench_bytes, bench_checkpoints) and a final barrier."""
    rank_signals()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tables = {"time": bench_time(rank, args.size, args.densities, args.repeats, args.device),
              "bytes": bench_bytes(rank, args.size, [d for d in args.densities if d < 1.0])}
    if args.checkpoints:
        tables["ppo"] = bench_checkpoints(rank, args.checkpoints)
    if rank == 0:
        queue.put(tables)
    dist.barrier()
    dist.destroy_process_group()


def ppo_checkpoints() -> list:
    """Train the tracking preset for 3 iterations and return its checkpoints (one per iteration)."""
    root = tempfile.mkdtemp(prefix="bench_sync_")
    atexit.register(shutil.rmtree, root, True)        # the checkpoints are only read by this run
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = run_child([sys.executable, os.path.join(repo, "train.py"), "tracking", "--max-iterations", "3",
                      "--log.save-every", "1", "--log.root", root], cwd=repo)
    if code:
        sys.exit(f"bench_sync: --ppo's training run exited with {code} (its output is above)")
    return sorted(glob.glob(os.path.join(root, "*", "*", "model_*.pt")),
                  key=lambda p: int(p.rsplit("_", 1)[1].split(".")[0]))


def print_tables(tables: dict, args) -> None:
    print(f"\nTime: {args.size} fp32 parameters, fp32 receiver; {args.repeats} (naive, mode) pairs per row, "
          f"after an untimed warm-up pair. Times are medians; "
          f"the ratio is the median of per-pair ratios (the naive send's time moves from pair to pair), not the "
          f"ratio of the medians" + ("; --quick: a smoke run" if args.quick else ""))
    print("| mode | elements changed | naive s | mode s | time vs naive (median) | min-max |")
    print("|---|---|---|---|---|---|")
    for r in tables["time"]:
        print(f"| {r['mode']} | {r['density']:.2%} | {r['naive']:.3f} | {r['seconds']:.3f} | {r['ratio']:.2f} | "
              f"{r['low']:.2f}-{r['high']:.2f} |")
    print(f"\nBytes: patch wire bytes (headers, tables, trailers included) against the information limit, "
          f"{args.size} fp32 parameters" + ("" if tables["bytes"] else ": none, as --densities has none below 1 (a "
                                             "whole tensor has no positions to encode)"))
    print("| receiver | density perturbed | changed in receiver dtype | wire bytes | limit bytes | bytes vs limit |")
    print("|---|---|---|---|---|---|")
    for r in tables["bytes"]:
        print(f"| {r['receiver']} | {r['nominal']:.2%} | {r['density']:.3%} | {r['wire']:,} | {r['limit']:,.0f} | "
              f"{r['ratio']:.3f} |")
    if "ppo" in tables:
        print("\nPPO checkpoints " + ("(tracking preset, consecutive iterations)" if args.ppo else
                                       "(--checkpoints, in the order given)"))
        print("| step | mode | density | wire bytes | sync+apply s |")
        print("|---|---|---|---|---|")
        for r in tables["ppo"]:
            print(f"| {r['step']} | {r['mode']} | {r['density']:.1%} | {r['wire']:,} | {r['seconds']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run in seconds: --size 1M --densities 0.001 0.3 1 --repeats 3, each unless typed")
    parser.add_argument("--size", choices=sorted(SIZES), help="default 10M")
    parser.add_argument("--densities", nargs="+", type=float,
                        help="fractions in (0, 1] of elements patch syncs change; default 0.0001 0.001 0.01 0.1 0.3 1")
    parser.add_argument("--repeats", type=int, help="(naive, mode) pairs per row, at least 1; default 7")
    parser.add_argument("--ppo", action="store_true", help="also sync 3 consecutive checkpoints of the tracking preset")
    parser.add_argument("--checkpoints", nargs="*", default=None,
                        help="consecutive train.py checkpoints of one run to sync (instead of --ppo's)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the time table's weights live")
    args = parser.parse_args()
    refuse_torchrun(parser)
    defaults = (dict(size="1M", densities=[0.001, 0.3, 1.0], repeats=3) if args.quick else
                dict(size="10M", densities=[0.0001, 0.001, 0.01, 0.1, 0.3, 1.0], repeats=7))
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    bad = [d for d in args.densities if not 0 < d <= 1]      # nan fails the comparison too
    if bad:
        parser.error(f"--densities must be fractions in (0, 1], got {', '.join(map(str, bad))}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    if args.checkpoints is not None:
        if args.ppo:
            parser.error("--checkpoints with --ppo: --ppo trains and syncs its own checkpoints; pass one of the two")
        if len(args.checkpoints) < 2:
            parser.error("--checkpoints needs at least two consecutive checkpoints")
        try:
            checkpoint_models(args.checkpoints)     # checked here: a rank would fail with a traceback
        except ValueError as exc:
            parser.error(str(exc))
    if args.ppo:
        args.checkpoints = ppo_checkpoints()

    ctx, port = mp.get_context("spawn"), free_port()
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(rank, port, args, queue)) for rank in range(2)]
    try:
        for p in procs:
            p.start()
        try:
            tables, = rank_answers(procs, queue, 1)  # a rank that died must not leave this waiting forever
        except RuntimeError:
            sys.exit("bench_sync: a rank failed (its traceback is above)")
        for p in procs:
            p.join()
    finally:                  # a failed rank's partner, or both on Ctrl-C / SIGTERM, would wait in a collective
        stop_processes(procs)
    where = "CPU" if args.device == "cpu" else f"{torch.cuda.get_device_name()} (weights and patch snapshot)"
    print(f"weight sync, 2 gloo ranks, time table on {where}, torch {torch.__version__}, 1 thread per rank, "
          f"bucket_size {BUCKET_SIZE // 2**20} MiB")
    print_tables(tables, args)


if __name__ == "__main__":
    stopped_main("bench_sync", main)
