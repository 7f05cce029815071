"""Shared helpers for the sync/ tests (no tests here): states to sync, random updates, bitwise equality."""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

import sync.wire
from dist import comm
from sync import WeightSyncConfig, make_weight_syncer
from sync.encodings import _bits as as_bits


def make_state(seed: int, float_dtype=torch.float32) -> dict:
    """Every shape and dtype the patch format must handle: scalar, 1-D, 2-D, 4-D, int and bool buffers."""
    g = torch.Generator().manual_seed(seed)
    return {
        "scale": torch.randn((), generator=g).to(float_dtype),
        "enc.bias": torch.randn(37, generator=g).to(float_dtype),
        "enc.weight": torch.randn(300, 70, generator=g).to(float_dtype),
        "conv.weight": torch.randn(4, 3, 5, 5, generator=g).to(float_dtype),
        "dec.weight": torch.randn(1000, 2, generator=g).to(float_dtype),
        "steps": torch.randint(0, 100, (10,), generator=g),
        "mask": torch.rand(6, generator=g) < 0.5,
    }


def cast_floats(state: dict, dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v.clone() for k, v in state.items()}


def random_update(state: dict, g: torch.Generator, density: float) -> None:
    """Change about `density` of every tensor's elements in place, with NaNs and signed zeros among the
    new float values so that change detection must work on bits."""
    for value in state.values():
        where = torch.rand(value.shape, generator=g) < density
        if value.dtype == torch.bool:
            value[where] = ~value[where]
        elif not value.is_floating_point():
            value[where] += 1
        else:
            new = torch.randn(value.shape, generator=g).to(value.dtype)
            kind = torch.rand(value.shape, generator=g)
            new[kind < 0.05] = float("nan")
            new[(kind >= 0.05) & (kind < 0.10)] = -0.0
            new[(kind >= 0.10) & (kind < 0.15)] = 0.0
            value[where] = new[where]


# Where the round-trip tests put the weights: SYNCPPO_TEST_DEVICE=cuda on a GPU (bench/gpu_check.sh).
DEVICE = os.environ.get("SYNCPPO_TEST_DEVICE", "cpu")


def on_device(state: dict) -> dict:
    return {k: v.to(DEVICE) for k, v in state.items()}


def random_update_via_host(state: dict, host: dict, g: torch.Generator, density: float) -> None:
    """random_update drawn on the host copy `host`, then written into `state` (on DEVICE), so that every
    device sees the same updates."""
    random_update(host, g, density)
    for key, value in host.items():
        state[key].copy_(value)


def converted(state: dict, *dtypes) -> dict:
    """A host copy of `state` with its floats converted to each of `dtypes` in turn on DEVICE, where the sender
    converts them (a float32 NaN becomes a bf16 NaN of other bits on a GPU than on the host)."""
    state = on_device(state)
    for dtype in dtypes:
        state = cast_floats(state, dtype)
    return snapshot(state)


def bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(as_bits(a[k].contiguous()), as_bits(b[k].contiguous())) for k in a)


def snapshot(state: dict) -> dict:
    """A host copy (the state may live on a GPU: see DEVICE in test_sync_patch.py)."""
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def sync_once(syncer, rank: int, state: dict, change, keys=None) -> dict:
    """Rank 0 sends version 1 after `change(state)`, rank 1 applies it; both return a snapshot of their state."""
    if rank == 0:
        syncer.init_sender(state, keys)
        change(state)
        syncer.sync(state, 1)
    else:
        syncer.init_receiver(state)
        assert syncer.apply(state) == 1
    return snapshot(state)


@contextlib.contextmanager
def damaged_receives(name: str, damage):
    """Inside the block, dist.comm's receive `name` (recv or recv_then_count) calls `damage(tensor)` on every tensor
    it received: damage in flight, after the transport and before the syncer's checks."""
    real = getattr(comm, name)

    def receive(tensor, *args):
        real(tensor, *args)
        damage(tensor)
        return tensor
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(comm, name, receive)
        yield


def drain(src: int, *rest: torch.Tensor) -> None:
    """Receive, unchecked, the rest of a frame that a receiver refused before taking it in (sizes only the test
    knows), so that the sender's sends complete and the ranks can end."""
    for tensor in rest:
        dist.recv(tensor, src=src)


@contextlib.contextmanager
def damaged_frames(damage):
    """Inside the block, every received frame goes through `damage(frame)` before its trailer's checksums are read
    (sync.wire.Frame.sums): damage to values or trailer that arrived, found by the syncer's own checks."""
    real = sync.wire.Frame.sums

    def sums(frame):
        damage(frame)
        return real(frame)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sync.wire.Frame, "sums", sums)
        yield


def small_patch_sent(rank: int):
    """A patch syncer from rank 0 to rank 1 over w and v (100 zeros each; tiny: a frame's rest fits in the socket).
    Rank 0 inits, changes w[3], w[50] to 1 and v[7] to 2, sends patch 1 and returns None; rank 1 inits and returns
    (syncer, state) for the test to receive that patch its way."""
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"w": torch.zeros(100), "v": torch.zeros(100)}
    if rank == 0:
        syncer.init_sender(state)
        state["w"][[3, 50]] = 1.0
        state["v"][7] = 2.0
        syncer.sync(state, 1)
        return None
    syncer.init_receiver(state)
    return syncer, state
