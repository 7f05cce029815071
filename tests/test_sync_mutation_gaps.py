"""Gaps found by mutation testing of sync/: each test pins a behaviour that a small change to sync/ left
unnoticed by the rest of the suite. Expected values are worked out by hand in the comments, not read back
from the code under test."""

import pytest
import torch
from torch import nn

from multirank import run_ranks
from sync import PatchConfig, SyncIntegrityError, WeightSyncConfig, make_weight_syncer, trainable_keys
from sync.encodings import _decode
from sync.wire import BITMAP, DENSE, GAPS8
from test_sync_common import bits_equal, snapshot, sync_once
from test_sync_resync import _zstd_queued_then_resync


@pytest.mark.slow
def test_resync_drains_a_queued_compressed_patch_that_would_not_decompress():
    """Mutant: the drain decompresses queued blobs (zstd_discard -> zstd_decompress); a damaged one then made
    resync() raise instead of recovering the link."""
    sender, receiver = run_ranks(_zstd_queued_then_resync, 2, args=(True,), timeout=60)
    assert bits_equal(receiver, sender)


def _corrupted_value(rank, world_size, step, table, written):
    """One patch that sets every `step`-th of 256 zeros to 1.0; the receiver damages the value at position 0
    after it arrived, applies it, and reports whether the model was written (then resync() recovers)."""
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"w": torch.zeros(256)}
    if rank == 0:
        syncer.init_sender(state)
        state["w"][::step] = 1.0
        syncer.sync(state, 1)
        syncer.resync(state, 2)
        return snapshot(state)
    syncer.init_receiver(state)
    update = syncer.recv_update()
    assert update.table.tolist() == table
    update.segments[0][1][0] = 2.0               # a wrong value at position 0
    with pytest.raises(SyncIntegrityError) as caught:
        syncer.apply_update(state, update)
    assert caught.value.model_written == written and syncer.version == 0
    assert state["w"][0] == (2.0 if written else 0.0)
    assert syncer.resync(state) == 2
    return snapshot(state)


@pytest.mark.slow
@pytest.mark.parametrize("step, table, written", [
    # 4 of 256, exactly 1/64, so not under it: checked after writing. Gaps 0, 63, 63, 63 as 1-byte symbols:
    # 4 + 16 value bytes = 20, under a bitmap (32 + 16) and dense (1024).
    (64, [[0, 4, GAPS8, 4]], True),
    # 2 of 256, under 1/64: checked before writing (gaps 0, 127; 2 + 8 value bytes).
    (128, [[0, 2, GAPS8, 2]], False),
    # All 256 changed: dense (1024 bytes, under a bitmap's 32 + 1024), checked before anything is written.
    (1, [[0, 256, DENSE, 0]], False),
], ids=["sparse-at-one-sixty-fourth", "sparse-under-it", "dense"])
def test_when_a_corrupted_tensor_is_caught_follows_the_documented_density_rule(step, table, written):
    """docs/weight_sync.md: the receiver checks every whole tensor and every sparse tensor under 1/64 density
    before writing anything; a denser sparse tensor right after it is written (model_written). Mutants:
    `_incremental` with `<=` or INCREMENTAL_BELOW = 1/32 (the 1/64 tensor checked before writing) or 1/128 (the
    1/128 tensor checked after), and a dense row's pre-write checksum dropped (the dense tensor written, then
    found wrong)."""
    sender, receiver = run_ranks(_corrupted_value, 2, args=(step, table, written), timeout=60)
    assert bits_equal(receiver, sender)


def test_a_bitmap_bit_in_the_first_padding_position_is_flagged():
    """Mutant: the padding check started one bit late (`bits[numel + 1:]`), so a bit set at position `numel`
    (the first past the tensor) passed. 10 elements take 2 bytes; byte 1 bit 2 is element 10, outside."""
    index, flags = _decode(torch.tensor([0b10, 0b110], dtype=torch.uint8), BITMAP, 10)  # bits 1, 9, 10
    assert index.tolist() == [1, 9] and any(bool(f) for f in flags)
    index, flags = _decode(torch.tensor([0b10, 0b10], dtype=torch.uint8), BITMAP, 10)   # bits 1, 9 only
    assert index.tolist() == [1, 9] and not any(bool(f) for f in flags)


