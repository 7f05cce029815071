"""What a sync/ receiver refuses (patches, buckets out of the plan, calls out of order, tied keys that
differ), whether the model was written first, and that resync() recovers every refusal not marked lost."""

import pytest
import torch

from multirank import run_ranks
from sync import BucketConfig, PatchConfig, SyncIntegrityError, WeightSyncConfig, make_weight_syncer
from test_checksum_reference import ref_checksum
from test_sync_common import bits_equal, snapshot


# ----- patch: what a receiver refuses, and whether the model was written first -----------------------------

def _refused_patches(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"w": torch.zeros(10), "frozen": torch.zeros(10), "m": torch.zeros(64, dtype=torch.bool),
             "big": torch.zeros(1000)}
    if rank == 0:
        syncer.init_sender(state, keys=["w", "m", "big"])
        state["w"][:] = torch.arange(1.0, 11.0)     # every element: dense
        syncer.sync(state, 1)
        syncer.resync(state, 2)
        state["m"][::8] = True                       # 8 of 64 (above 1/64): a bitmap, checked after writing
        syncer.sync(state, 3)
        syncer.resync(state, 4)
        state["big"][[10, 500, 990]] = 1.0          # 3 of 1000 (under 1/64): checked before writing
        syncer.sync(state, 5)
        syncer.resync(state, 6)
        state["m"][4::8] = True                      # 8 more of 64: a bitmap again
        syncer.sync(state, 7)
        syncer.resync(state, 8)
        return snapshot(state)
    syncer.init_receiver(state)
    errors = []
    # 1. A row naming a tensor this syncer does not sync (the frozen one), under a header check that passes.
    update, before = syncer.recv_update(), snapshot(state)
    assert update.table[:, 0].tolist() == [0] and syncer.keys[1] == "frozen"
    update.table[0, 0] = 1
    update.check = ref_checksum([update.words(), update.table])
    with pytest.raises(SyncIntegrityError) as caught:
        syncer.apply_update(state, update)
    errors.append((str(caught.value), caught.value.model_written, bits_equal(state, before), syncer.version))
    assert syncer.resync(state) == 2
    # 2. A bool stored as 2 in a sparse tensor dense enough to be checked only after writing.
    update, before = syncer.recv_update(), snapshot(state)
    update.segments[0][1].view(torch.uint8)[0] = 2
    with pytest.raises(SyncIntegrityError) as caught:
        syncer.apply_update(state, update)
    errors.append((str(caught.value), caught.value.model_written, bits_equal(state, before), syncer.version))
    assert syncer.resync(state) == 4
    # 3. A corrupted value of a sparse tensor under 1/64 density.
    update, before = syncer.recv_update(), snapshot(state)
    update.segments[0][1][1] = 2.0
    with pytest.raises(SyncIntegrityError) as caught:
        syncer.apply_update(state, update)
    errors.append((str(caught.value), caught.value.model_written, bits_equal(state, before), syncer.version))
    assert syncer.resync(state) == 6
    # 4. One more bit set in a bitmap: 9 positions for 8 values.
    update, before = syncer.recv_update(), snapshot(state)
    assert update.table[0, 2].item() == 3           # BITMAP
    update.segments[0][0][0] ^= 0x20                 # position 5
    with pytest.raises(SyncIntegrityError) as caught:
        syncer.apply_update(state, update)
    errors.append((str(caught.value), caught.value.model_written, bits_equal(state, before), syncer.version))
    assert syncer.resync(state) == 8
    return errors, snapshot(state)


@pytest.mark.slow
def test_patches_refused_before_anything_is_written():
    """docs/weight_sync.md: a patch touching a tensor the syncer does not sync, invalid bools, and a wrong value
    in a sparse tensor under 1/64 density are refused before anything is written: the model keeps its version
    and weights, and the error does not say `model_written` (which would make the receiver refuse everything
    until resync). A frozen key written by a patch would diverge silently, since no later update carries it;
    an invalid bool must be refused by name even where the checksum would only see it after writing; a bitmap
    with more positions than values must be refused as such (else index_copy_ raises a RuntimeError midway
    through the writes)."""
    sender, (errors, received) = run_ranks(_refused_patches, 2)
    assert len(errors) == 4
    expected = [("touches tensors this syncer does not sync: [1]", 0), ("invalid bools", 2),
                ("does not produce the sender's values", 4), ("a wrong number of changes", 6)]
    for (message, written, untouched, version), (needle, at) in zip(errors, expected):
        assert needle in message and not written and untouched and version == at, message
    assert bits_equal(received, sender)


