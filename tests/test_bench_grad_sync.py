"""bench/bench_grad_sync.py: its table's columns and ratios, the medians it takes of the slowest rank's times after
the warm-up, the header's gradient size, its flags' bounds (--warmup, --timeout, --bucket-mb), one NCCL rank per
visible GPU with --device cuda, its default variants, and a rank out of memory said in one line naming --batch.
Every expected number is worked out by hand or with numpy from the inputs. Only the slow end-to-end test starts ranks:
elsewhere the process group and the timed variants are stand-ins, or the launch raises where ranks would start."""

import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from tests.test_bench_flags import Launched, bench_grad_sync, launched_args, usage_error  # noqa: F401 (fixtures)
from tests.test_tools import REPO, load_bench


def test_bench_grad_sync_table_columns_by_hand(capsys):
    gs = load_bench("bench_grad_sync")
    mb = gs.MB
    rows = [dict(model="m", variant="fwd+bwd", buckets=0, step=10.0, bwd=4.0, allreduce=2.0, grad_comm=2 * mb,
                 peak=3 * mb),
            dict(model="m", variant="flat", buckets=1, step=12.0, bwd=6.0, allreduce=2.0, grad_comm=4 * mb,
                 peak=6 * mb),
            dict(model="m", variant="DDP", buckets=3, step=15.0, bwd=5.0, allreduce=2.0, grad_comm=8 * mb,
                 peak=4 * mb)]
    gs.print_table(rows)
    out = capsys.readouterr().out.splitlines()
    # flat: 12 / 15 = 0.80 of DDP; overhead 12 - 10; (bwd+sync)/bwd 6 / 4; grad+comm 4 / 8; peak 6 / 4
    assert "| m | flat | 1 | 12.0 | 0.80 | 2.0 | 2.0 | 1.50 | 4.0 | 0.50 | 6.0 | 1.50 |" in out
    assert "| m | fwd+bwd | - | 10.0 | 0.67 | - | 2.0 | - | 2.0 | 0.25 | 3.0 | 0.75 |" in out


@pytest.mark.parametrize("a, b, reduce", [
    ([100.0, 4.0, 1.0, 5.0], [100.0, 2.0, 3.0, 7.0], [100.0, 0.004, 0.001, 0.005]),
    # 4 timed rounds: the median of an even count is the mean of the two middle rounds (torch.median gave the lower)
    ([100.0, 4.0, 1.0, 5.0, 3.0], [100.0, 2.0, 3.0, 7.0, 9.0], [100.0, 0.004, 0.001, 0.005, 0.003]),
])
def test_bench_grad_sync_medians_of_the_slowest_rank_after_the_warm_up(monkeypatch, a, b, reduce):
    # 1 warm-up round (the 100 s) left out; rank 1 (faked by all_gather) takes twice rank 0's time, so the slowest
    # rank's times are 2x. Backward (+ sync) is a quarter of each step. Expected medians from numpy, in ms.
    gs = load_bench("bench_grad_sync")
    script = {"A": iter(a), "B": iter(b)}

    class FakeVariant:
        def __init__(self, kind, bucket_mb, model, device):
            self.name, self.model = kind, model

        def step(self, x, y, clock):
            s = next(script[self.name])
            return [s, 0.0, s / 4]
    now, reduce_times = [0.0], iter(reduce)
    all_reduce = lambda tensor, op=None: now.__setitem__(0, now[0] + next(reduce_times))  # noqa: E731

    def all_gather(gathered, local):
        gathered[0].copy_(local)
        gathered[1].copy_(local * 2)
    monkeypatch.setattr(gs, "Variant", FakeVariant)
    monkeypatch.setattr(gs, "dist", types.SimpleNamespace(barrier=lambda: None, all_reduce=all_reduce,
                                                          all_gather=all_gather))
    monkeypatch.setattr(gs, "teardown", lambda: None)
    monkeypatch.setattr(gs, "setup", lambda *args: (torch.device("cpu"), lambda: now[0],
                                                    lambda: torch.nn.Linear(3, 2), None, None))
    out = []
    gs.time_model(0, 2, 0, types.SimpleNamespace(warmup=1, iters=len(a) - 1), "m", [("A", 0), ("B", 0)],
                  types.SimpleNamespace(put=out.append))
    (result,), ms = out, {name: 2e3 * np.median(t[1:]) for name, t in (("A", a), ("B", b), ("raw", reduce))}
    assert result["params"] == 3 * 2 + 2
    assert result["allreduce"] == pytest.approx(ms["raw"])
    assert [(r["variant"], r["step"], r["bwd"]) for r in result["rows"]] == [
        (name, pytest.approx(ms[name]), pytest.approx(ms[name] / 4)) for name in ("A", "B")]


