"""Protocol rules of sync/: when the periodic verification runs, what a failed verify(model) leaves behind, a
blocking apply after a non-blocking one, a non-blocking apply while a frame is still arriving, what the init
handshake must refuse (receivers in another key order, other tied keys) and must accept (zero-sized views, views of
one buffer at different offsets, which are not tied), bucket writes with frozen keys before synced ones, and a
bucket resync draining updates sent in bucket_dtype."""

import time

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks
from sync import BucketConfig, SyncIntegrityError, WeightSyncConfig, make_weight_syncer
from test_sync_common import bits_equal, snapshot, sync_once


# ----- patch: periodic verification and verify(model) -----------------------------------------------------

def _verify_when_versions_skip(rank, world_size):
    cfg = WeightSyncConfig(type="patch")
    cfg.patch.verify_every = 10
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = {"a": torch.zeros(50), "b": torch.zeros(50)}
    if rank == 0:
        syncer.init_sender(state)
        state["a"][3] = 1.0
        syncer.sync(state, 5)
        state["a"][4] = 2.0
        syncer.sync(state, 12)         # crosses 10 without landing on it
        syncer.resync(state, 13)
        return snapshot(state)
    syncer.init_receiver(state)
    assert syncer.apply(state) == 5
    state["b"][7] = 9.0                # written behind the syncer's back; no patch touches "b"
    with pytest.raises(SyncIntegrityError) as caught:
        syncer.apply(state)
    assert syncer.resync(state) == 13
    return str(caught.value), snapshot(state)


@pytest.mark.slow
def test_periodic_verification_runs_when_versions_cross_a_multiple_without_landing_on_it():
    """docs: the receiver rescans every synced tensor "every K versions". Versions only need to increase (a
    trainer syncing every few iterations sends 5, 12, ...), so the rescan is due whenever a patch crosses a
    multiple of K, not only when its version is one: with K=10, patch 12 on base 5 must rescan and find the
    tensor changed behind the syncer's back. A rule keyed on `version % K == 0` would never rescan such a
    trainer's receivers."""
    sender, (message, received) = run_ranks(_verify_when_versions_skip, 2, timeout=60)
    assert "verification found ['b'] changed" in message
    assert bits_equal(received, sender)


def _verify_on_demand_then_apply(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"w": torch.zeros(40)}
    if rank == 0:
        syncer.init_sender(state)
        state["w"][1] = 1.0
        syncer.sync(state, 1)
        syncer.resync(state, 2)
        return snapshot(state)
    syncer.init_receiver(state)
    state["w"][20] = 5.0               # the rollout copy changed behind the syncer's back
    with pytest.raises(SyncIntegrityError) as caught:
        syncer.verify(state)
    verify_message = str(caught.value)
    with pytest.raises(SyncIntegrityError) as caught:
        syncer.apply(state)            # an intact patch, but onto a model known to be wrong
    apply_message, version = str(caught.value), syncer.version
    assert syncer.resync(state) == 2
    syncer.verify(state)               # clean again after resync
    return verify_message, apply_message, version, snapshot(state)


@pytest.mark.slow
def test_a_failed_verify_on_demand_makes_the_receiver_refuse_updates_until_resync():
    """docs: a mismatch found after writing makes the receiver refuse every update until resync(). verify(model)
    is the caller's own check of that: when it finds the model changed, the next (intact) patch must not be
    applied on top of the wrong weights as if all were well (it would carry its checksums forward from a
    model that no longer matches them); apply must raise "needs resync" and leave the version at 0."""
    sender, (verify_message, apply_message, version, received) = run_ranks(_verify_on_demand_then_apply, 2,
                                                                           timeout=60)
    assert "verification found ['w'] changed" in verify_message
    assert "needs resync" in apply_message and version == 0
    assert bits_equal(received, sender)


# ----- non-blocking, then blocking apply --------------------------------------------------------------------

def _blocking_after_non_blocking(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"w": torch.zeros(30)}
    if rank == 0:
        syncer.init_sender(state)
        dist.barrier()
        time.sleep(1.0)                # the receiver's blocking apply is waiting by now
        state["w"][2] = 3.0
        syncer.sync(state, 1)
        return None
    syncer.init_receiver(state)
    started = syncer.apply(state, blocking=False)   # starts the background receive
    dist.barrier()
    finished = syncer.apply(state)                  # blocking: must wait for the update in flight
    return started, finished, state["w"][2].item()


