"""Gradient sync side by side: GradSync flat | bucketed vs torch DistributedDataParallel (issue #3, item 10).

Two MLP critics (ELU, MSE loss on a value target): "0.3M" = 256 -> 512, 256, 128 -> 1 (295,937 params,
the isaaclab preset's critic hidden sizes) and "10M" = 1024 -> 2048, 2048, 1024, 1024, 512, 512 -> 1
(10,231,297 params, SONIC's critic hidden sizes). Every variant runs the same model (same seed on every
rank) on the same per-rank batch (seed + rank); only the gradient sync differs:

    fwd+bwd         no sync: zero grads in place, forward, backward (the compute baseline)
    flat            GradSync(mode="flat"): zero_grad, arm, forward, backward, synchronize (one all-reduce)
    bucketed N MB   GradSync(mode="bucketed", bucket_mb=N): all-reduces launched during backward
    DDP             torch DistributedDataParallel, default settings: zero_grad (set_to_none), forward, backward

Timing: all variants, plus one raw dist.all_reduce, run round-robin in one process group per model (the
order rotates every round, so load drift on shared cores hits all alike). Each timed step is preceded by
a barrier and timed with time.perf_counter (cuda: synchronized before each clock read); "step ms" is the
median over rounds of the slowest rank's time. From the same steps:
    vs DDP           step time / DDP's step time
    sync overhead    step - (fwd+bwd), against "raw all-reduce": one dist.all_reduce of a float32 buffer
                     with the bytes of all the gradients
    (bwd+sync)/bwd   from the start of backward to gradients synchronized, over the baseline's backward
                     alone: 1.00 = communication fully hidden; flat is the no-overlap reference
Memory: each (model, variant) again in fresh processes (fork on CPU, spawn on CUDA), over set-up,
warm-up and 2 steps, max over ranks:
    grad+comm MB     counted from the objects: distinct storages of every .grad plus GradSync's bucket
                     buffers (grads are views into them: counted once) plus DDP's reducer buckets
                     (separate from .grad unless gradient_as_bucket_view)
    peak +MB         measured: CPU, growth of the peak resident set (VmHWM, reset through
                     /proc/self/clear_refs) over the RSS just before the variant is built (activations,
                     autograd and allocator included); CUDA, torch.cuda.max_memory_allocated growth.

    python bench/bench_grad_sync.py                   # 2 gloo ranks on CPU, both models (0.5-2 min on 2 cores)
    python bench/bench_grad_sync.py --quick           # small models, few steps: a smoke run (<30 s)
    python bench/bench_grad_sync.py --device cuda     # NCCL, one process per visible GPU (1 GPU: world size 1)
"""

import argparse
import faulthandler
import gc
import os
import resource
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")   # 2 ranks on 2 cores: one thread each unless the caller says otherwise
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
import torch._dynamo  # noqa: E402,F401  DDP's first use imports it (~800 modules): once here, before fork

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._common import (free_port, omp_threads, rank_signals, refuse_repeats, refuse_torchrun,  # noqa: E402
                           stop_processes, stopped_main)
from dist.errors import first_line, out_of_memory  # noqa: E402
from dist.grad_sync import GradSync  # noqa: E402
from dist.setup import shutdown  # noqa: E402

MODELS = {"0.3M": (256, (512, 256, 128), 1), "10M": (1024, (2048, 2048, 1024, 1024, 512, 512), 1)}
QUICK_MODELS = {"20k": (64, (128, 64), 1), "0.6M": (256, (512, 512, 256, 256, 128, 128), 1)}
MB = 2**20


