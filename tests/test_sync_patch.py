"""patch strategy over gloo: receivers end bit-identical to the sender through many random updates.

On a GPU, `SYNCPPO_TEST_DEVICE=cuda pytest tests/test_sync_patch.py -k every_update` puts both ranks'
weights on it (frames still travel over gloo through the host), with the sender's snapshot on the host
(the default) and on the GPU; bench/gpu_check.sh runs it.
"""

import pytest
import torch

from multirank import run_ranks
from sync import PatchConfig, WeightSyncConfig, make_weight_syncer
from sync.encodings import BITMAP, DENSE, GAPS8, _bits as as_bits
from test_sync_common import (DEVICE, bits_equal, cast_floats, converted, make_state, on_device, random_update,
                              random_update_via_host, snapshot)

DENSITIES = [0.0, 0.001, 0.1, 1.0, 0.1, 0.001, 0.0]


def _run_updates(rank, world_size, receiver_dtype, patch_settings: list[dict]):
    """For each patch config: bootstrap a receiver that starts from other weights, then sync DENSITIES."""
    results = []
    for settings in patch_settings:
        syncer = make_weight_syncer(WeightSyncConfig(type="patch", patch=PatchConfig(**settings)),
                                    src=0, dsts=list(range(1, world_size)))
        if rank == 0:
            host, g = make_state(seed=0), torch.Generator().manual_seed(1)
            state = on_device(host)
            syncer.init_sender(state)
            history, stats = [], []
            for version, density in enumerate(DENSITIES, start=1):
                random_update_via_host(state, host, g, density)
                stats.append(syncer.sync(state, version))
                history.append(snapshot(state))
            results.append((history, stats))
        else:
            model = on_device(cast_floats(make_state(seed=100 + rank), receiver_dtype))
            assert syncer.init_receiver(model) == 0
            history = []
            for version in range(1, len(DENSITIES) + 1):
                assert syncer.apply(model) == version
                history.append(snapshot(model))
            results.append(history)
    return results


def _changed_elements(before: dict, after: dict, dtype) -> int:
    """Elements whose bits differ once both states are in the receiver's dtype (computed independently; converted
    where the sender converts: a CUDA bf16 NaN has other bits than the host's)."""
    before, after = converted(before, dtype), converted(after, dtype)
    return sum(int((as_bits(before[k].reshape(-1)) != as_bits(after[k].reshape(-1))).sum()) for k in before)


@pytest.mark.slow
@pytest.mark.parametrize("receiver_dtype", [torch.float32, torch.bfloat16])
def test_receiver_matches_sender_after_every_update(receiver_dtype):
    snapshots = [{}] if DEVICE == "cpu" else [{}, {"snapshot_device": "cuda"}]
    sender, receiver = run_ranks(_run_updates, 2, args=(receiver_dtype, snapshots))
    for (history, stats), received in zip(sender, receiver):
        before = make_state(seed=0)
        for step, density in enumerate(DENSITIES):
            assert bits_equal(received[step], converted(history[step], receiver_dtype)), f"step {step}"
            assert stats[step].changed_elements == _changed_elements(before, history[step], receiver_dtype)
            if density == 0.0:
                assert stats[step].wire_bytes == 72  # the header alone
            before = history[step]
        # A dense step touches every tensor whole; a 0.1% step leaves the big matrices sparse.
        assert stats[DENSITIES.index(1.0)].sparse_tensors == 0
        assert stats[1].sparse_tensors > 0


@pytest.mark.slow
def test_compression_changes_only_the_wire_and_two_receivers_match():
    settings = [{}, {"compression": "zstd"}]
    sender, *receivers = run_ranks(_run_updates, 3, args=(torch.float32, settings))
    for (history, stats), *received in zip(sender, *receivers):
        for copy in received:
            assert all(bits_equal(copy[i], history[i]) for i in range(len(DENSITIES)))
    (_, plain), (_, packed) = sender
    assert [s.payload_bytes for s in plain] == [s.payload_bytes for s in packed]
    assert [s.changed_elements for s in plain] == [s.changed_elements for s in packed]
    # and the wire does change: every sizable payload travels compressed (equal stats would pass with zstd unused)
    assert all(z.wire_bytes < p.wire_bytes for p, z in zip(plain, packed) if p.payload_bytes > 1000)
    assert any(p.payload_bytes > 1000 for p in plain)


def _hand_sized(rank, world_size, receiver_dtype):
    cfg = WeightSyncConfig(type="patch")
    cfg.patch.init_sync.bucket_size = 4000
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = {"dec.weight": torch.zeros(1000, 2), "vec": torch.zeros(10), "empty": torch.zeros(0, 3)}
    if rank == 0:
        syncer.init_sender(state)
        stats = [syncer.stats]
        state["dec.weight"][[0, 200, 400, 600], 0] = 1.0  # flat positions 0, 400, 800, 1200
        state["vec"][:6] = 1.0  # 6 of 10 changed
        stats.append(syncer.sync(state, 1))
        state["vec"][:] = 2.0  # all 10 changed
        stats.append(syncer.sync(state, 2))
        return [(s.wire_bytes, s.payload_bytes, s.sparse_tensors, s.dense_tensors) for s in stats]
    model = cast_floats(state, receiver_dtype)
    syncer.init_receiver(model)
    tables = []
    for _ in range(2):
        update = syncer.recv_update()
        tables.append(update.table[:, :4].tolist())
        syncer.apply_update(model, update)
    return tables, model["vec"].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("receiver_dtype", [torch.float32, torch.bfloat16])