def test_trainable_keys_leave_out_a_frozen_parameter_under_every_name_it_has():
    """Mutant: trainable_keys listed parameters with duplicates removed, so a frozen module used twice was
    frozen under its first name only and its second state_dict key counted as trainable (sent by every sync)."""
    shared = nn.Linear(2, 2)
    shared.weight.requires_grad_(False)
    net = nn.Sequential(shared, shared)          # state_dict: 0.weight, 0.bias, 1.weight, 1.bias
    assert list(net.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert trainable_keys(net) == ["0.bias", "1.bias"]


def test_make_weight_syncer_refuses_a_config_that_is_not_a_weight_sync_config():
    """Mutant: the type check dropped, a YAML mapping given in place of the config failed with an AttributeError
    (`dict` has no `type`) instead of a TypeError that names what to pass. No rank is needed: it fails first."""
    with pytest.raises(TypeError, match="weight sync needs a WeightSyncConfig, got dict"):
        make_weight_syncer({"type": "patch"}, src=0, dsts=[1])


def _local_change_then_apply(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch", patch=PatchConfig(verify_every=0)), src=0, dsts=[1])
    state = {"w": torch.zeros(10), "v": torch.zeros(10)}
    if rank == 0:
        syncer.init_sender(state)
        for version in (1, 2):
            state["w"][version] = 1.0
            syncer.sync(state, version)
        return None
    syncer.init_receiver(state)
    state["v"][3] = 5.0                          # the receiver's model changed outside the syncer
    # verify_every=0: "only verify(model) on demand", so neither apply rescans "v" (an untouched tensor).
    assert syncer.apply(state) == 1 and syncer.apply(state) == 2
    with pytest.raises(SyncIntegrityError, match=r"\['v'\] changed on the receiver"):
        syncer.verify(state)
    return None


@pytest.mark.slow
def test_verify_every_zero_never_rescans_during_apply():
    """Mutant: `verify_every=0` treated as 1 (a rescan after every patch), so a receiver whose model changed
    outside the syncer was refused by apply() instead of only by an explicit verify()."""
    run_ranks(_local_change_then_apply, 2, timeout=60)


def _receiver_with_an_extra_key(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    state = {"w": torch.zeros(3)} if rank == 0 else {"w": torch.zeros(3), "extra": torch.zeros(2)}
    with pytest.raises(ValueError) as caught:
        if rank == 0:
            syncer.init_sender(state)
        else:
            syncer.init_receiver(state)
    return str(caught.value)


@pytest.mark.slow
def test_a_receiver_key_the_sender_lacks_fails_the_handshake_on_both_sides():
    """Mutant: only missing keys ended the comparison; a receiver's extra key then reached the per-key shape
    check, whose lookup raised a KeyError on the sender alone, and the receiver waited for a reply never sent."""
    for message in run_ranks(_receiver_with_an_extra_key, 2, timeout=30):
        assert "missing on the receiver [], unexpected on the receiver ['extra']" in message, message


def test_equal_shape_views_at_different_offsets_of_one_buffer_are_not_tied():
    """Mutant: the tie key without storage_offset. Two same-shape views of one flat buffer (a split qkv) share
    storage, shape, stride and dtype but not memory, so they are separate tensors, not tied ones; a view at the
    same offset is tied."""
    from sync.handshake import describe
    flat = torch.zeros(8)
    assert describe({"q": flat[:4], "k": flat[4:]}, WeightSyncConfig())["ties"] == []
    assert describe({"q": flat[:4], "q_again": flat[:4], "k": flat[4:]}, WeightSyncConfig())["ties"] == [
        ["q", "q_again"]]


def _split_views(rank, world_size, kind):
    flat = torch.zeros(8)
    syncer = make_weight_syncer(WeightSyncConfig(type=kind), src=0, dsts=[1])
    return sync_once(syncer, rank, {"q": flat[:4], "k": flat[4:]},
                     lambda s: (s["q"].__setitem__(1, 2.0), s["k"].__setitem__(2, 3.0)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_split_views_of_one_buffer_both_arrive(kind):
    """With the views taken for tied, only "q" would travel and the receiver's "k" would stay zero."""
    sender, received = run_ranks(_split_views, 2, args=(kind,), timeout=60)
    assert sender["k"].tolist() == [0.0, 0.0, 3.0, 0.0] and bits_equal(received, sender)