def mlp(in_dim: int, hidden: tuple, out_dim: int, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for h in hidden:
        layers += [torch.nn.Linear(in_dim, h), torch.nn.ELU()]
        in_dim = h
    return torch.nn.Sequential(*layers, torch.nn.Linear(in_dim, out_dim))


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where /proc/self/clear_refs is not writable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Variant:
    """One way of producing synchronized gradients on its own copy of the model (same seed on every rank)."""

    def __init__(self, kind: str, bucket_mb: float, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.name = f"bucketed {bucket_mb:g}MB" if kind == "bucketed" else kind
        self.sync = (GradSync(model.parameters(), mode=kind, bucket_mb=bucket_mb)
                     if kind in ("flat", "bucketed") else None)
        self.ddp = (DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
                    if kind == "DDP" else None)

    def step(self, x: torch.Tensor, y: torch.Tensor, clock) -> list:
        """Time one zero-grad + forward + backward (+ sync) -> [step, zero+forward, backward(+sync)] seconds.

        Crosses ranks: flat, one all-reduce of all gradients in synchronize(); bucketed, one per bucket, launched
        during backward; DDP, its reducer's bucket all-reduces inside backward; fwd+bwd, nothing.
        """
        t0 = clock()
        if self.sync is not None:
            self.sync.zero_grad()
            self.sync.arm()
        elif self.ddp is not None:
            self.ddp.zero_grad()                            # DDP's usual loop: optimizer.zero_grad(), set_to_none
        else:
            self.model.zero_grad(set_to_none=False)         # baseline: grads kept and zeroed, like GradSync's
        loss = ((self.model if self.ddp is None else self.ddp)(x) - y).square().mean()
        t1 = clock()
        loss.backward()
        if self.sync is not None:
            self.sync.synchronize()
        t2 = clock()
        return [t2 - t0, t1 - t0, t2 - t1]

    def grad_comm_bytes(self) -> tuple[int, int]:
        """(gradient + communication buffer bytes, all-reduces per step), each storage counted once.

        DDP's bucket buffers are separate from .grad unless gradient_as_bucket_view; they are read through the
        reducer's private _get_zeros_like_grad_buckets (which allocates: call after measuring peak memory).
        """
        tensors = [p.grad for p in self.model.parameters() if p.grad is not None]
        tensors += [b.buffer for b in self.sync.buckets] if self.sync else []
        total = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
        if self.ddp is None:
            return total, len(self.sync.buckets) if self.sync else 0
        buckets = self.ddp.reducer._get_zeros_like_grad_buckets()
        if not self.ddp.gradient_as_bucket_view:
            total += sum(b.buffer().numel() * b.buffer().element_size() for b in buckets)
        return total, len(buckets)


def setup(rank: int, world: int, port: int, args, model_name: str):
    """Join the process group; return (device, clock, model factory, x, y) for this rank. Crosses ranks once:
    init_process_group's rendezvous."""
    faulthandler.dump_traceback_later(args.timeout, exit=True)      # a hung rank prints its stacks and exits
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, rank=rank, world_size=world, device_id=device if cuda else None)

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    in_dim, hidden, out_dim = args.models[model_name]
    g = torch.Generator().manual_seed(1000 + rank)          # different data per rank, same for every variant
    x = torch.randn(args.batch, in_dim, generator=g).to(device)
    y = torch.randn(args.batch, out_dim, generator=g).to(device)
    return device, clock, lambda: mlp(in_dim, hidden, out_dim, seed=0).to(device), x, y


def time_model(rank: int, world: int, port: int, args, model_name: str, variants: list, queue) -> None:
    """All variants (and the raw all-reduce) round-robin in one process group, so load drift hits all alike.

    Crosses ranks: a barrier before every timed step, each variant's gradient all-reduces, the raw all-reduce of
    a buffer with the bytes of all gradients, and at the end one all_gather of the step times.
    """
    device, clock, make_model, x, y = setup(rank, world, port, args, model_name)
    runs = [Variant(kind, mb, make_model(), device) for kind, mb in variants]
    numel = sum(p.numel() for p in runs[0].model.parameters())
    raw = torch.zeros(numel, dtype=torch.float32, device=device)

    def all_reduce(_x, _y, clock):
        """The baseline step: one raw all-reduce of all the gradients' bytes, per timed round."""
        t0 = clock()
        dist.all_reduce(raw)
        return [clock() - t0] * 3

    steps = [run.step for run in runs] + [all_reduce]
    times = [[] for _ in steps]
    for r in range(args.warmup + args.iters):
        for i in [(r + k) % len(steps) for k in range(len(steps))]:    # rotate the order every round
            clock()
            dist.barrier()
            t = steps[i](x, y, clock)
            if r >= args.warmup:
                times[i].append(t)
    local = torch.tensor(times, dtype=torch.float64, device=device)     # [variant, step, 3]
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    worst = torch.stack(gathered).amax(0).cpu()                         # slowest rank, per step
    # ms, [variant, 3]; of an even count of rounds the mean of the two middle ones (torch.median: the lower one)
    medians = worst.quantile(0.5, dim=1) * 1e3
    if rank == 0:
        rows = [dict(model=model_name, variant=run.name, step=m[0].item(), bwd=m[2].item())
                for run, m in zip(runs, medians)]
        queue.put(dict(params=numel, allreduce=medians[-1, 0].item(), rows=rows))
    del runs, steps          # DDP's reducer holds the process group: free it first (else teardown can hang)
    teardown()


def measure_memory(rank: int, world: int, port: int, args, model_name: str, kind: str, bucket_mb: float, queue) -> None:
    """One variant in fresh processes: growth of peak memory over set-up and warm-up + 2 steps.

    Crosses ranks: what the variant's steps and constructor send (DDP broadcasts parameters), barriers, and one
    MAX all-reduce of the memory figures.
    """
    device, clock, make_model, x, y = setup(rank, world, port, args, model_name)
    model = make_model()
    # DDP's first construction imports ~800 modules (~75 MB RSS once per process); every variant pays it
    # before the baseline so that peak memory compares buffers, not code.
    Variant("DDP", 0, torch.nn.Linear(1, 1).to(device), device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base, source = torch.cuda.memory_allocated(device), "cuda max_memory_allocated"
    else:
        source = "VmHWM" if reset_peak_rss() else "ru_maxrss"
        base = rss_bytes("VmRSS")
    run = Variant(kind, bucket_mb, model, device)
    for _ in range(args.warmup + 2):
        clock()
        dist.barrier()
        run.step(x, y, clock)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    elif source == "VmHWM":
        peak = rss_bytes("VmHWM") - base
    else:                                                              # lifetime peak: includes start-up
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    grad_comm, buckets = run.grad_comm_bytes()
    memory = torch.tensor([grad_comm, max(peak, 0)], dtype=torch.float64, device=device)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put(dict(grad_comm=memory[0].item(), peak=memory[1].item(), buckets=buckets, source=source))
    del run                  # DDP's reducer holds the process group: free it first (else teardown can hang)
    teardown()


def teardown() -> None:
    """Crosses ranks: a final barrier, so no rank destroys the group while another is still in a collective; then the
    group goes as train.py's does (dist.setup.shutdown, which collects garbage first: before torch 2.8 a plain
    destroy could deadlock)."""
    dist.barrier()
    shutdown()


def rank_main(peer_oom, target, *target_args) -> None:
    """`target` in one rank; an allocation it cannot get goes to the parent as one line (target_args[-1] is the
    queue), not a traceback per rank. `peer_oom` (an Event) is set by a rank out of memory before it exits, so before
    its partners' collectives fail on its closed connection: their gloo errors are then left to that one line."""
    rank_signals()
    try:
        target(*target_args)
    except Exception as exc:
        if out_of_memory(exc):
            target_args[-1].put(dict(oom=first_line(exc)))
            peer_oom.set()
            sys.exit(3)
        if peer_oom.is_set():
            sys.exit(1)
        raise


def launch(args, target, *target_args) -> dict:
    """Start `args.world` fresh processes (fork on CPU, spawn on CUDA) running `target`; return rank 0's result."""
    ctx = mp.get_context("spawn" if args.device == "cuda" else "fork")
    queue, port = ctx.SimpleQueue(), free_port()
    peer_oom = ctx.Event()
    procs = [ctx.Process(target=rank_main, args=(peer_oom, target, r, args.world, port, args, *target_args, queue))
             for r in range(args.world)]
    try:
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs) and all(p.exitcode in (None, 0) for p in procs):
            time.sleep(0.1)
    finally:     # one rank failed, or Ctrl-C / SIGTERM: the others would wait in a collective until timeout
        stop_processes(procs)
    results = []
    while not queue.empty():
        results.append(queue.get())
    oom = next((r["oom"] for r in results if "oom" in r), None)
    if oom is not None:     # as bench_train's --num-envs: a size this machine cannot hold is a flag to lower
        raise SystemExit(f"bench_grad_sync: out of memory: {oom}; lower --batch")
    if any(p.exitcode != 0 for p in procs) or not results:
        raise SystemExit(f"{target.__name__}{target_args}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    return results[0]


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def print_table(rows: list) -> None:
    print("| model | variant | all-reduces | step ms | vs DDP | sync overhead ms | raw all-reduce ms | "
          "(bwd+sync)/bwd | grad+comm MB | vs DDP | peak +MB | vs DDP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = [o for o in rows if o["model"] == r["model"]]
        base = next(o for o in same if o["variant"] == "fwd+bwd")
        ddp = next(o for o in same if o["variant"] == "DDP")
        synced = r is not base
        overhead = f"{r['step'] - base['step']:.1f}" if synced else "-"
        print(f"| {r['model']} | {r['variant']} | {r['buckets'] if synced else '-'} | {r['step']:.1f} | "
              f"{ratio(r['step'], ddp['step'])} | {overhead} | {r['allreduce']:.1f} | "
              f"{ratio(r['bwd'], base['bwd']) if synced else '-'} | {r['grad_comm'] / MB:.1f} | "
              f"{ratio(r['grad_comm'], ddp['grad_comm'])} | {r['peak'] / MB:.1f} | {ratio(r['peak'], ddp['peak'])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: models 20k 0.6M, batch 64, 1 warm-up + "
                        "3 timed steps, bucket caps 25 0.5 MB, each unless typed")
    parser.add_argument("--models", nargs="+", choices=[*MODELS, *QUICK_MODELS],
                        help=f"default: {' '.join(MODELS)} (--quick: {' '.join(QUICK_MODELS)})")
    parser.add_argument("--batch", type=int, help="samples per rank per step; default 256")
    parser.add_argument("--warmup", type=int, help="default 3")
    parser.add_argument("--iters", type=int, help="timed steps per variant (medians); default 10")
    parser.add_argument("--bucket-mb", type=float, nargs="+", help="bucketed caps to run; default 25 4")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: gloo on cpu, nccl on cuda")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a hung rank dumps its stacks")
    parser.add_argument("--world-size", type=int, default=None,
                        help="default: 2 on cpu (at most 4 per core), every visible GPU on cuda")
    args = parser.parse_args()
    refuse_torchrun(parser)
    refuse_repeats(parser, "--models", args.models or [])
    omp_threads(parser)     # else libgomp warns and runs a thread per core, under this header
    defaults = (dict(models=list(QUICK_MODELS), batch=64, warmup=1, iters=3, bucket_mb=[25.0, 0.5]) if args.quick else
                dict(models=list(MODELS), batch=256, warmup=3, iters=10, bucket_mb=[25.0, 4.0]))
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    # Checked here, before any rank starts (a rank would die with a traceback; --world-size 0 meant "default").
    for flag, value, least in (("--iters", args.iters, 1), ("--batch", args.batch, 1), ("--warmup", args.warmup, 0),
                               ("--world-size", args.world_size, 1)):
        if value is not None and value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    if not all(0 < mb < float("inf") for mb in args.bucket_mb) or len(set(args.bucket_mb)) < len(args.bucket_mb):
        parser.error(f"--bucket-mb must be distinct positive caps (inf is flat), got {args.bucket_mb}")
    if not 1 <= args.timeout <= 1e6:     # below, ranks dump their stacks before a step; above, past time_t, or nan
        parser.error(f"--timeout must be in [1, 1e6] seconds, got {args.timeout}")
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda")
    args.world = args.world_size or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if args.device == "cuda" and args.world > torch.cuda.device_count():
        parser.error(f"--world-size {args.world} but only {torch.cuda.device_count()} GPU(s): one process per GPU")
    cpus = os.cpu_count() or 1
    if args.device == "cpu" and args.world > 4 * cpus:
        parser.error(f"--world-size {args.world} is more than 4 ranks per CPU core ({cpus} cores): the timings of "
                     f"oversubscribed ranks are meaningless")
    args.models = {name: {**MODELS, **QUICK_MODELS}[name] for name in args.models}

    variants = [("fwd+bwd", 0), ("flat", 25.0)] + [("bucketed", mb) for mb in args.bucket_mb] + [("DDP", 0)]
    rows, params = [], {}
    for name in args.models:
        timed = launch(args, time_model, name, variants)
        params[name] = timed["params"]
        for row, (kind, mb) in zip(timed["rows"], variants):
            rows.append(dict(row, allreduce=timed["allreduce"], **launch(args, measure_memory, name, kind, mb)))
    print(f"gradient sync, {args.world} {args.backend} rank(s) on {args.device}"
          f"{' (world size 1: no cross-rank traffic, sync cost is only the local path)' if args.world == 1 else ''}, "
          f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, batch {args.batch}/rank; "
          f"variants interleaved, median of {args.iters} rounds after {args.warmup} warm-up, slowest rank"
          + ("; --quick: a smoke run, its ratios move by tens of percent from run to run" if args.quick else ""))
    print("models: " + ", ".join(f"{name} = {n:,} params ({n * 4 / MB:.1f} MB of fp32 grads)"
                                 for name, n in params.items()))
    print(f"peak +MB: {rows[0]['source']} growth, fresh processes per variant, max over ranks; "
          f"grad+comm MB: counted from the objects")
    print_table(rows)


if __name__ == "__main__":
    stopped_main("bench_grad_sync", main)
