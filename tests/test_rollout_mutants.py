"""rollout_ranks.py: mutants the other rollout tests let survive without gloo processes (hand-picked mutation testing
of rollout_ranks.py and rollout_weights.py). A learner's team is built in this process with its receives faked, as
tests/test_train_rollout_ranks.py does."""

from types import SimpleNamespace

import pytest
import torch

import rollout_ranks
from dist.errors import RunError
from tests.test_rollout_close_rules import ScriptedLearner, cartpole, run_against, tracking

SPEC = {"obs_dims": {"policy": 4, "critic": 4}, "num_actions": 1, "num_envs": 4, "log_keys": (), "layout": None,
        "state_layout": {"rng/torch": ((8,), torch.uint8)}, "state_bytes": 8}


@pytest.mark.parametrize("key, other", [("num_envs", 6), ("obs_dims", {"policy": 4, "critic": 5}),
                                        ("num_actions", 2), ("log_keys", ("x",)),
                                        ("state_layout", {"rng/torch": ((8,), torch.int8)})])
def test_a_learner_refuses_a_second_rollout_rank_whose_env_differs_in_any_agreed_field(monkeypatch, key, other):
    """Rollout ranks 1 and 2 of one team send their specs; rank 2's differs from rank 1's in one field only: the
    learner names rank 2 before it builds a receiver (another number of envs would make its receive layout wrong;
    another checkpoint-state layout, of the same bytes, would be unpacked with rank 1's at the first save).
    Mutant: "num_envs" (or "state_layout") left out of the fields compared in LearnerTeam.__init__."""
    specs = {1: SPEC, 2: {**SPEC, key: other}}
    monkeypatch.setattr(rollout_ranks, "recv_object", lambda src, group, purpose: (specs[src], 10))
    monkeypatch.setattr(rollout_ranks, "BatchReceiver", lambda *args: pytest.fail("a receiver was built"))
    monkeypatch.setattr(rollout_ranks, "WeightServer", lambda *args: None)
    roles = SimpleNamespace(rank=0, team=[0, 1, 2], batches_group=None, weights_group=None)
    with pytest.raises(RunError, match=r"^rollout rank 2 built a different env than rollout rank 1$"):
        rollout_ranks.LearnerTeam(cartpole(3, "async", 2), roles, torch.device("cpu"), 0)


@pytest.mark.parametrize("mode, staleness", [("sync", 1), ("async", 1)])
def test_a_save_commits_the_sampler_visits_of_every_iteration_up_to_the_saved_one(monkeypatch, mode, staleness):
    """The tracking env's motion sampler, summed only at saves (every 2 iterations, 6 in all): the sum in the save
    of iteration i must hold the episode visits of batches 0..i, every one collected and nothing past i (async
    S = 1: batch i + 1 may be collected before decision i is read; its visits stay local, summed at the next save).
    The visits per batch are read from the sampler around each collection, independently of rollout_ranks.py's own
    bookkeeping. Mutant: `counted.pop(decided - 1, None)` in read_decision (the saved iteration's own visits held
    back from its checkpoint)."""
    cfg = tracking(6, staleness)
    cfg.rollout.mode, cfg.log.save_every, cfg.dist.sampler_sync_every = mode, 2, 1000
    per_batch, committed, collect, summed = [], [], rollout_ranks.collect_rollout, rollout_ranks.sum_counts

    def counted(copy, env, *args, **kwargs):
        before = env.sampler.local_counts[0].sum().item()
        out = collect(copy, env, *args, **kwargs)
        per_batch.append(env.sampler.local_counts[0].sum().item() - before)
        return out

    def recorded(sampler):
        summed(sampler)
        committed.append(sampler.global_counts[0].sum().item())

    monkeypatch.setattr(rollout_ranks, "collect_rollout", counted)
    monkeypatch.setattr(rollout_ranks, "sum_counts", recorded)
    learner = ScriptedLearner(0, 6, 1 if mode == "sync" else staleness + 1, save_every=2)
    run_against(learner, cfg, monkeypatch)
    assert learner.done and learner.states == {1, 3, 5} and len(per_batch) == 6
    assert per_batch[1] > 0 and per_batch[3] > 0      # the saved batches end episodes: a held-back one would show
    assert committed == [sum(per_batch[:2]), sum(per_batch[:4]), sum(per_batch)]


class Recording(ScriptedLearner):
    """The scripted learner, keeping every batch's metric counts and dones as sent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent = []

    def send(self, tensors):
        self.sent.append((tensors["counts"].clone(), tensors["dones"].clone()))
        super().send(tensors)


def test_each_batch_carries_the_episode_counts_of_its_own_collection_only(monkeypatch):
    """Cartpole, 8 iterations of 4 steps x 4 envs: a batch's count of ended episodes (the count of
    Train/mean_episode_length, TRAIN_KEYS[1]) is exactly its own dones' sum, not a running total since the start
    (episodes end in several batches, so a total would exceed it). Mutant: `stats.start_iteration()` dropped before
    a collection in run_rollout_rank."""
    learner = Recording(0, 8, 1, save_every=100)
    run_against(learner, cartpole(8, "sync", 1, save_every=100), monkeypatch)
    assert learner.done and len(learner.sent) == 8
    ended = [int(dones.sum()) for _, dones in learner.sent]
    assert sum(e > 0 for e in ended[:-1]) >= 1, ended      # an episode ends before the last batch
    assert [int(counts[1]) for counts, _ in learner.sent] == ended