@pytest.mark.slow
def test_a_blocking_apply_waits_for_the_update_a_non_blocking_one_started():
    """docs (Non-blocking apply): blocking=False never waits; a plain apply(model) blocks until an update is
    in place. When a non-blocking apply already started the receive, a later blocking apply must wait for it
    and return the new version, not return the old one as a non-blocking call would (the caller asked to
    block, e.g. before an evaluation that needs the new weights)."""
    _, (started, finished, value) = run_ranks(_blocking_after_non_blocking, 2, timeout=60)
    assert (started, finished, value) == (0, 1, 3.0)


def _non_blocking_while_the_trailer_is_held(rank, world_size, go_file):
    import os
    import threading
    import sync.patch
    from dist import comm
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"w": torch.zeros(100)}        # 1 change of 100, under 1/64: its checksum is updated, not rescanned
    if rank == 0:
        held = sync.patch.update_checksum

        def checksum_when_let_go(*args):   # runs while the payload is in flight: the trailer waits for it
            while not os.path.exists(go_file):
                time.sleep(0.01)
            return held(*args)

        sync.patch.update_checksum = checksum_when_let_go
        syncer.init_sender(state)
        state["w"][2] = 3.0
        syncer.sync(state, 1)
        return None
    syncer.init_receiver(state)
    first = syncer.apply(state, blocking=False)             # starts the background receive
    while comm.ledger_snapshot().get("weight_sync", (0, 0))[0] < 4:
        time.sleep(0.01)                                    # header, table, payload and trailer receives posted
    time.sleep(0.5)
    calls = []
    caller = threading.Thread(target=lambda: calls.append(syncer.apply(state, blocking=False)), daemon=True)
    caller.start()
    caller.join(timeout=20)
    returned = list(calls)
    open(go_file, "w").close()                              # the sender sends the trailer now
    caller.join()
    while syncer.apply(state, blocking=False) != 1:
        time.sleep(0.01)
    return first, returned, state["w"][2].item()


@pytest.mark.slow
def test_a_non_blocking_apply_does_not_wait_for_a_frame_still_arriving(tmp_path):
    """docs (Non-blocking apply): blocking=False never waits; the update is applied once it fully arrived. The
    background receive ended when a patch's header and table had come, so the next non-blocking call waited for
    the payload and trailer inside, holding the readers' lock (here: until the sender lets its trailer go)."""
    _, (first, returned, value) = run_ranks(_non_blocking_while_the_trailer_is_held, 2,
                                            args=(str(tmp_path / "go"),), timeout=90)
    assert (first, returned, value) == (0, [0], 3.0)


# ----- init handshake ------------------------------------------------------------------------------------

def _receivers_in_another_key_order(rank, world_size):
    state = {"a": torch.zeros(6), "b": torch.zeros(6)}
    if rank == 2:
        state = {"b": state["b"], "a": state["a"]}  # same keys, shapes and dtypes; another order
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1, 2])
    with pytest.raises(ValueError) as error:
        syncer.init_sender(state) if rank == 0 else syncer.init_receiver(state)
    return str(error.value)


@pytest.mark.slow
def test_receivers_in_another_key_order_are_refused():
    """A tensor's ordinal on the wire is its position in the receivers' key order (taken from the first
    receiver). A second receiver with the same keys in another order would write each update into the wrong
    tensor (here "a" into "b": same shape, so nothing else would notice), so the handshake must refuse it on
    every rank, as it refuses receivers that differ in shapes, dtypes or ties."""
    for message in run_ranks(_receivers_in_another_key_order, 3, timeout=60):
        assert "receiver rank 2 differs from receiver rank 1 in key order" in message, message


def _other_ties(rank, world_size):
    x, y = torch.zeros(4), torch.zeros(4)
    # Sender: a and b are one tensor; receiver: a and c are. One tie on each side.
    state = {"a": x, "b": x, "c": y} if rank == 0 else {"a": x, "b": y, "c": x}
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    with pytest.raises(ValueError) as caught:
        syncer.init_sender(state) if rank == 0 else syncer.init_receiver(state)
    return str(caught.value)


