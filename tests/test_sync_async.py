"""apply(model, blocking=False): a reader thread never sees a half-applied update or a version that is ahead
of (or behind) the weights in place; verify() on another thread never sees a resync half done, and a refusal
it sets stands; a resync after a non-blocking apply drops its refused receive, raises a lost link, and never
takes an error the caller was already given for a resync's first bucket."""

import threading

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks
from sync import BucketConfig, PatchConfig, SyncIntegrityError, WeightSyncConfig, make_weight_syncer
from test_sync_common import bits_equal, damaged_receives, drain, make_state, random_update, snapshot

UPDATES, TENSORS, SIZE = 12, 8, 50_000


def _async_apply(rank, world_size, cfg):
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    # Update v fills every tensor with v, so a reader can tell a half-applied model from a whole one.
    state = {f"layer{i}.weight": torch.zeros(SIZE) for i in range(TENSORS)}
    if rank == 0:
        syncer.init_sender(state)
        for version in range(1, UPDATES + 1):
            for value in state.values():
                value.fill_(float(version))
            syncer.sync(state, version)
        return None

    syncer.init_receiver(state)
    observed, torn, stop = [], [], threading.Event()

    def reader():
        while not stop.is_set():
            with syncer.lock:  # the safe point: the model is never written while this is held
                version = syncer.version
                values = torch.stack([value.clone() for value in state.values()])
            observed.append(version)
            if not bool((values == float(version)).all()):
                torn.append((version, values.unique().tolist()))

    thread = threading.Thread(target=reader)
    thread.start()
    returned = []
    while not returned or returned[-1] < UPDATES:
        returned.append(syncer.apply(state, blocking=False))
    stop.set()
    thread.join()
    return torn, observed, returned


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [WeightSyncConfig(type="patch"),
                                 WeightSyncConfig(type="bucket", bucket=BucketConfig(load_instant=False))],
                         ids=["patch", "bucket"])
def test_non_blocking_apply_never_exposes_a_half_updated_model(cfg):
    _, (torn, observed, returned) = run_ranks(_async_apply, 2, args=(cfg,))
    assert torn == []
    assert observed and observed == sorted(observed)  # the visible version only moves forward
    assert returned == sorted(returned) and returned[-1] == UPDATES
    assert set(range(1, UPDATES + 1)) <= set(returned)  # every update landed, none was skipped


class _HookedLock:
    """The receiver's lock, running `before` just before the next acquire and `after` just after the next release,
    once each: the other thread's verify() lands exactly where a scheduler could put it."""

    def __init__(self):
        self.lock, self.before, self.after = threading.Lock(), None, None

    def __enter__(self):
        hook, self.before = self.before, None
        if hook:
            hook()
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()
        hook, self.after = self.after, None
        if hook:
            hook()


def _send(syncer, resyncs: tuple, last: int, barrier: bool = False) -> dict:
    """The sender of the tests below: init (then a barrier, if asked), then versions 1..last, each a random 10%
    change sent by resync() for the versions in `resyncs` and by sync() otherwise; returns its final state."""
    state, g = make_state(seed=0), torch.Generator().manual_seed(1)
    syncer.init_sender(state)
    if barrier:
        dist.barrier()
    for version in range(1, last + 1):
        random_update(state, g, 0.1)
        syncer.resync(state, version) if version in resyncs else syncer.sync(state, version)
    return snapshot(state)


def _verify(syncer, model, said: list) -> None:
    """syncer.verify(model), appending None or the refusal's text to `said`."""
    try:
        syncer.verify(model)
        said.append(None)
    except SyncIntegrityError as error:
        said.append(str(error))


def _verify_on_another_thread(syncer, model, said: list) -> None:
    thread = threading.Thread(target=_verify, args=(syncer, model, said))
    thread.start()
    thread.join()