def test_bench_grad_sync_zero_warm_up_is_allowed(bench_grad_sync, monkeypatch):
    # --warmup counts untimed steps: 0 is a valid count (the check is >= 0; -1 is refused elsewhere)
    args = launched_args(bench_grad_sync.main, monkeypatch, ["bench_grad_sync.py", "--quick", "--warmup", "0"])
    assert args.warmup == 0


def test_bench_grad_sync_header_gives_fp32_gradient_megabytes(monkeypatch, capsys):
    # 1,048,576 parameters of 4 bytes: 4.0 MB of fp32 gradients
    gs = load_bench("bench_grad_sync")

    def launch(args, target, *rest):
        if target is gs.time_model:
            names = ["fwd+bwd", "flat", "bucketed 4MB", "DDP"]
            return dict(params=2**20, allreduce=1.0, rows=[dict(model="0.3M", variant=n, step=1.0, bwd=1.0)
                                                          for n in names])
        return dict(grad_comm=1.0, peak=1.0, buckets=1, source="VmHWM")
    monkeypatch.setattr(gs, "launch", launch)
    monkeypatch.setattr(sys, "argv", ["bench_grad_sync.py", "--models", "0.3M", "--bucket-mb", "4"])
    gs.main()
    assert "models: 0.3M = 1,048,576 params (4.0 MB of fp32 grads)" in capsys.readouterr().out


@pytest.mark.parametrize("timeout", ["1", "1e6"])
def test_bench_grad_sync_timeout_bounds_are_inclusive(bench_grad_sync, monkeypatch, timeout):
    """--timeout must be in [1, 1e6] seconds: both ends are usable values.

    Mutant: `1 <= args.timeout` -> `1 < args.timeout`; `args.timeout <= 1e6` -> `args.timeout < 1e6`."""
    args = launched_args(bench_grad_sync.main, monkeypatch, ["bench_grad_sync.py", "--quick", "--timeout", timeout])
    assert args.timeout == float(timeout)


@pytest.mark.parametrize("timeout, shown", [("1000001", "1000001.0"), ("nan", "nan"), ("0.999", "0.999")])
def test_bench_grad_sync_timeout_just_outside_or_nan_is_refused(bench_grad_sync, monkeypatch, capsys, timeout, shown):
    """Just past either end, and nan (every comparison with it is false), are refused in one line.

    Mutant: the upper bound dropped or moved (1e6 -> 1e7); `not 1 <= t <= 1e6` -> `t < 1 or t > 1e6` (lets nan by)."""
    line = usage_error(bench_grad_sync.main, monkeypatch, capsys,
                       ["bench_grad_sync.py", "--quick", "--timeout", timeout])
    assert line == f"bench_grad_sync.py: error: --timeout must be in [1, 1e6] seconds, got {shown}"


def test_bench_grad_sync_nan_bucket_cap_is_refused(bench_grad_sync, monkeypatch, capsys):
    """A nan cap is no cap: refused like 0 and inf.

    Mutant: `not all(0 < mb < inf)` -> `any(mb <= 0 or mb == inf)` (lets nan by)."""
    line = usage_error(bench_grad_sync.main, monkeypatch, capsys, ["bench_grad_sync.py", "--quick", "--bucket-mb",
                                                                   "4", "nan"])
    assert line == "bench_grad_sync.py: error: --bucket-mb must be distinct positive caps (inf is flat), got [4.0, nan]"


def _rank_out_of_memory(rank, world, port, args, queue):
    raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes\nmore")


