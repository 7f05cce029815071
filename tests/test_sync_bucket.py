"""bucket strategy over gloo: exact copies, bucket plans and bytes by hand, dtype conversion, load_instant.

`SYNCPPO_TEST_DEVICE=cuda pytest tests/test_sync_bucket.py -k load_instant` puts the weights on a GPU (the
frames still travel through the host over gloo); bench/gpu_check.sh runs it.
"""

import pytest
import torch

from multirank import run_ranks
from sync import BucketConfig, WeightSyncConfig, make_weight_syncer
from sync.wire import plan_buckets
from test_sync_common import bits_equal, cast_floats, converted, make_state, on_device, random_update_via_host, snapshot

# Bytes of make_state's tensors in fp32: scale, enc.bias, enc.weight, conv.weight, dec.weight, steps, mask.
FP32_BYTES = [4, 37 * 4, 300 * 70 * 4, 4 * 3 * 25 * 4, 1000 * 2 * 4, 10 * 8, 6]


def test_plan_buckets_by_hand():
    assert plan_buckets(FP32_BYTES, 50_000) == [[0, 1], [2], [3, 4, 5, 6]]  # 84000 bytes travel alone
    assert plan_buckets([10, 10, 10], 20) == [[0, 1], [2]]
    assert plan_buckets([30, 10], 20) == [[0], [1]]
    assert plan_buckets([], 20) == [[]]  # an update always carries one header


def _bucket_updates(rank, world_size, settings_list, receiver_dtype):
    results = []
    for settings in settings_list:
        syncer = make_weight_syncer(WeightSyncConfig(type="bucket", bucket=BucketConfig(**settings)),
                                    src=0, dsts=list(range(1, world_size)))
        if rank == 0:
            host, g = make_state(seed=0), torch.Generator().manual_seed(1)
            state = on_device(host)
            syncer.init_sender(state)
            history, stats = [], []
            for version in (1, 2, 3):
                random_update_via_host(state, host, g, 0.1)
                stats.append(syncer.sync(state, version))
                history.append(snapshot(state))
            results.append((history, [(s.wire_bytes, s.payload_bytes) for s in stats]))
        else:
            model = on_device(cast_floats(make_state(seed=100 + rank), receiver_dtype))
            syncer.init_receiver(model)
            staged, recv_update = [], syncer.recv_update
            syncer.recv_update = lambda: staged.append(1) or recv_update()    # apply() looks it up on the instance
            history = []
            for version in (1, 2, 3):
                assert syncer.apply(model) == version
                history.append(snapshot(model))
            # load_instant=false stages each update whole before writing it; true writes buckets as they land
            assert len(staged) == (0 if syncer.cfg.bucket.load_instant else 3), settings
            results.append(history)
    return results


@pytest.mark.slow
def test_bucket_load_instant_both_ways_to_two_receivers_exact_and_sized_by_hand():
    settings = [{"bucket_size": 50_000, "load_instant": True}, {"bucket_size": 50_000, "load_instant": False}]
    sender, *receivers = run_ranks(_bucket_updates, 3, args=(settings, torch.float32))
    for (history, stats), *copies in zip(sender, *receivers):
        assert all(bits_equal(copy[i], history[i]) for copy in copies for i in range(3))
        # Three frames (see the plan test) of 2, 1 and 4 rows: header, a 32-byte table row and an 8-byte
        # checksum per tensor, and each frame's 8-byte trailer check.
        assert stats == [(3 * (72 + 8) + 7 * 40 + sum(FP32_BYTES), sum(FP32_BYTES))] * 3


