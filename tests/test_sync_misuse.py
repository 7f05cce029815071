"""sync/ used wrongly the ways a library user would (found by following docs/weight_sync.md from outside): each
mistake is one error naming it, on the side that made it, and the link stays usable where the docs say it does."""

import re

import pytest
import torch

from multirank import run_ranks
from sync import BucketConfig, PatchConfig, SyncIntegrityError, WeightSyncConfig, make_weight_syncer


# ----- before any rank is needed ---------------------------------------------------------------------------

def test_a_config_changed_after_construction_is_checked_again():
    """The dataclasses are mutable: `cfg.type = "nope"` was a bare KeyError, a bad field set later went unchecked."""
    cfg = WeightSyncConfig()
    cfg.type = "nope"
    with pytest.raises(ValueError, match=r"weight sync config: type='nope' is not one of 'patch', 'bucket'"):
        make_weight_syncer(cfg, src=0, dsts=[1])
    cfg = WeightSyncConfig(type="bucket")
    cfg.bucket.bucket_size = 0
    with pytest.raises(ValueError, match=r"bucket\.bucket_size must be a positive number of bytes, got 0"):
        make_weight_syncer(cfg, src=0, dsts=[1])


@pytest.mark.parametrize("src, dsts", [(0, 1), (0, "1"), (0, [1.0]), (0.0, [1]), (True, [1])])
def test_ranks_that_are_not_ranks_are_refused_by_name(src, dsts):
    """dsts=1 was "'int' object is not iterable" from inside the syncer."""
    with pytest.raises(TypeError, match=r"weight sync: src must be a rank and dsts a list of ranks, got "):
        make_weight_syncer(WeightSyncConfig(), src=src, dsts=dsts)


# ----- on two ranks ----------------------------------------------------------------------------------------

def _init_misuse(rank, world_size, kind):
    """Bad init arguments on the sender: both sides refuse at the handshake, with the same words."""
    said = []
    for keys, version in ((None, 1.5), ("w", 0)):
        syncer = make_weight_syncer(WeightSyncConfig(type=kind), src=0, dsts=[1])
        with pytest.raises(RuntimeError, match="call init_sender/init_receiver first"):
            syncer.plan_rows()          # was an AttributeError (_documents)
        state = {"w": torch.zeros(8), "b": torch.zeros(2)}
        with pytest.raises(ValueError) as caught:
            if rank == 0:
                syncer.init_sender(state, keys, version)
            else:
                syncer.init_receiver(state)
        said.append(str(caught.value))
    return said


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_a_version_or_keys_of_the_wrong_type_at_init_are_refused_on_both_sides(kind):
    """A float version went on the wire cut to an int; a string of keys was synced as its characters."""
    sender, receiver = run_ranks(_init_misuse, 2, (kind,), timeout=60)
    assert sender == receiver
    assert "version must be an integer, got 1.5" in sender[0]
    assert "keys must be a list of state_dict keys, got the string 'w'" in sender[1]
    assert "not in the sender's state_dict" not in sender[1]


def _per_call_misuse(rank, world_size, kind):
    cfg = WeightSyncConfig(type=kind, patch=PatchConfig(verify_every=0))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = {"w": torch.zeros(6, 4), "b": torch.zeros(4)}
    if rank == 0:
        syncer.init_sender(state)
        for bad in (1.2, None, "3", torch.tensor(1), True):    # refused before anything is sent
            with pytest.raises(TypeError, match=re.escape(f"weight sync: version must be an integer, got {bad!r}")):
                syncer.sync(state, bad)
        for version in (1, 2, 3):
            state["w"][0, version] = version
            syncer.sync(state, version)
        with pytest.raises(ValueError, match="the sender's resync needs the .integer. version to restart from, got 4.0"):
            syncer.resync(state, 4.0)
        state["w"][1, 1] = 7.0
        syncer.resync(state, 4)
        state["w"][2, 2] = 8.0
        syncer.sync(state, 5)
        return [], state["w"]
    syncer.init_receiver(state)
    said = []
    with pytest.raises(ValueError) as caught:    # refused before receiving: the update stays queued
        syncer.apply({"w": torch.zeros(4, 6).t(), "b": state["b"]})
    said.append(str(caught.value))
    assert syncer.apply(state) == 1
    stale = {k: v.clone() for k, v in state.items()}
    assert syncer.apply(state) == 2
    if kind == "patch":   # a copy from before patch 2: patch 3 would apply on top of it as if it held version 2
        with pytest.raises(SyncIntegrityError) as caught:
            syncer.apply(stale)
        said.append(str(caught.value))
        assert syncer.resync(state) == 4
        copy = {k: v.clone() for k, v in state.items()}       # other memory, the same values: taken
        assert syncer.apply(copy) == 5
        return said, copy["w"]
    assert syncer.apply(stale) == 3   # whole tensors: any memory is a valid target
    assert syncer.resync(state) == 4 and syncer.apply(state) == 5
    return said, state["w"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_wrong_versions_non_contiguous_receivers_and_stale_copies_are_refused(kind):
    (_, sent), (said, received) = run_ranks(_per_call_misuse, 2, (kind,), timeout=60)
    assert torch.equal(received, sent)
    assert said[0] == ("weight sync: receiver tensors ['w'] are not contiguous; pass the model's own tensors")
    if kind == "patch":
        assert said[1].startswith("weight sync: verification found ['w'] were given to apply() in other memory "
                                  "than the last patch wrote, and hold other values")