# ----- calls that must be refused, and a receiver that must refuse until resync ---------------------------------

def _call_rules(rank, world_size):
    import sync.link
    out = {}
    # A. Bucket: versions must increase past the last one sent; a receiver model whose dtype or shape changed
    #    since init is refused before anything is received (the update stays queued for the right call).
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    state = {"a": torch.zeros(5), "b": torch.zeros(3)}
    if rank == 0:
        syncer.init_sender(state)
        state["a"] += 1
        syncer.sync(state, 1)
        with pytest.raises(ValueError) as caught:
            syncer.sync(state, 1)
        out["again"] = str(caught.value)
        state["b"] += 2
        syncer.sync(state, 2)
    else:
        syncer.init_receiver(state)
        assert syncer.apply(state) == 1
        out["changed"] = []
        for bad in ({**state, "a": state["a"].double()}, {**state, "b": torch.zeros(1, 3)}):
            with pytest.raises(ValueError) as caught:
                syncer.apply(bad)
            out["changed"].append(str(caught.value))
        out["applied"] = syncer.apply(state)
        out["state"] = snapshot(state)
    # B. Bucket, load_instant: a bucket whose values (received straight into the model) fail their checksum
    #    leaves the model written, so the receiver refuses the next update until resync().
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    state = {"w": torch.zeros(1000)}
    if rank == 0:
        syncer.init_sender(state)
        state["w"].copy_(torch.arange(1000.0))
        syncer.sync(state, 1)
        syncer.sync(state, 2)
        syncer.resync(state, 3)
    else:
        syncer.init_receiver(state)
        real = sync.link.recv_frame

        def damaged(*args):
            frame = real(*args)
            frame.wait()
            frame.segments[0][1].view(torch.uint8)[0] ^= 0x40
            return frame

        sync.link.recv_frame = damaged
        try:
            with pytest.raises(SyncIntegrityError) as caught:
                syncer.apply(state)
        finally:
            sync.link.recv_frame = real
        out["damaged"] = (str(caught.value), caught.value.model_written)
        with pytest.raises(SyncIntegrityError) as caught:
            syncer.apply(state)                 # update 2 is intact, but lands on a model known to be wrong
        out["next"] = str(caught.value)
        assert syncer.resync(state) == 3 and torch.equal(state["w"], torch.arange(1000.0))
    return out


@pytest.mark.slow
def test_calls_refused_and_a_written_model_refuses_updates_until_resync():
    """Refusals no other test exercised: a bucket sender repeating the version it last sent (the version it
    holds must advance with each sync); a receiver model whose dtype or shape changed since init (rollout copies
    cast to another dtype after init would otherwise receive bytes of the wrong width); and a bucket
    that failed its checksum after being received into the model, which must mark the receiver broken (the
    next, intact update is refused until resync(), because the model under it is known to be wrong)."""
    sender, receiver = run_ranks(_call_rules, 2)
    assert "version must increase, last sent 1, got 1" in sender["again"]
    assert all("shape or dtype changed since init" in m for m in receiver["changed"])
    assert "['a']" in receiver["changed"][0] and "['b']" in receiver["changed"][1]
    assert receiver["applied"] == 2 and receiver["state"]["b"].tolist() == [2.0] * 3
    message, written = receiver["damaged"]
    assert "does not match its checksums" in message and written
    assert "needs resync" in receiver["next"]


def _tied_on_one_side(rank, world_size):
    shared = torch.zeros(4, 3)
    state = {"embed": shared, "head": shared} if rank == 0 else {"embed": torch.zeros(4, 3), "head": torch.zeros(4, 3)}
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    with pytest.raises(ValueError) as caught:
        syncer.init_sender(state) if rank == 0 else syncer.init_receiver(state)
    return str(caught.value)


@pytest.mark.slow
def test_tied_keys_must_be_tied_on_both_sides():
    """Tied weights travel once, under the first key: a receiver whose two keys are separate tensors would
    keep its second copy stale forever. The handshake must refuse it on both sides, naming the tie."""
    for message in run_ranks(_tied_on_one_side, 2):
        assert "tied keys differ: sender [['embed', 'head']], receiver []" in message, message