@pytest.mark.slow
def test_ties_between_other_keys_are_refused_even_when_as_many():
    """Tied keys travel once, under the first key, so the two sides must tie the same keys: a receiver that
    ties a with c while the sender ties a with b would never receive c's own values (and b would be written
    separately on a receiver that keeps it apart). The handshake compares the ties themselves, not their
    number."""
    for message in run_ranks(_other_ties, 2):
        assert "tied keys differ: sender [['a', 'b']], receiver [['a', 'c']]" in message, message


def _zero_sized_views(rank, world_size):
    if rank == 0:   # zero-sized views into real storage on the sender, fresh empty tensors on the receiver
        base = torch.zeros(5, 3)
        state = {"w": torch.zeros(8), "e1": base[:0], "e2": torch.zeros(7, 3)[:0]}
    else:
        state = {"w": torch.zeros(8), "e1": torch.zeros(0, 3), "e2": torch.zeros(0, 3)}
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    return sync_once(syncer, rank, state, lambda s: s["w"].__setitem__(5, 2.0))


@pytest.mark.slow
def test_zero_sized_tensors_are_never_taken_for_tied_keys():
    """docs: zero-sized tensors are synced like any other. Two fresh empty tensors share the null data
    pointer, and zero-sized views of real tensors do not, so tie detection must leave zero-sized tensors out;
    else a receiver of fresh empty tensors looks tied where a sender of views is not, and the handshake
    refuses two identical layouts."""
    sender, received = run_ranks(_zero_sized_views, 2, timeout=60)
    assert bits_equal(received, sender)


def test_metadata_dtype_names_that_are_not_dtypes_are_refused():
    """The handshake document's dtype strings come from another process. A name that is a torch attribute but
    not a dtype (torch.Size, torch.Tensor) must be refused as an unknown dtype, as an unknown name is, instead
    of being carried on as if it were one."""
    from sync.handshake import named_dtype
    assert named_dtype("torch.bfloat16") is torch.bfloat16 and named_dtype("int64") is torch.int64
    for name in ("torch.Size", "torch.Tensor", "torch.nonsense"):
        with pytest.raises(ValueError, match="unknown dtype"):
            named_dtype(name)


# ----- bucket ------------------------------------------------------------------------------------------------

def _staged_with_frozen_first(rank, world_size):
    cfg = WeightSyncConfig(type="bucket", bucket=BucketConfig(load_instant=False))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = {"frozen": torch.zeros(5), "b": torch.zeros(5), "c": torch.zeros(3)}

    def change(s):
        s["b"].copy_(torch.arange(5.0))
        s["c"].copy_(torch.tensor([7.0, 8.0, 9.0]))
    staged, recv_update = [], syncer.recv_update
    syncer.recv_update = lambda: staged.append(1) or recv_update()    # apply() looks it up on the instance
    result = sync_once(syncer, rank, state, change, keys=["b", "c"])
    assert len(staged) == rank, "the receiver's update must go through the staged path"
    return result