def _verify_around_resyncs(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    if rank == 0:
        return _send(syncer, resyncs=(2, 4), last=5)
    model = make_state(seed=7)
    syncer.init_receiver(model)
    syncer.lock = lock = _HookedLock()
    said = []

    def verify_on_another_thread():
        _verify_on_another_thread(syncer, model, said)

    assert syncer.apply(model) == 1
    lock.after = verify_on_another_thread          # right after the resync wrote the weights
    assert syncer.resync(model) == 2 and syncer.apply(model) == 3
    model["enc.bias"][0] += 1.0                    # the receiver's model changed: a verify must refuse it ...
    lock.before = verify_on_another_thread         # ... just before the resync that repairs it takes the lock
    assert syncer.resync(model) == 4 and syncer.apply(model) == 5
    return said, snapshot(model)


@pytest.mark.slow
def test_a_verify_on_another_thread_never_sees_a_resync_half_done():
    """A verify() right after a resync's weights landed compared them with the checksums of before (they were
    taken after the lock was released) and broke a healthy receiver; a verify that found a real change just
    before a resync took the lock left its refusal standing after the resync repaired the model (cleared outside
    the lock). Both are now read and written under the lock: the first verify passes, the second refuses, and
    both resyncs leave a receiver that applies the next update bit for bit."""
    sender, (said, received) = run_ranks(_verify_around_resyncs, 2, timeout=60)
    assert said[0] is None
    assert "verification found ['enc.bias'] changed on the receiver" in said[1]
    assert bits_equal(received, sender)


def _verify_right_after_a_resync_released_the_lock(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    if rank == 0:
        return _send(syncer, resyncs=(1, 3), last=3)
    model = make_state(seed=7)
    syncer.init_receiver(model)
    syncer.lock = lock = _HookedLock()
    said = []

    def change_then_verify_on_another_thread():
        model["enc.bias"][0] += 1.0                # written behind the syncer's back, just after the resync
        _verify_on_another_thread(syncer, model, said)

    lock.after = change_then_verify_on_another_thread
    assert syncer.resync(model) == 1
    try:
        refused = f"applied {syncer.apply(model)}"
    except SyncIntegrityError as error:
        refused = str(error)
    assert syncer.resync(model) == 3
    return said, refused, snapshot(model)


@pytest.mark.slow
def test_a_refusal_that_a_verify_sets_right_after_a_resync_stands():
    """The resync clears the receiver's refusal under the lock, together with the weights it wrote: a verify()
    on another thread that runs once the lock is released and finds the model changed must leave the receiver
    refusing the next update (cleared after the release, the refusal was lost and the update was applied on
    weights known to be wrong)."""
    sender, (said, refused, received) = run_ranks(_verify_right_after_a_resync_released_the_lock, 2, timeout=60)
    why = "['enc.bias'] changed on the receiver since the patches that wrote them"
    assert said == [f"weight sync: verification found {why}; call resync() on sender and receivers"]
    assert refused == f"weight sync: receiver needs resync() after: {why}"
    assert bits_equal(received, sender)


class _ContendedLock:
    """The receiver's lock; `contended` is set when a caller finds it held (and then waits for it)."""

    def __init__(self):
        self.lock, self.contended = threading.Lock(), threading.Event()

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            self.contended.set()
            self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()


def _verify_while_a_resync_holds_the_lock(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    if rank == 0:
        return _send(syncer, resyncs=(1,), last=2)
    model = make_state(seed=7)
    syncer.init_receiver(model)
    syncer.lock = lock = _ContendedLock()
    said, threads, adopt = [], [], syncer._adopt_checksums

    def verify():
        try:
            _verify(syncer, model, said)
        finally:
            lock.contended.set()                   # done (a verify that never waited for the lock)

    def verify_starts_between_weights_and_checksums(tensors):
        threads.append(threading.Thread(target=verify))
        threads[0].start()
        lock.contended.wait()                      # until the verify waits for the lock, or finished without it
        adopt(tensors)

    syncer._adopt_checksums = verify_starts_between_weights_and_checksums   # the resync's written(), in the lock
    assert syncer.resync(model) == 1
    threads[0].join()
    assert syncer.apply(model) == 2
    return said, snapshot(model)


@pytest.mark.slow
def test_a_verify_waits_for_the_lock_a_resync_holds():
    """verify() reads the weights and their checksums under the lock: one started while a resync has written the
    weights but not yet taken their checksums must wait and then pass (without the lock it compared the new
    weights with the old checksums and refused a healthy receiver)."""
    sender, (said, received) = run_ranks(_verify_while_a_resync_holds_the_lock, 2, timeout=60)
    assert said == [None]
    assert bits_equal(received, sender)


def _non_blocking_apply_refused_then_resync(rank, world_size, cfg):
    import sync.link
    import sync.patch
    from sync.wire import KIND_BUCKET

    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    if rank == 0:          # after the barrier the receiver's background receive is under way (not done);
        return _send(syncer, resyncs=(2,), last=3, barrier=True)   # update 1 is damaged on the way to it
    model = make_state(seed=7)
    syncer.init_receiver(model)
    decompress, recv_frame, damaged = sync.patch.zstd_decompress, sync.link.recv_frame, []

    def damaged_bucket(*args):                     # a value byte of the first bucket flipped (staged, not written)
        frame = recv_frame(*args)
        if frame.kind == KIND_BUCKET and not damaged:
            frame.wait()
            frame.segments[0][1].view(torch.uint8)[0] ^= 0x01
            damaged.append(True)
        return frame

    sync.patch.zstd_decompress = lambda data, raw: decompress(data[:data.numel() // 2], raw)   # half the blob
    sync.link.recv_frame = damaged_bucket
    try:
        assert syncer.apply(model, blocking=False) == 0
        dist.barrier()
        assert syncer.resync(model) == 2           # the background receive was refused: dropped like an update
    finally:
        sync.patch.zstd_decompress, sync.link.recv_frame = decompress, recv_frame
    assert syncer.apply(model) == 3
    return snapshot(model)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [WeightSyncConfig(type="patch", patch=PatchConfig(compression="zstd")),
                                 WeightSyncConfig(type="bucket", bucket=BucketConfig(load_instant=False))],
                         ids=["patch-zstd", "bucket-staged"])
def test_a_resync_drops_a_non_blocking_receive_that_was_refused(cfg):
    """A background receive refused as it arrived (a payload that does not decompress, a staged bucket that fails
    its checksums) was taken in whole and wrote nothing: the link is in step, so the resync the receiver calls
    instead of polling apply() must drop it like any queued update and recover, not raise the refusal it cures."""
    sender, receiver = run_ranks(_non_blocking_apply_refused_then_resync, 2, args=(cfg,), timeout=60)
    assert bits_equal(receiver, sender)


def _non_blocking_apply_loses_the_link(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"w": torch.zeros(100)}   # tiny: the frame's queued rest fits in the socket, so the sender returns
    if rank == 0:
        syncer.init_sender(state)
        dist.barrier()
        state["w"][[3, 50]] = 1.0
        syncer.sync(state, 1)
        return None
    syncer.init_receiver(state)
    damaged = []

    def version_flipped(header):
        if not damaged:
            header[2] += 1                         # the version word, flipped before the header's own check
            damaged.append(True)

    with damaged_receives("recv_then_count", version_flipped):
        assert syncer.apply(state, blocking=False) == 0
        dist.barrier()
        with pytest.raises(SyncIntegrityError) as error:
            syncer.resync(state)
    assert not state["w"].any() and syncer.version == 0
    # The rest of the frame (its one table row, refused before it was received, then one packed payload of 2 one-byte
    # gaps and 2 float32 values, then the trailer of 1 row checksum and its check), received here so that the
    # sender's sends complete.
    drain(0, torch.empty(1, 4, dtype=torch.int64), torch.empty(10, dtype=torch.uint8),
          torch.empty(2, dtype=torch.int64))
    return str(error.value), error.value.link_lost


@pytest.mark.slow
def test_a_resync_raises_the_lost_link_a_non_blocking_receive_met():
    """A background receive whose header was refused left the rest of its frame queued, which no resync can drain:
    resync() must raise that error (it says to make new syncers on a fresh group), not read on and take payload
    bytes for the next header."""
    _, (message, link_lost) = run_ranks(_non_blocking_apply_loses_the_link, 2, timeout=30)
    assert link_lost is True
    assert "failed its checksum (corrupted); the rest of this frame is still queued and cannot be drained" in message
    assert message.endswith("create both syncers again on a fresh process group")


def _non_blocking_apply_meets_a_resync_then_resync(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"w": torch.zeros(1000), "b": torch.zeros(5)}
    if rank == 0:
        syncer.init_sender(state)
        dist.barrier()
        for version in (1, 2):          # resync(1) meets the receiver's apply; the receiver's resync takes resync(2)
            state["w"] += 1
            syncer.resync(state, version)
        state["b"] += 3
        syncer.sync(state, 3)
        return snapshot(state)
    syncer.init_receiver(state)
    assert syncer.apply(state, blocking=False) == 0
    dist.barrier()                      # sent only now: this first call cannot have met the frame already
    try:
        refused = f"applied {syncer.apply(state)}"  # blocking: takes the background receive, which met resync(1)
    except RuntimeError as error:
        refused = f"{type(error).__name__}: {error}"   # a string: the error would keep the frame alive
    resynced = syncer.resync(state)
    return refused, resynced, syncer.apply(state), snapshot(state)


@pytest.mark.slow
def test_a_resync_does_not_take_again_a_background_receive_whose_error_apply_raised():
    """An apply() that already raised the background receive's refusal (here: the sender's resync met by the
    apply) handed that frame to the caller: the next resync must wait for the sender's next resync, not start
    from the refused frame again (it then restored the older weights and read the new resync as an update)."""
    sender, (refused, resynced, applied, received) = run_ranks(_non_blocking_apply_meets_a_resync_then_resync, 2,
                                                              timeout=30)
    assert refused == ("UnexpectedKind: weight sync: expected a message of kind 2, got kind 3; sender and receiver "
                       "disagree on which call comes next (sync/resync/apply)")
    assert (resynced, applied) == (2, 3)
    assert bits_equal(received, sender)
