"""sync/'s rules for NCCL and CUDA, checked on CPU: no GPU has run this code, so what NCCL and CUDA would do is
taken from torch's source, cited where it is used. The GPU round trips are in test_sync_patch.py and
test_sync_bucket.py (SYNCPPO_TEST_DEVICE=cuda, bench/gpu_check.sh)."""

import threading

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks
from sync import BucketConfig, WeightSyncConfig, make_weight_syncer
from sync.encodings import GAPS16, _encode
from test_sync_common import bits_equal, snapshot

# What ProcessGroupNCCL can send or receive point to point: it hands the tensor to torch::cuda::nccl::send/recv,
# which map its dtype with to_nccl_data_type (torch/csrc/cuda/nccl.cpp); any other dtype raises "Unconvertible
# NCCL type" there. int16, uint16-64 and complex are not in that switch.
NCCL_DTYPES = {torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8,
               torch.bool, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
               torch.float8_e5m2fnuz}


def _changed(state: dict) -> None:
    state["w"][::1000] += 1  # 100 changes 999 apart: 2-byte gaps are a patch's smallest encoding
    state["counts"] += 1


def _dtypes_on_the_wire(rank, world_size):
    """The dtype of every point-to-point message of a bucket syncer's init and sync, then a patch syncer's
    (bootstrap included), with every payload segment in a message of its own, as in frames over wire.PACK_BYTES."""
    import sync.wire
    sync.wire.PACK_BYTES = 0
    seen = set()
    for name in ("send", "recv", "isend", "irecv"):
        real = getattr(dist, name)
        setattr(dist, name, lambda tensor, *a, _real=real, **k: (seen.add(tensor.dtype), _real(tensor, *a, **k))[1])
    state = {"w": torch.zeros(100_000), "counts": torch.arange(10, dtype=torch.int16)}
    for kind in ("bucket", "patch"):
        syncer = make_weight_syncer(WeightSyncConfig(type=kind), src=0, dsts=[1])
        if rank == 0:
            syncer.init_sender(state)
            _changed(state)
            syncer.sync(state, 1)
        else:
            syncer.init_receiver(state)
            assert syncer.apply(state) == 1
    return seen, snapshot(state)


@pytest.mark.slow
def test_every_message_has_a_dtype_nccl_can_send():
    """An int16 buffer sent whole, and a patch's 2-byte gap symbols, had crossed as int16, which NCCL cannot send:
    transport_device=cuda failed on the first frame over 1 MiB (or with one tensor) that held either."""
    w = torch.zeros(100_000)
    mask = torch.zeros(100_000, dtype=torch.bool)
    mask[::1000] = True
    assert _encode(w, mask, 100)[0] == GAPS16  # the premise: the patch's positions travel as int16 symbols
    (sent, final), (received, model) = run_ranks(_dtypes_on_the_wire, 2)
    assert sent <= NCCL_DTYPES and received <= NCCL_DTYPES, (sent - NCCL_DTYPES, received - NCCL_DTYPES)
    assert bits_equal(model, final)


def _group_backends(monkeypatch, name: str, config: str) -> None:
    """Stand in for a process group (this process has none): ranks 0 and 1 (this one 0), get_backend() `name`,
    get_backend_config() `config`. Making a syncer asks nothing else of the group."""
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)


def test_a_transport_device_needs_a_backend_for_its_tensors(monkeypatch):
    """init_process_group() without a backend, on a GPU machine: get_backend() says "undefined" and the group has
    NCCL for cuda tensors alone (torch's BackendConfig takes the accelerator's default backend). The default
    transport (cpu) had been accepted there and failed at the handshake's first message, inside torch."""
    _group_backends(monkeypatch, "undefined", "cuda:nccl")
    with pytest.raises(ValueError, match=r"sends cpu tensors with no backend \(its backends: cuda:nccl\)"):
        make_weight_syncer(WeightSyncConfig(), src=0, dsts=[1])
    _group_backends(monkeypatch, "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl")
    assert make_weight_syncer(WeightSyncConfig(), src=0, dsts=[1]).device == torch.device("cpu")


@pytest.mark.parametrize("name, config", [("nccl", "cuda:nccl"), ("undefined", "cuda:nccl")])
def test_a_cuda_transport_stages_on_the_current_device_of_the_thread_that_made_it(monkeypatch, name, config):
    """CUDA keeps the current device per host thread, and a new thread starts on cuda:0 (torch.cuda.set_device
    sets it for the calling thread alone). A non-blocking apply receives in a thread of its own: with the device
    left as "cuda", a rank on cuda:3 had staged its frames on cuda:0, another rank's GPU. Made on a thread
    whose current device is 3, the syncer stages on cuda:3 from any thread. A group made without naming a
    backend ("undefined", NCCL for cuda tensors on a GPU machine) takes a cuda transport too."""
    _group_backends(monkeypatch, name, config)
    current = threading.local()  # this thread's device, as torch.cuda.set_device(3) leaves it; others on 0
    current.device = 3
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "device", 0))
    cfg = WeightSyncConfig(type="bucket", bucket=BucketConfig(bucket_device="cuda"))
    assert make_weight_syncer(cfg, src=0, dsts=[1]).device == torch.device("cuda", 3)
