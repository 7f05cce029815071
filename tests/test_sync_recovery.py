"""Integrity without blind spots over gloo: flipped headers, resync with queued updates, checksummed buckets,
zero-sized tensors, frozen keys in bucket mode, receiver-side verification, and the ledger."""

import pytest
import torch
import torch.distributed as dist

import sync.link
import sync.wire
from dist import comm
from multirank import run_ranks
from sync import PatchConfig, SyncIntegrityError, WeightSyncConfig, make_weight_syncer
from test_sync_common import bits_equal, damaged_receives, drain, make_state, random_update, snapshot


def _queued_then_resync(rank, world_size, mode):
    syncer = make_weight_syncer(WeightSyncConfig(type=mode), src=0, dsts=[1])
    state = {**make_state(seed=0), "empty": torch.zeros(0, 3)}
    if rank == 0:
        g = torch.Generator().manual_seed(1)
        syncer.init_sender(state)
        for version in (1, 2, 3):  # 2 and 3 are still queued when the receiver gives up on 1
            random_update(state, g, 0.1)
            syncer.sync(state, version)
        syncer.resync(state, 4)
        random_update(state, g, 0.1)
        syncer.sync(state, 5)
        return snapshot(state)
    model = {**make_state(seed=7), "empty": torch.zeros(0, 3)}
    syncer.init_receiver(model)
    if mode == "patch":
        update = syncer.recv_update()
        update.version += 1  # a flipped version: the header check refuses it before anything is written
        before = snapshot(model)
        with pytest.raises(SyncIntegrityError, match="failed its checksum"):
            syncer.apply_update(model, update)
        assert bits_equal(model, before)
    else:
        real = sync.link.recv_frame

        def damaged(*args):  # a byte of the bucket's largest tensor flipped on the way (it arrives in the model)
            frame = real(*args)
            frame.wait()
            values = max((values for _, values in frame.segments), key=torch.numel).view(torch.uint8)
            values[len(values) // 2] ^= 0x10
            return frame

        sync.link.recv_frame = damaged
        with pytest.raises(SyncIntegrityError, match="does not match its checksums"):
            syncer.apply(model)
        sync.link.recv_frame = real
    assert syncer.resync(model) == 4
    assert syncer.apply(model) == 5
    return snapshot(model)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["patch", "bucket"])
def test_resync_recovers_with_updates_queued_and_refused_headers_and_buckets(mode):
    sender, receiver = run_ranks(_queued_then_resync, 2, args=(mode,))
    assert bits_equal(receiver, sender)


def _frozen_differs(rank, world_size):
    state = make_state(seed=0)
    if rank == 1:
        state["steps"] += 1
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    with pytest.raises(SyncIntegrityError) as error:
        keys = [k for k in state if k != "steps"]
        syncer.init_sender(state, keys=keys) if rank == 0 else syncer.init_receiver(state)
    return str(error.value)


@pytest.mark.slow
def test_bucket_mode_checks_frozen_keys_at_init_on_both_sides():
    for message in run_ranks(_frozen_differs, 2):
        assert "frozen weights" in message and "'steps'" in message


def _verify_and_ledger(rank, world_size):
    cfg = WeightSyncConfig(type="patch")
    cfg.patch.verify_every = 2
    syncer = make_weight_syncer(cfg, src=0, dsts=[1, 2])
    state = make_state(seed=0)
    comm.reset_ledger()
    if rank == 0:
        g = torch.Generator().manual_seed(1)
        syncer.init_sender(state)
        wire = []
        for version in (1, 2, 3, 4):
            random_update(state, g, 0.01)
            stats = syncer.sync(state, version)
            wire.append((stats.wire_bytes, stats.sparse_tensors, stats.dense_tensors))
        return {k: list(v) for k, v in comm.LEDGER.items()}, wire
    model = make_state(seed=5)
    syncer.init_receiver(model)
    comm.reset_ledger()
    assert syncer.apply(model) == 1
    if rank == 1:  # someone writes the rollout copy behind the syncer's back: the next full check finds it
        model["enc.weight"][3, 4] += 1.0
    errors = []
    for _ in (2, 3, 4):
        try:
            syncer.apply(model)
        except SyncIntegrityError as error:
            errors.append(str(error))
    return {k: list(v) for k, v in comm.LEDGER.items()}, errors


@pytest.mark.slow
def test_periodic_verification_and_every_message_in_the_ledger():
    (sender_ledger, wire), (ledger_1, errors_1), (ledger_2, errors_2) = run_ranks(_verify_and_ledger, 3)
    assert errors_2 == []
    assert "verification found ['enc.weight'] changed" in errors_1[0]
    assert all("needs resync" in e for e in errors_1[1:]) and len(errors_1) == 3
    # Each receiver received every byte the sender sent it: 4 frames of header, table, payload and trailer;
    # the payload segments (positions and values of each sparse tensor, values of each dense one) are far
    # under 1 MiB here, so they travel as one message.
    calls = sum(3 + 1 for _ in wire)
    total = sum(w for w, _, _ in wire)
    assert all(sparse + dense for _, sparse, dense in wire)
    assert sender_ledger["weight_sync"] == [2 * calls, 2 * total]
    assert ledger_2["weight_sync"] == ledger_1["weight_sync"] == [calls, total]
    assert "weight_sync_setup" in sender_ledger


