"""apply(model, blocking=False): a reader thread never sees a half-applied update or a version that is ahead
of (or behind) the weights in place."""

import threading

import pytest
import torch

from multirank import run_ranks
from sync import BucketConfig, WeightSyncConfig, make_weight_syncer

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
