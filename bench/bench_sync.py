"""Weight sync side by side: patch vs bucket vs a naive per-tensor dist.send of the state_dict.

Two gloo ranks on CPU (rank 0 sends, rank 1 receives). For each model size, patch runs at several
densities (the fraction of elements changed since the last sync); bucket and naive send everything
whatever changed. Then the density a real PPO iteration of the `tracking` preset produces, from
consecutive checkpoints of train.py, with fp32 and bf16 receivers.

    python bench/bench_sync.py              # ~10M and ~100M parameters, a few minutes on 2 cores
    python bench/bench_sync.py --quick      # ~1M parameters, two densities, no PPO part: seconds
    python bench/bench_sync.py --checkpoints a/model_1.pt a/model_2.pt a/model_3.pt   # PPO part from these

Times are wall clock from a barrier before the sender's sync() / receiver's apply() to a barrier after
both returned, best of --repeats. Ratios are against naive in the same run.
"""

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sync import BucketConfig, PatchConfig, WeightSyncConfig, make_weight_syncer  # noqa: E402
from sync.patch import _bits as as_bits  # noqa: E402
import math  # noqa: E402

BUCKET_SIZE = 128 * 2**20


def mlp_state(width: int, layers: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(layers):
        state[f"layers.{i}.weight"] = torch.randn(width, width, generator=g) / width**0.5
        state[f"layers.{i}.bias"] = torch.zeros(width)
    return state


SIZES = {"1M": (500, 4), "10M": (1400, 5), "100M": (4096, 6)}


def perturb(state: dict, density: float, g: torch.Generator) -> None:
    """Change about `density` of all elements (random positions) by a small visible amount."""
    for value in state.values():
        flat = value.view(-1)
        if density >= 1.0:
            flat.add_(torch.randn(flat.numel(), generator=g).mul_(1e-3))
        else:
            index = torch.randint(flat.numel(), (max(1, int(density * flat.numel())),), generator=g)
            flat[index] += torch.randn(index.numel(), generator=g).mul_(1e-3)


def information_limit(before: dict, after: dict) -> float:
    """Bytes no encoding can beat: per tensor, k changed values plus log2(C(n, k)) bits for their positions."""
    total = 0.0
    for key, old in before.items():
        n, k = old.numel(), int((as_bits(old) != as_bits(after[key])).sum())
        total += k * old.element_size() + (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2) / 8
    return total


def timed(fn, repeats: int, prepare=lambda: None) -> float:
    """Best wall time of fn over repeats, measured between barriers so it covers both ranks."""
    best = float("inf")
    for _ in range(repeats):
        prepare()
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return best


def naive_send(state: dict, rank: int) -> None:
    """The baseline: one blocking dist.send per tensor, received straight into the model."""
    for value in state.values():
        dist.send(value, dst=1) if rank == 0 else dist.recv(value, src=0)


def bench_model(rank: int, name: str, densities: list, repeats: int) -> list:
    width, layers = SIZES[name]
    state = mlp_state(width, layers, seed=rank)
    numel = sum(v.numel() for v in state.values())
    full_bytes = sum(v.numel() * v.element_size() for v in state.values())
    rows, g = [], torch.Generator().manual_seed(1)

    naive_time = timed(lambda: naive_send(state, rank), repeats)
    rows.append(dict(model=name, params=numel, mode="naive", changed=numel, wire=full_bytes,
                     seconds=naive_time))

    bucket = make_weight_syncer(WeightSyncConfig(type="bucket", bucket=BucketConfig(bucket_size=BUCKET_SIZE)), 0, [1])
    bucket.init_sender(state) if rank == 0 else bucket.init_receiver(state)
    version = iter(range(1, 10**6))
    bucket_time = timed(lambda: bucket.sync(state, next(version)) if rank == 0 else bucket.apply(state), repeats)
    rows.append(dict(model=name, params=numel, mode="bucket", changed=numel,
                     wire=bucket.stats.wire_bytes if rank == 0 else 0, seconds=bucket_time))

    patch = make_weight_syncer(WeightSyncConfig(type="patch", patch=PatchConfig()), 0, [1])
    patch.init_sender(state) if rank == 0 else patch.init_receiver(state)
    for density in densities:
        limits = []

        def prepare():
            if rank == 0:
                before = {k: v.clone() for k, v in state.items()}
                perturb(state, density, g)
                limits.append(information_limit(before, state))
        # Interleaved with naive (A, B, A, B) so that load from other processes cancels in the ratio.
        naive_again = timed(lambda: naive_send(state, rank), repeats)
        seconds = timed(lambda: patch.sync(state, next(version)) if rank == 0 else patch.apply(state), 1, prepare)
        stats = patch.stats
        rows.append(dict(model=name, params=numel, mode="patch", naive=naive_again,
                         changed=stats.changed_elements if rank == 0 else 0, limit=limits[-1] if limits else 0,
                         wire=stats.wire_bytes if rank == 0 else 0, seconds=seconds))
    return rows


def bench_checkpoints(rank: int, paths: list) -> list:
    """Sync consecutive PPO checkpoints (the actor-critic state_dict) with patch and bucket."""
    states = [torch.load(p, map_location="cpu", weights_only=False)["model"] for p in paths]
    rows = []
    for receiver_dtype in (torch.float32, torch.bfloat16):
        for mode in ("patch", "bucket"):
            sender_state = {k: v.clone() for k, v in states[0].items()}
            receiver_state = {k: v.to(receiver_dtype) if v.dtype == torch.float32 else v.clone()
                              for k, v in states[0].items()}
            syncer = make_weight_syncer(WeightSyncConfig(type=mode), 0, [1])
            syncer.init_sender(sender_state) if rank == 0 else syncer.init_receiver(receiver_state)
            for version, state in enumerate(states[1:], start=1):
                seconds = timed(lambda: syncer.sync(state, version) if rank == 0 else syncer.apply(receiver_state), 1)
                if rank == 1:
                    expected = {k: v.to(receiver_dtype) if v.dtype == torch.float32 else v for k, v in state.items()}
                    assert all(torch.equal(as_bits(receiver_state[k]), as_bits(expected[k])) for k in expected)
                numel = sum(v.numel() for v in state.values())
                rows.append(dict(model=f"tracking {str(receiver_dtype)[6:]} it{version}->{version + 1}", params=numel,
                                 mode=mode,
                                 changed=syncer.stats.changed_elements if rank == 0 else 0,
                                 wire=syncer.stats.wire_bytes if rank == 0 else 0, seconds=seconds))
    return rows


def worker(rank: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = []
    for name in args.sizes:
        rows += bench_model(rank, name, args.densities, args.repeats)
    if args.checkpoints:
        rows += bench_checkpoints(rank, args.checkpoints)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def ppo_checkpoints(iterations: int = 3) -> list:
    """Train the tracking preset for a few iterations and return its checkpoints (one per iteration)."""
    root = tempfile.mkdtemp(prefix="bench_sync_")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, os.path.join(repo, "train.py"), "tracking", "--max-iterations", str(iterations),
                    "--log.save-every", "1", "--log.root", root], check=True, cwd=repo)
    return sorted(glob.glob(os.path.join(root, "*", "*", "model_*.pt")),
                  key=lambda p: int(p.rsplit("_", 1)[1].split(".")[0]))


