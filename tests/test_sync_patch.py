"""patch strategy over gloo: receivers end bit-identical to the sender through many random updates."""

import pytest
import torch

from multirank import run_ranks
from sync import PatchConfig, WeightSyncConfig, make_weight_syncer
from sync.patch import _bits as as_bits
from test_sync_common import bits_equal, cast_floats, make_state, random_update, snapshot

DENSITIES = [0.0, 0.001, 0.1, 1.0, 0.1, 0.001, 0.0]


def _run_updates(rank, world_size, receiver_dtype, patch_settings: list[dict]):
    """For each patch config: bootstrap a receiver that starts from other weights, then sync DENSITIES."""
    results = []
    for settings in patch_settings:
        syncer = make_weight_syncer(WeightSyncConfig(type="patch", patch=PatchConfig(**settings)),
                                    src=0, dsts=list(range(1, world_size)))
        if rank == 0:
            state, g = make_state(seed=0), torch.Generator().manual_seed(1)
            syncer.init_sender(state)
            history, stats = [], []
            for version, density in enumerate(DENSITIES, start=1):
                random_update(state, g, density)
                stats.append(syncer.sync(state, version))
                history.append(snapshot(state))
            results.append((history, stats))
        else:
            model = cast_floats(make_state(seed=100 + rank), receiver_dtype)
            assert syncer.init_receiver(model) == 0
            history = []
            for version in range(1, len(DENSITIES) + 1):
                assert syncer.apply(model) == version
                history.append(snapshot(model))
            results.append(history)
    return results


def _changed_elements(before: dict, after: dict, dtype) -> int:
    """Elements whose bits differ once both states are in the receiver's dtype (computed independently)."""
    before, after = cast_floats(before, dtype), cast_floats(after, dtype)
    return sum(int((as_bits(before[k].reshape(-1)) != as_bits(after[k].reshape(-1))).sum()) for k in before)


@pytest.mark.slow
@pytest.mark.parametrize("receiver_dtype", [torch.float32, torch.bfloat16])
def test_receiver_matches_sender_after_every_update(receiver_dtype):
    sender, receiver = run_ranks(_run_updates, 2, args=(receiver_dtype, [{}]))
    (history, stats), received = sender[0], receiver[0]
    before = make_state(seed=0)
    for step, density in enumerate(DENSITIES):
        assert bits_equal(received[step], cast_floats(history[step], receiver_dtype)), f"step {step}"
        assert stats[step].changed_elements == _changed_elements(before, history[step], receiver_dtype)
        if density == 0.0:
            assert stats[step].wire_bytes == 64  # the header alone
        before = history[step]
    # A dense step touches every tensor whole; a 0.1% step leaves the big matrices sparse.
    assert stats[DENSITIES.index(1.0)].sparse_tensors == 0
    assert stats[1].sparse_tensors > 0


@pytest.mark.slow
def test_delta_encoding_and_compression_agree_and_two_receivers_match():
    settings = [{"delta_encoding": True}, {"delta_encoding": False}, {"compression": "zstd"},
                {"compression": "zstd", "delta_encoding": False}]
    sender, *receivers = run_ranks(_run_updates, 3, args=(torch.float32, settings))
    for (history, stats), *received in zip(sender, *receivers):
        for copy in received:
            assert all(bits_equal(copy[i], history[i]) for i in range(len(DENSITIES)))
    for (_, stats_a), (_, stats_b) in [(sender[0], sender[2]), (sender[1], sender[3])]:
        # zstd only changes the bytes on the wire, never what they decode to.
        assert [s.payload_bytes for s in stats_a] == [s.payload_bytes for s in stats_b]
    changed = [[s.changed_elements for s in stats] for _, stats in sender]
    assert changed[0] == changed[1] == changed[2] == changed[3]
    # Delta encoding narrows the row indices of sparse matrices: never more bytes, fewer at 0.1% density.
    delta_bytes, absolute_bytes = [[s.payload_bytes for s in stats] for _, stats in sender[:2]]
    assert all(d <= a for d, a in zip(delta_bytes, absolute_bytes)) and delta_bytes[1] < absolute_bytes[1]


def _hand_sized(rank, world_size, receiver_dtype, delta):
    cfg = WeightSyncConfig(type="patch", patch=PatchConfig(delta_encoding=delta))
    cfg.patch.init_sync.bucket_size = 4000
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = {"dec.weight": torch.zeros(1000, 2), "vec": torch.zeros(10)}
    if rank == 0:
        syncer.init_sender(state)
        stats = [syncer.stats]
        state["dec.weight"][[0, 200, 400, 600], 0] = 1.0  # rows 0..600: deltas fit uint8, absolutes need int16
        state["vec"][:6] = 1.0  # 6 of 10 changed
        stats.append(syncer.sync(state, 1))
        state["vec"][:7] = 2.0  # 7 of 10 changed
        stats.append(syncer.sync(state, 2))
        return [(s.wire_bytes, s.payload_bytes, s.sparse_tensors, s.dense_tensors) for s in stats]
    model = cast_floats(state, receiver_dtype)
    syncer.init_receiver(model)
    tables = []
    for _ in range(2):
        update = syncer.recv_update()
        tables.append(update.table[:, :4].tolist())
        syncer.apply_update(model, update)
    return tables


@pytest.mark.slow
@pytest.mark.parametrize("receiver_dtype, delta", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_patch_bytes_index_dtypes_and_dense_fallback_by_hand(receiver_dtype, delta):
    stats, tables = run_ranks(_hand_sized, 2, args=(receiver_dtype, delta))
    value = receiver_dtype.itemsize
    uint8, int16, dense = 0, 1, -1
    header, table_row = 64, 5 * 8
    # Bootstrap: dec.weight (8000 fp32 bytes, over the 4000-byte bucket) travels alone, then vec (40 bytes);
    # bootstrap and patches travel in the receiver's dtype.
    assert stats[0] == (2 * header + 2000 * value + 10 * value, 2000 * value + 10 * value, 0, 0)

    # Patch 1, dec.weight: 4 changes at rows 0, 200, 400, 600, col 0. Rows as deltas (0, 200, 200, 200) fit
    # uint8; absolute rows need int16. Each tensor picks its own index dtypes.
    row_bytes = 1 if delta else 2
    dec = 4 * (row_bytes + 1 + value)
    # vec, viewed as (1, 10): 6 changes cost 6 * (1 + 1 + 4) = 36 < 40 bytes whole in fp32 (sparse), but
    # 6 * (1 + 1 + 2) = 24 >= 20 bytes whole in bf16 (dense).
    vec_sparse = 6 * (1 + 1 + value) < 10 * value
    vec = 6 * (1 + 1 + value) if vec_sparse else 10 * value
    assert stats[1] == (header + 2 * table_row + dec + vec, dec + vec, 1 + vec_sparse, 1 - vec_sparse)
    assert tables[0] == [[0, 4, uint8 if delta else int16, uint8], [1, 6, uint8, uint8] if vec_sparse else [1, 10, dense, dense]]

    # Patch 2: 7 of 10 changed: 7 * (1 + 1 + value) >= 10 * value in both dtypes, so vec goes whole.
    assert stats[2] == (header + table_row + 10 * value, 10 * value, 0, 1)
    assert tables[1] == [[1, 10, dense, dense]]