@pytest.mark.slow
def test_staged_bucket_update_writes_each_tensor_by_its_ordinal_when_a_frozen_key_comes_first():
    """Rows carry ordinals in the receivers' key order, which counts frozen keys too. With load_instant=false
    the staged update must be written by that ordinal: b and c (ordinals 1 and 2) land in b and c, the
    frozen key (ordinal 0) is untouched."""
    sender, received = run_ranks(_staged_with_frozen_first, 2, timeout=60)
    assert received["b"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and received["c"].tolist() == [7.0, 8.0, 9.0]
    assert received["frozen"].tolist() == [0.0] * 5
    assert bits_equal(received, sender)


def _resync_drains_bucket_dtype_updates(rank, world_size):
    cfg = WeightSyncConfig(type="bucket", bucket=BucketConfig(bucket_dtype="bfloat16"))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = {"w": torch.zeros(16), "steps": torch.zeros(2, dtype=torch.int64)}
    if rank == 0:
        syncer.init_sender(state)
        state["w"] += 1.5
        syncer.sync(state, 1)          # queued: the receiver resyncs without applying it
        state["w"] += 0.25
        state["steps"] += 3
        syncer.resync(state, 2)
        return snapshot(state)
    syncer.init_receiver(state)
    assert syncer.resync(state) == 2
    return snapshot(state)


@pytest.mark.slow
def test_resync_drains_queued_bucket_updates_sent_in_bucket_dtype():
    """docs (resync): updates still queued for the receiver are received and dropped first. Bucket updates
    travel in bucket_dtype (bf16 here, 2 bytes) while resync sends the receiver's dtype (fp32, 4 bytes): the
    drain must size the queued update in the wire dtype it was sent in, else it refuses (or misreads) the
    queued frame and resync never recovers the receiver. Expected: w = 1.75 everywhere, steps = 3."""
    sender, received = run_ranks(_resync_drains_bucket_dtype_updates, 2, timeout=60)
    assert received["w"].tolist() == [1.75] * 16 and received["steps"].tolist() == [3, 3]
    assert bits_equal(received, sender)


def _sender_not_contiguous(rank, world_size):
    state = {"a": torch.zeros(3, 4).t() if rank == 0 else torch.zeros(4, 3), "b": torch.zeros(5)}
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    with pytest.raises(ValueError) as caught:
        syncer.init_sender(state) if rank == 0 else syncer.init_receiver(state)
    return str(caught.value)


@pytest.mark.slow
def test_a_non_contiguous_tensor_on_the_sender_is_refused_on_both_sides():
    """docs (Init handshake): non-contiguous tensors make both sides raise the same error listing the keys;
    the existing test only puts one on the receiver. The sender's side must be refused as well, by name."""
    for message in run_ranks(_sender_not_contiguous, 2):
        assert "not_contiguous on the sender: ['a']" in message, message


def _sender_in_another_key_order(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    if rank == 0:
        state = {"a": torch.zeros(8), "b": torch.zeros(3)}
        syncer.init_sender(state, version=7)
        state["a"][2], state["b"][:] = 1.0, 2.0
        return syncer.sync(state, 8).changed_elements
    model = {"b": torch.full((3,), 5.0), "a": torch.full((8,), 5.0)}   # the receiver's own key order
    started = syncer.init_receiver(model)
    return started, syncer.apply(model), model["a"].tolist(), model["b"].tolist()


@pytest.mark.slow
def test_a_sender_listing_keys_in_another_order_and_starting_at_a_later_version():
    """Ordinals follow the receiver's key order whatever the sender's (patch rows go in ordinal order), and the
    receiver starts from the version the sender was initialized with (e.g. a resumed run)."""
    changed, (started, applied, a, b) = run_ranks(_sender_in_another_key_order, 2)
    assert (changed, started, applied) == (4, 7, 8)
    assert a == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0] and b == [2.0, 2.0, 2.0]


def _permuted_sender(rank, world_size, kind, settings):
    """Four tensors of one shape and dtype, so a tensor written under another's ordinal fails no shape or dtype
    check: only its values tell. The sender lists them in reverse; the receiver in its own (alphabetical) order."""
    cfg = WeightSyncConfig(type=kind, **({"bucket": BucketConfig(**settings)} if kind == "bucket" else {}))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    start = {k: torch.full((6,), float(i)) for i, k in enumerate("abcd")}
    if rank == 1:
        model = dict(start)
        syncer.init_receiver(model)
        for version in (1, 2):
            assert syncer.apply(model) == version
        return list(model), snapshot(model)
    state = {k: start[k].clone() for k in reversed(list(start))}
    syncer.init_sender(state)
    for version in (1, 2):
        for i, k in enumerate(state):       # each tensor its own change, in the sender's order
            state[k][version + i] += 10.0 * (i + 1) + version
        syncer.sync(state, version)
    return list(state), snapshot(state)


@pytest.mark.slow
@pytest.mark.parametrize("kind, settings", [("patch", {}), ("bucket", {"bucket_size": 24, "load_instant": True}),
                                            ("bucket", {"bucket_size": 24, "load_instant": False})])
def test_a_sender_with_its_keys_permuted_syncs_each_tensor_to_the_receivers_tensor_of_that_name(kind, settings):
    """The receivers' key order gives each tensor its ordinal on the wire (sync/link.py `_adopt`); the sender maps
    its own state by name, whatever its order. Bucket mode sends one 24-byte tensor per bucket here, so every frame
    names one ordinal."""
    (sender_keys, sent), (receiver_keys, received) = run_ranks(_permuted_sender, 2, args=(kind, settings))
    assert sender_keys == ["d", "c", "b", "a"] and receiver_keys == ["a", "b", "c", "d"]
    assert bits_equal(received, sent)
    assert len({tuple(v.tolist()) for v in sent.values()}) == 4      # four different tensors: a swap would show


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