def test_patch_bytes_and_encodings_by_hand(receiver_dtype):
    stats, (tables, vec) = run_ranks(_hand_sized, 2, args=(receiver_dtype,))
    v = receiver_dtype.itemsize
    header, table_row = 72, 4 * 8

    def trailer(rows):  # each row's checksum after the update, then the trailer's own check
        return (rows + 1) * 8

    # Bootstrap: dec.weight fills the 4000-byte bucket (8000 bytes in fp32, exactly 4000 in bf16), then a
    # second bucket with vec and the empty tensor: two frames of 1 and 2 dense rows (3 whole tensors).
    frames = header + table_row + trailer(1) + header + 2 * table_row + trailer(2)
    assert stats[0] == (frames + 2010 * v, 2010 * v, 0, 3)
    # Patch 1, dec.weight: gaps before each change 0, 399, 399, 399. In 1-byte symbols each 399 costs an
    # escape (255) plus 144: 7 bytes, less than 4 two-byte symbols (8) or a 250-byte bitmap.
    # vec: 6 adjacent changes of 10: a 2-byte bitmap beats 6 one-byte gaps and the whole vector.
    dec, vec_bytes = 7 + 4 * v, 2 + 6 * v
    assert stats[1] == (header + 2 * table_row + trailer(2) + dec + vec_bytes, dec + vec_bytes, 2, 0)
    assert tables[0] == [[0, 4, GAPS8, 7], [1, 6, BITMAP, 2]]
    # Patch 2: every element of vec changed: dense, no positions.
    assert stats[2] == (header + table_row + trailer(1) + 10 * v, 10 * v, 0, 1)
    assert tables[1] == [[1, 10, DENSE, 0]]
    assert vec == [2.0] * 10


def _staging_one_byte_short(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"m": torch.zeros(1000, dtype=torch.bool)}
    if rank == 0:
        syncer.init_sender(state)
        state["m"][10] = True   # 1-byte gaps [10] + 1 value byte: 2 payload bytes
        syncer.sync(state, 1)
        state["m"][310] = True  # gap 299: an escape (255) then 44, + 1 value byte: 3 payload bytes
        return syncer.sync(state, 2).payload_bytes
    syncer.init_receiver(state)
    assert syncer.apply(state) == 1
    first = syncer.staging[0].numel()
    assert syncer.apply(state) == 2
    return first, state["m"].nonzero().view(-1).tolist()


@pytest.mark.slow
def test_a_staging_buffer_one_byte_too_small_is_grown():
    """The receive buffer is reused across patches and grown when the next one needs more, even by one byte."""
    payload, (first, positions) = run_ranks(_staging_one_byte_short, 2)
    assert (first, payload) == (2, 3)
    assert positions == [10, 310]


def _staging_reused(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"m": torch.zeros(1000, dtype=torch.bool)}
    if rank == 0:
        syncer.init_sender(state)
        sent = []
        for position in (310, 10, 20):   # 3 payload bytes (gap 310: an escape, 55, a value byte), then 2 and 2
            state["m"][position] = True
            sent.append(syncer.sync(state, len(sent) + 1).payload_bytes)
        return sent
    syncer.init_receiver(state)
    assert syncer.apply(state) == 1
    first = syncer.staging[0]
    assert syncer.apply(state) == 2 and syncer.apply(state) == 3
    return first.numel(), len(syncer.staging), syncer.staging[0] is first, state["m"].nonzero().view(-1).tolist()


@pytest.mark.slow
def test_a_staging_buffer_large_enough_for_the_next_patch_is_reused_not_made_again():
    """The receive buffer made by the first patch (3 bytes) takes the next two (2 bytes each) in place: one
    allocation for the link, not one per frame."""
    sent, (size, buffers, same, positions) = run_ranks(_staging_reused, 2)
    assert sent == [3, 2, 2] and (size, buffers, same) == (3, 1, True)
    assert positions == [10, 20, 310]


def _one_sender_two_syncers(rank, world_size):
    """Rank 0 feeds an fp32 copy (rank 1) and a bf16 copy (rank 2) through a patch syncer each."""
    fp32 = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1]) if rank in (0, 1) else None
    bf16 = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[2]) if rank in (0, 2) else None
    if rank == 0:
        state, g = make_state(seed=0), torch.Generator().manual_seed(3)
        fp32.init_sender(state)
        bf16.init_sender(state)
        history = []
        for version, density in enumerate((0.01, 0.3, 1.0), start=1):
            random_update(state, g, density)
            fp32.sync(state, version)
            bf16.sync(state, version)
            history.append(snapshot(state))
        return history
    syncer = fp32 if rank == 1 else bf16
    model = cast_floats(make_state(seed=10 + rank), torch.float32 if rank == 1 else torch.bfloat16)
    syncer.init_receiver(model)
    return [snapshot(model) for version in (1, 2, 3) if syncer.apply(model) == version]


@pytest.mark.slow
def test_an_fp32_and_a_bf16_copy_take_a_syncer_each_from_the_same_sender():
    """docs/weight_sync.md, Frozen parameters: "an fp32 and a bf16 copy need a syncer each (both may have the same
    sender)". Each copy ends every version bit-equal to the sender's weights in its own dtype. Mutant: the sender's
    snapshot dict shared by all PatchSyncers (a class attribute), so the bf16 syncer's snapshot replaced the fp32
    one's and the fp32 copy's patches were computed against bf16 values."""
    history, full, half = run_ranks(_one_sender_two_syncers, 3)
    assert len(full) == len(half) == 3
    for step in range(3):
        assert bits_equal(full[step], history[step]), f"fp32 copy, version {step + 1}"
        assert bits_equal(half[step], cast_floats(history[step], torch.bfloat16)), f"bf16 copy, version {step + 1}"