def _plan_refusal_then_resync(rank, world_size):
    import sync.link
    cfg = WeightSyncConfig(type="bucket", bucket=BucketConfig(bucket_size=80))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(10)}   # plan: [a, b], [c]
    if rank == 0:
        syncer.init_sender(state)
        real_plan = sync.link.plan_buckets
        sync.link.plan_buckets = lambda nbytes, size: [[0], [1, 2]]     # a sender out of step with the plan
        state["a"] += 1
        syncer.sync(state, 1)
        sync.link.plan_buckets = real_plan
        syncer.resync(state, 2)
        return snapshot(state)
    syncer.init_receiver(state)
    with pytest.raises(SyncIntegrityError, match="disagree on the bucket plan"):
        syncer.apply(state)
    assert syncer.resync(state) == 2
    return snapshot(state)


@pytest.mark.slow
def test_a_bucket_refused_for_its_plan_still_lets_resync_recover():
    """A bucket refused because it does not follow the receiver's bucket plan (other tensors, another version)
    is refused with `model_written` and no warning that the link is lost, so resync() must recover it, as it
    does for every other refused bucket (tests/test_sync_resync.py). Until the refusal waited for the refused
    frame's payload and trailer receives, the next resync never completed on either side."""
    sender, received = run_ranks(_plan_refusal_then_resync, 2, timeout=30)
    assert bits_equal(received, sender)


def _apply_while_the_sender_resyncs(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    state = {"w": torch.zeros(10)}
    if rank == 0:
        syncer.init_sender(state)
        syncer.resync(state, 1)
        state["w"] += 1
        syncer.sync(state, 2)
        return snapshot(state)
    syncer.init_receiver(state)
    with pytest.raises(RuntimeError) as caught:
        syncer.apply(state)
    assert syncer.apply(state) == 2
    return str(caught.value), snapshot(state)


@pytest.mark.slow
def test_apply_refuses_a_resync_frame():
    """A receiver that calls apply() while the sender called resync() (the caller's protocol broken) must be
    told which call the sender made, not have the resync written as if it were an update of version 1: the
    two sides would then disagree on what happened without either knowing."""
    sender, (message, received) = run_ranks(_apply_while_the_sender_resyncs, 2, timeout=60)
    assert "expected a message of kind 1, got kind 3" in message
    assert bits_equal(received, sender)


def _bucket_frames_out_of_plan(rank, world_size):
    import sync.link
    cfg = WeightSyncConfig(type="bucket", bucket=BucketConfig(bucket_size=80))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(10)}   # plan: [a, b], [c]
    if rank == 0:
        syncer.init_sender(state)
        real_plan, real_send = sync.link.plan_buckets, sync.link.send_frame
        sync.link.plan_buckets = lambda nbytes, size: [[0], [1, 2]]     # 1. other tensors per bucket
        state["a"] += 1
        syncer.sync(state, 1)
        sync.link.plan_buckets = real_plan
        syncer.resync(state, 2)
        calls = []

        def second_frame_says_another_version(kind, version, *args, **kwargs):
            calls.append(version)
            return real_send(kind, version + (len(calls) == 2), *args, **kwargs)

        sync.link.send_frame = second_frame_says_another_version        # 2. buckets of two versions
        state["c"] += 1
        syncer.sync(state, 3)
        sync.link.send_frame = real_send
        syncer.resync(state, 5)
        return snapshot(state)
    syncer.init_receiver(state)
    out = []
    for restart in (2, 5):
        with pytest.raises(SyncIntegrityError) as caught:
            syncer.apply(state)
        out.append((str(caught.value), caught.value.model_written))
        assert syncer.resync(state) == restart           # drains the rest of the refused update
    return out, snapshot(state)


@pytest.mark.slow
def test_buckets_that_do_not_follow_the_receivers_plan_are_refused():
    """A receiver takes an update's buckets in the plan both sides derive from the same config: a bucket
    carrying other tensors than the plan's (a sender built differently) or a bucket of another version than
    the update's first (frames of two updates interleaved) must be refused, not written as if whole."""
    sender, (messages, received) = run_ranks(_bucket_frames_out_of_plan, 2, timeout=60)
    assert "bucket 0 of 2 at version 1 carries tensors [0], expected [0, 1]" in messages[0][0]
    assert "bucket 1 of 2 at version 4 carries tensors [2], expected [2] at version 3" in messages[1][0]
    assert messages[0][1] and messages[1][1]           # received into the model: written, resync needed
    assert bits_equal(received, sender)



