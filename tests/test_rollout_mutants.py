"""rollout_ranks.py: mutants the other rollout tests let survive without gloo processes (hand-picked mutation testing
of rollout_ranks.py and rollout_weights.py). A learner's team is built in this process with its receives faked, as
tests/test_train_rollout_ranks.py does."""

from types import SimpleNamespace

import pytest
import torch

import rollout_ranks
from dist.errors import RunError
from tests.test_rollout_close_rules import cartpole

SPEC = {"obs_dims": {"policy": 4, "critic": 4}, "num_actions": 1, "num_envs": 4, "log_keys": (), "layout": None,
        "state_bytes": 8}


@pytest.mark.parametrize("key, other", [("num_envs", 6), ("obs_dims", {"policy": 4, "critic": 5}),
                                        ("num_actions", 2), ("log_keys", ("x",))])
def test_a_learner_refuses_a_second_rollout_rank_whose_env_differs_in_any_agreed_field(monkeypatch, key, other):
    """Rollout ranks 1 and 2 of one team send their specs; rank 2's differs from rank 1's in one field only: the
    learner names rank 2 before it builds a receiver (another number of envs would make its receive layout wrong).
    Mutant: "num_envs" left out of the fields compared in LearnerTeam.__init__."""
    specs = {1: SPEC, 2: {**SPEC, key: other}}
    monkeypatch.setattr(rollout_ranks, "recv_object", lambda src, group, purpose: (specs[src], 10))
    monkeypatch.setattr(rollout_ranks, "BatchReceiver", lambda *args: pytest.fail("a receiver was built"))
    monkeypatch.setattr(rollout_ranks, "WeightServer", lambda *args: None)
    roles = SimpleNamespace(rank=0, team=[0, 1, 2], batches_group=None, weights_group=None)
    with pytest.raises(RunError, match=r"^rollout rank 2 built a different env than rollout rank 1$"):
        rollout_ranks.LearnerTeam(cartpole(3, "async", 2), roles, torch.device("cpu"), 0)