def test_bench_grad_sync_rank_out_of_memory_is_one_line_naming_batch(capfd):
    """A rank's allocation it cannot get (a huge --batch) printed each rank's traceback, then "a rank failed".

    Mutant: launch starts `target` itself, not through rank_main -> each rank's traceback and "a rank failed".
    """
    module = load_bench("bench_grad_sync")
    with pytest.raises(SystemExit) as info:
        module.launch(types.SimpleNamespace(device="cpu", world=2), _rank_out_of_memory)
    assert info.value.code == ("bench_grad_sync: out of memory: DefaultCPUAllocator: can't allocate memory: you tried "
                               "to allocate 8 bytes; lower --batch")
    assert "Traceback" not in capfd.readouterr().err


def _one_rank_out_of_memory(rank, world, port, args, queue):
    """Rank args.oom_rank fails to allocate once in the process group; its partner then waits in a barrier. The first
    barrier keeps the failing rank until every rank is through init: rank 0 hosts the rendezvous store, and its exit
    while the partner still read from the store printed torch's C++ TCPStore warning on stderr (once in CI)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.distributed.barrier()
    if rank == args.oom_rank:
        _rank_out_of_memory(rank, world, port, args, queue)
    torch.distributed.barrier()


@pytest.mark.parametrize("oom_rank", [0, 1])
def test_bench_grad_sync_one_rank_out_of_memory_is_its_one_line_alone(capfd, oom_rank):
    """One rank out of memory (a size it alone cannot hold): its partner's barrier failed on the closed connection
    and printed gloo's connection error (a traceback) before the bench's one line. Now only that line (the
    SystemExit's message, exit 1), nothing else on stderr.

    Mutant: `if peer_oom.is_set(): sys.exit(1)` dropped from rank_main -> the partner's gloo traceback on stderr.
    """
    module = load_bench("bench_grad_sync")
    with pytest.raises(SystemExit) as info:
        module.launch(types.SimpleNamespace(device="cpu", world=2, oom_rank=oom_rank), _one_rank_out_of_memory)
    assert info.value.code == ("bench_grad_sync: out of memory: DefaultCPUAllocator: can't allocate memory: you tried "
                               "to allocate 8 bytes; lower --batch")
    assert capfd.readouterr().err == ""


@pytest.mark.slow
def test_bench_grad_sync_huge_batch_is_one_line():
    """`bench_grad_sync.py --batch 100000000000` end to end (2 gloo ranks): exit 1 with one line on stderr.

    Mutant: rank_main re-raises every exception -> two allocator tracebacks before the summary line.
    """
    result = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_grad_sync.py"), "--quick", "--models",
                             "20k", "--batch", "100000000000"], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1 and result.stdout == "", result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("bench_grad_sync: out of memory: ") and result.stderr.endswith("; lower --batch\n")


def test_bench_grad_sync_on_cuda_runs_one_nccl_process_per_visible_gpu(bench_grad_sync, monkeypatch, capsys):
    """docs/benchmarks.md: `--device cuda` runs one process per visible GPU (NCCL), and the default variants are
    forward + backward alone, flat, bucketed at 25 and 4 MB, then DDP. Three GPUs faked; the launch raises.

    Mutant: the CUDA world size defaults to 2 as on CPU -> 2 ranks on 3 GPUs. Mutant: no check of --world-size
    against the GPU count -> 4 ranks launched on 3 GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    args = launched_args(bench_grad_sync.main, monkeypatch, ["bench_grad_sync.py", "--device", "cuda"])
    assert (args.world, args.backend) == (3, "nccl")
    line = usage_error(bench_grad_sync.main, monkeypatch, capsys,
                       ["bench_grad_sync.py", "--device", "cuda", "--world-size", "4"])
    assert line == "bench_grad_sync.py: error: --world-size 4 but only 3 GPU(s): one process per GPU"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = usage_error(bench_grad_sync.main, monkeypatch, capsys, ["bench_grad_sync.py", "--device", "cuda"])
    assert line == "bench_grad_sync.py: error: --device cuda but torch sees no CUDA device"
    monkeypatch.setattr(bench_grad_sync, "launch", lambda args, target, name, *rest: (_ for _ in ()).throw(
        Launched(rest)))
    variants = launched_args(bench_grad_sync.main, monkeypatch, ["bench_grad_sync.py"])[0]
    assert variants == [("fwd+bwd", 0), ("flat", 25.0), ("bucketed", 25.0), ("bucketed", 4.0), ("DDP", 0)]