def _bucket_plan_in_wire_dtype(rank, world_size):
    cfg = WeightSyncConfig(type="bucket", bucket=BucketConfig(bucket_dtype="bfloat16"))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = {"w": torch.zeros(10), "steps": torch.zeros(3, dtype=torch.int64)}
    syncer.init_sender(state) if rank == 0 else syncer.init_receiver(state)
    return [r.call_bytes for r in syncer.plan_rows() if r.purpose == "weight_sync"]


@pytest.mark.slow
def test_bucket_plan_counts_floats_in_the_wire_dtype():
    """plan_rows() (checked against the ledger elsewhere only with bucket_dtype=None) must size floating tensors
    in bucket_dtype: one frame of a 72-byte header, two 32-byte table rows, one packed payload of 10 bf16
    (20 bytes) and 3 int64 (24 bytes, ints keep their dtype), and a 24-byte trailer."""
    for rows in run_ranks(_bucket_plan_in_wire_dtype, 2):
        assert rows == [[72, 64, 44, 24]]



class _Posted:
    """A receive that dist.comm.irecv posted, and whether anyone waited for it."""

    def __init__(self, work):
        self.work, self.waited = work, False

    def wait(self):
        self.waited = True
        return self.work.wait()


def _refused_frames_taken_in_whole(rank, world_size, case):
    import sync.link
    import sync.patch
    from dist import comm

    if case == "plan":   # three 4 MB tensors, plan [a, b], [c]; every bucket is received straight into the model
        cfg = WeightSyncConfig(type="bucket", bucket=BucketConfig(bucket_size=8_000_000))
    else:                # a compressed patch whose payload does not decompress: its trailer is still on the way
        cfg = WeightSyncConfig(type="patch", patch=PatchConfig(compression="zstd"))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = {name: torch.zeros(1_000_000) for name in "abc"}
    if rank == 0:
        syncer.init_sender(state)
        real_plan = sync.link.plan_buckets
        if case == "plan":
            sync.link.plan_buckets = lambda nbytes, size: [[0], [1, 2]]     # a sender out of step with the plan
        state["a"][::3] += 1
        syncer.sync(state, 1)
        sync.link.plan_buckets = real_plan
        state["b"] += 2
        syncer.resync(state, 2)
        state["c"][5] = 7.0
        syncer.sync(state, 3)
        return snapshot(state)
    syncer.init_receiver(state)
    decompress, irecv, posted = sync.patch.zstd_decompress, comm.irecv, []
    sync.patch.zstd_decompress = lambda data, raw: decompress(data[:data.numel() // 2], raw)   # damaged on the way
    comm.irecv = lambda *args, **kwargs: posted.append(_Posted(irecv(*args, **kwargs))) or posted[-1]
    try:
        syncer.apply(state)
        refused = None
    except SyncIntegrityError as error:
        refused = str(error)
    finally:
        sync.patch.zstd_decompress, comm.irecv = decompress, irecv
    pending = sum(not work.waited for work in posted)   # kept alive here: a stalled link would not say which
    assert syncer.resync(state) == 2 and syncer.apply(state) == 3
    return refused, len(posted), pending, snapshot(state)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["plan", "zstd"])
def test_a_refused_frame_is_received_whole_before_the_error_is_raised(case):
    """A frame refused after its payload and trailer receives were posted (a bucket out of the receiver's plan, a
    compressed payload that does not decompress) must be received whole before the error reaches the caller: a
    receive still pending when the caller drops the error, and the frame with it, is lost, and resync() then
    read the rest of the frame as the next header (a stall; with the receives kept alive here the link stays in
    step, so the pending count says it). Resync recovers, and the update after it lands bit for bit."""
    sender, (refused, posted, pending, received) = run_ranks(_refused_frames_taken_in_whole, 2, args=(case,),
                                                             timeout=60)
    assert refused.startswith({"plan": "weight sync: bucket 0 of 2 at version 1 carries tensors [0], expected [0, 1]",
                               "zstd": "weight sync: zstd could not decompress the patch payload"}[case])
    # plan: the refused bucket's one 4 MB value segment and its trailer, then the rest of the update taken in (the
    # sender's second bucket: two 4 MB segments and a trailer), as after a bucket that fails its checksums; zstd: the
    # trailer (the blob is blocking)
    assert (posted, pending) == ({"plan": 5, "zstd": 1}[case], 0)
    assert bits_equal(received, sender)