@pytest.mark.slow
def test_bucket_dtype_converts_floats_only():
    # bf16 on the wire to an fp32 receiver: floats are rounded to bf16, ints and bools are untouched.
    settings = [{"bucket_size": 50_000, "bucket_dtype": "bfloat16"}]
    ((history, stats),), (received,) = run_ranks(_bucket_updates, 2, args=(settings, torch.float32))
    for step in range(3):
        assert bits_equal(received[step], converted(history[step], torch.bfloat16, torch.float32))
    bf16_bytes = sum(n // 2 for n in FP32_BYTES[:5]) + sum(FP32_BYTES[5:])  # 46762 bytes: one bucket
    assert stats == [(72 + 8 + 7 * 40 + bf16_bytes, bf16_bytes)] * 3


@pytest.mark.slow
def test_bucket_to_a_bf16_receiver_sends_its_dtype():
    # bucket_dtype=None sends each tensor in the receiver's dtype: exact and half the bytes of fp32.
    settings = [{"bucket_size": 50_000}]
    ((history, stats),), (received,) = run_ranks(_bucket_updates, 2, args=(settings, torch.bfloat16))
    for step in range(3):
        assert bits_equal(received[step], converted(history[step], torch.bfloat16))
    bf16_bytes = sum(n // 2 for n in FP32_BYTES[:5]) + sum(FP32_BYTES[5:])
    assert stats == [(72 + 8 + 7 * 40 + bf16_bytes, bf16_bytes)] * 3


def _frozen_equal_after_conversion(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(50, generator=g), "frozen": torch.randn(50, generator=g)}  # fp32, not bf16-exact
    if rank == 0:
        syncer.init_sender(state, keys=["w"])
        state["w"] += 1.0
        syncer.sync(state, 1)
        return snapshot(state)
    model = cast_floats(state, torch.bfloat16)  # the same weights, loaded into a bf16 rollout copy
    syncer.init_receiver(model)
    assert syncer.apply(model) == 1
    return snapshot(model)


@pytest.mark.slow
def test_frozen_keys_are_compared_in_the_receivers_dtype():
    """The start check of keys no sync carries compares the sender's weights converted to the receiver's dtype:
    an fp32 trainer and a bf16 copy loaded from the same weights start equal (not every fp32 value is a bf16)."""
    sender, receiver = run_ranks(_frozen_equal_after_conversion, 2)
    assert not torch.equal(sender["frozen"], sender["frozen"].bfloat16().float())
    assert bits_equal(receiver, cast_floats(sender, torch.bfloat16))


def _narrow_wire(rank, world_size, bucket_dtype):
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket", bucket=BucketConfig(bucket_dtype=bucket_dtype)),
                                src=0, dsts=[1])
    state = {"w": torch.zeros(7)}
    if rank == 0:
        syncer.init_sender(state)
        state["w"][:] = torch.tensor([1e5, -1e5, 65504.0, 1e-9, -1e-9, 1.0, 3e38])
        syncer.sync(state, 1)
        return None
    syncer.init_receiver(state)
    assert syncer.apply(state) == 1  # no error: the checksums are of the values on the wire
    return state["w"]


@pytest.mark.slow
def test_a_narrow_bucket_dtype_rounds_without_error_float16_to_inf_and_zero_bfloat16_in_range():
    """docs/weight_sync.md, bucket.bucket_dtype: "A narrower one rounds, with no error: bfloat16 keeps float32's
    range, float16 turns values beyond ±65504 into ±inf and flushes those under about 6e-8 to 0". Expected values by
    the IEEE half format (largest finite 65504, smallest subnormal 2**-24 ~ 6e-8) and bfloat16's 8-bit mantissa.
    Mutant: BUCKET_DTYPES["float16"] = torch.bfloat16 (1e5 then arrives finite)."""
    _, half = run_ranks(_narrow_wire, 2, args=("float16",))
    inf = float("inf")
    assert half[[0, 1, 2, 5, 6]].tolist() == [inf, -inf, 65504.0, 1.0, inf]
    assert half[3].item() == 0.0 and half[4].item() == 0.0
    assert [torch.signbit(half[i]).item() for i in (3, 4)] == [False, True]  # flushed to zero, sign kept
    _, brain = run_ranks(_narrow_wire, 2, args=("bfloat16",))
    assert brain[:3].tolist() == [99840.0, -99840.0, 65536.0]  # 0x47C35000 -> 0x47C3; 65504 rounds up to 2**16
    assert torch.isfinite(brain).all() and abs(brain[6].item() / 3e38 - 1) < 2**-8
    assert abs(brain[3].item() / 1e-9 - 1) < 2**-8 and brain[5].item() == 1.0
