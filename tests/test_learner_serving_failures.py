"""A learner's weight-serving threads and their failures (rollout_ranks.py, rollout_weights.py), without a process
group: the learner raises the failure of the rank whose batch did not come, not the first of any thread, and a
serving thread keeps its failure under its rollout rank."""

import atexit
from types import SimpleNamespace

import pytest
import torch

import rollout_weights
from dist import comm
from dist.batches import naming
from rollout_ranks import LearnerTeam
from rollout_weights import WeightServer
from sync import WeightSyncConfig
from tests.test_rollout_weights import GUARD_S, learner


def test_the_learner_raises_the_serving_failure_of_the_rank_whose_batch_did_not_come(monkeypatch):
    """Rollout rank 2 stalled: the learner's wait for its batch fails, named. A failure of the thread serving rank 1
    (a healthy rank that timed out waiting for the learner) is not the cause and is not raised; rank 2's own
    thread's failure is.

    Mutant: self.weights.check() (the first failure of any thread) in LearnerTeam.receive."""
    monkeypatch.setattr(rollout_weights, "make_weight_syncer", lambda cfg, rank, dsts, group: None)
    team = LearnerTeam.__new__(LearnerTeam)
    team.weights = WeightServer(WeightSyncConfig(type="bucket"), 0, [1, 2], None, 1.0)

    def take():
        with naming(2):
            raise comm.CollectiveError("wait for 'batches' failed on rank 0: timed out")
    team.receiver = SimpleNamespace(take=take)
    healthy, own = comm.CollectiveError("rank 1's request timed out"), comm.CollectiveError("rank 2's send failed")
    team.weights.failures = {1: healthy}
    with pytest.raises(comm.CollectiveError) as exc:
        team.receive(0)
    assert str(exc.value) == "rollout rank 2 died or stalled: wait for 'batches' failed on rank 0: timed out"
    team.weights.failures = {1: healthy, 2: own}
    with pytest.raises(comm.CollectiveError) as exc:
        team.receive(0)
    assert exc.value is own


def test_a_serving_thread_keeps_its_failure_under_its_rollout_rank(monkeypatch):
    """check(dst) finds the failure of the thread serving `dst` only if the thread keeps it under `dst`.

    Mutant: self.failures.setdefault(-1, exc) in serve."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    link, model, server = learner(monkeypatch)
    try:
        server.start(model, 0)
        link.requests.put(comm.CollectiveError("recv for 'weight_request' failed on rank 0: injected"))
        server.threads[0].join(GUARD_S)
        assert not server.threads[0].is_alive()
        server.check(2)                                # no thread of rank 2 failed: nothing to raise
        with pytest.raises(comm.CollectiveError) as exc:
            server.check(1)
        assert str(exc.value) == "rollout rank 1 died or stalled: recv for 'weight_request' failed on rank 0: injected"
        assert list(server.failures) == [1]
    finally:
        atexit.unregister(server.abandon)
