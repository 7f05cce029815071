"""apply(model, blocking=False): a reader thread never sees a half-applied update or a version that is ahead
of (or behind) the weights in place; verify() on another thread never sees a resync half done."""

import threading

import pytest
import torch

from multirank import run_ranks
from sync import BucketConfig, SyncIntegrityError, WeightSyncConfig, make_weight_syncer
from test_sync_common import bits_equal, make_state, random_update, snapshot

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


def _verify_around_resyncs(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    if rank == 0:
        state, g = make_state(seed=0), torch.Generator().manual_seed(1)
        syncer.init_sender(state)
        for version in range(1, 6):
            random_update(state, g, 0.1)
            syncer.resync(state, version) if version in (2, 4) else syncer.sync(state, version)
        return snapshot(state)
    model = make_state(seed=7)
    syncer.init_receiver(model)
    syncer.lock = lock = _HookedLock()
    said = []

    def verify_on_another_thread():
        def run():
            try:
                syncer.verify(model)
                said.append(None)
            except SyncIntegrityError as error:
                said.append(str(error))
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()

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
