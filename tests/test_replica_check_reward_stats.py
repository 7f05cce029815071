"""The replica check (--dist.verify-every) covers the reward normalizer's merged return statistics, which live beside
the model rather than in it: a rank whose merge went wrong is named with the statistics that differ."""

import pytest
import torch

import train
from ppo.normalizer import RewardNormalizer
from tests.multirank import run_ranks
from tests.test_train import small_tracking


def reward_stats_body(rank, world_size, root, broken_rank):
    """A 2-iteration run with reward normalization and the replica check every iteration; on `broken_rank`, every
    merge of the return statistics is followed by a one-ulp change of m2. Returns the run's error
    message, or "trained" and this rank's merged statistics."""
    if rank == broken_rank:
        merge = RewardNormalizer.update

        def broken_update(self):
            merge(self)
            self.m2.copy_(torch.nextafter(self.m2, self.m2 + 1))
        RewardNormalizer.update = broken_update
    cfg = small_tracking(root, iterations=2)
    cfg.ppo.normalize_rewards, cfg.dist.verify_every, cfg.dist.device = True, 1, "cpu"
    return trained_or_error(cfg)


def trained_or_error(cfg) -> str:
    """Train `cfg` on this rank: "trained", or the message of the RuntimeError it stopped with."""
    try:
        train.main(cfg)
    except RuntimeError as exc:
        return str(exc)
    return "trained"


@pytest.mark.slow
def test_a_rank_whose_reward_statistics_diverged_is_named_with_them(tmp_path):
    clean = run_ranks(reward_stats_body, 2, args=(str(tmp_path / "clean"), None))
    assert clean == ["trained", "trained"]          # merged alike on both ranks: the check passes every iteration
    for message in run_ranks(reward_stats_body, 2, args=(str(tmp_path / "broken"), 1)):
        assert message.startswith("parameters diverged across ranks: rank(s) [1] differ from rank(s) [0]"), message
        assert message.endswith("tensors that differ: ['RewardNormalizer.m2']"), message