def print_table(rows: list) -> None:
    naive = {r["model"]: r for r in rows if r["mode"] == "naive"}
    print("| model | mode | density | changed elements | wire bytes | bytes vs limit | sync+apply s | bytes vs naive | time vs naive |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = naive.get(r["model"])
        density = f"{r['changed'] / r['params']:.1%}"  # measured: what actually changed since the last sync
        per_changed = f"{r['wire'] / r['limit']:.3f}" if r.get("limit") else "-"
        vs_bytes = f"{r['wire'] / base['wire']:.3f}" if base else "-"
        vs_time = f"{r['seconds'] / r.get('naive', base['seconds'] if base else 0):.2f}" if base else "-"
        print(f"| {r['model']} | {r['mode']} | {density} | {r['changed']:,} | {r['wire']:,} | {per_changed} | "
              f"{r['seconds']:.3f} | {vs_bytes} | {vs_time} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~1M parameters, two densities, no PPO part")
    parser.add_argument("--sizes", nargs="+", default=["10M", "100M"], choices=sorted(SIZES))
    parser.add_argument("--densities", nargs="+", type=float, default=[0.0001, 0.001, 0.01, 0.1, 0.3, 1.0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--checkpoints", nargs="*", default=None,
                        help="consecutive train.py checkpoints for the PPO part (default: train 3 tracking iterations)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.densities, args.repeats = ["1M"], [0.001, 0.01, 0.3, 1.0], 1
        args.checkpoints = args.checkpoints or []
    if args.checkpoints is None:
        args.checkpoints = ppo_checkpoints()
    if len(args.checkpoints) == 1:
        parser.error("--checkpoints needs at least two consecutive checkpoints")

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(rank, port, args, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    print(f"weight sync, 2 gloo ranks on CPU, torch {torch.__version__}, {torch.get_num_threads()} thread(s)/rank, "
          f"bucket_size {BUCKET_SIZE // 2**20} MiB, best of {args.repeats}")
    print_table(rows)


if __name__ == "__main__":
    main()