def _trailer_and_verify(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = make_state(seed=0)
    if rank == 0:
        g = torch.Generator().manual_seed(1)
        syncer.init_sender(state)
        random_update(state, g, 0.05)
        syncer.sync(state, 1)
        syncer.resync(state, 2)
        syncer.resync(state, 3)
        random_update(state, g, 0.05)
        syncer.sync(state, 4)
        return snapshot(state)
    model = make_state(seed=7)
    syncer.init_receiver(model)
    update, before = syncer.recv_update(), snapshot(model)
    update.trailer[0] += 1          # a checksum of the trailer flipped: its own check refuses the frame
    with pytest.raises(SyncIntegrityError, match="trailer corrupted"):
        syncer.apply_update(model, update)
    assert bits_equal(model, before) and syncer.version == 0
    assert syncer.resync(model) == 2
    syncer.verify(model)            # on demand: nothing changed, nothing raised
    model["dec.weight"][7, 1] = 123.0   # written behind the syncer's back
    with pytest.raises(SyncIntegrityError, match=r"\['dec.weight'\] changed on the receiver") as error:
        syncer.verify(model)
    assert error.value.model_written
    assert syncer.resync(model) == 3    # the only way out once the model is known to differ
    assert syncer.apply(model) == 4
    return snapshot(model)


@pytest.mark.slow
def test_a_corrupted_trailer_is_refused_and_verify_on_demand_finds_a_changed_model():
    sender, receiver = run_ranks(_trailer_and_verify, 2)
    assert bits_equal(receiver, sender)


def _header_damaged_in_flight(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"w": torch.zeros(100)}   # tiny: the frame's queued rest fits in the socket, so the sender returns
    if rank == 0:
        syncer.init_sender(state)
        state["w"][[3, 50]] = 1.0
        syncer.sync(state, 1)
        return None
    syncer.init_receiver(state)

    def version_flipped(header):
        header[2] += 1   # the version word, flipped before the header's own check

    with damaged_receives("recv_then_count", version_flipped), \
            pytest.raises(SyncIntegrityError, match="failed its checksum") as error:
        syncer.apply(state)
    assert not state["w"].any()
    # The rest of the frame: its table row (refused before it was received), one packed payload (2 one-byte gaps, 2
    # float32 values) and the trailer (1 row checksum + its check).
    drain(0, torch.empty(1, 4, dtype=torch.int64), torch.empty(10, dtype=torch.uint8),
          torch.empty(2, dtype=torch.int64))
    return str(error.value)


@pytest.mark.slow
def test_a_header_refused_before_its_payload_says_the_link_cannot_be_resynced():
    _, message = run_ranks(_header_damaged_in_flight, 2)
    assert "resync() cannot recover this link: create both syncers again on a fresh process group" in message


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


def _drained_ledger(rank, world_size, mode, compression):
    cfg = WeightSyncConfig(type=mode, patch=PatchConfig(compression=compression))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = make_state(seed=0)
    if rank == 0:
        g = torch.Generator().manual_seed(2)
        syncer.init_sender(state)
        comm.reset_ledger()
        for version in (1, 2):            # both still queued when the receiver resyncs
            random_update(state, g, 0.2)
            syncer.sync(state, version)
        updates = comm.ledger_snapshot()["weight_sync"]
        syncer.resync(state, 3)
    else:
        syncer.init_receiver(state)
        comm.reset_ledger()
        assert syncer.resync(state) == 3
        updates = None
    return updates, {k: list(v) for k, v in comm.ledger_snapshot().items()}


@pytest.mark.slow
@pytest.mark.parametrize("mode, compression", [("patch", "none"), ("patch", "zstd"), ("bucket", "none")])
def test_updates_a_resync_drains_are_counted_under_weight_sync_as_the_sender_counted_them(mode, compression):
    """docs/weight_sync.md, Wire format: "A receiver draining queued updates before a resync counts them under
    `weight_sync`, as the sender did"; the resync itself is `weight_sync_setup`. The sender's ledger after its two
    syncs, alone, is what the receiver counts under `weight_sync`. Mutant: recv_whole's drain counted queued
    updates under the resync's purpose (`other = (SETUP, drop, ...)`)."""
    (updates, sent), (_, received) = run_ranks(_drained_ledger, 2, args=(mode, compression))
    assert received["weight_sync"] == sent["weight_sync"] == list(updates) and updates[0] >= 2
    assert received["weight_sync_setup"] == sent["weight_sync_setup"]
