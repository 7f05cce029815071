"""The replica checks train.py runs across ranks (--dist.verify-every, and once after a checkpoint load): they cover
the model's merged buffers and the reward normalizer beside it, not the parameters alone, and name the rank and the
tensors that differ. One rank's statistics are knocked off by a little (the next float, one more count)."""

import pytest
import torch

import train
from ppo.normalizer import ObsNormalizer, RewardNormalizer
from tests.multirank import run_ranks
from tests.test_replica_check_reward_stats import trained_or_error
from tests.test_train import small_tracking


def resumed_body(rank, world_size, root, resume, broken_rank):
    """A 2-iteration run with reward normalization, or its resume to 3 iterations; the periodic replica check off, so
    that only the check after the load runs. On `broken_rank` of the resume, the loaded return statistics (m2) and,
    after the start-up broadcast, the critic normalizer's count are off by a little. Returns the run's error message,
    or "trained"."""
    cfg = small_tracking(root, iterations=3 if resume else 2)
    cfg.ppo.normalize_rewards, cfg.dist.verify_every, cfg.dist.device = True, 0, "cpu"
    cfg.resume = "auto" if resume else ""
    if rank == broken_rank:
        load, broadcast = RewardNormalizer.load_state_dict, train.broadcast_module

        def broken_load(self, state, *args, **kwargs):
            loaded = load(self, state, *args, **kwargs)
            self.m2.copy_(torch.nextafter(self.m2, self.m2 + 1))
            return loaded

        def broken_broadcast(model):
            broadcast(model)
            model.critic_normalizer.count.add_(1)
        RewardNormalizer.load_state_dict, train.broadcast_module = broken_load, broken_broadcast
    return trained_or_error(cfg)


@pytest.mark.slow
def test_the_check_after_a_load_covers_merged_buffers_and_the_reward_statistics(tmp_path):
    """Mutants: the check after a checkpoint load without the model's buffer rules (parameters only), or without the
    reward normalizer beside the model. A rank whose merged statistics or return statistics differ after the load and
    the broadcast is named, with both tensors, before the first rollout."""
    assert run_ranks(resumed_body, 2, args=(str(tmp_path), False, None)) == ["trained", "trained"]
    for message in run_ranks(resumed_body, 2, args=(str(tmp_path), True, 1)):
        assert message.startswith("parameters after checkpoint load diverged across ranks: rank(s) [1] differ from "
                                  "rank(s) [0]"), message
        assert message.endswith("tensors that differ: ['critic_normalizer.count', 'RewardNormalizer.m2']"), message


def merged_stats_body(rank, world_size, root, broken_rank):
    """A 2-iteration run with the replica check every iteration; on `broken_rank`, every update of the observation
    normalizers (a merge over all ranks) is followed by one more count. Returns the run's error message, or
    "trained"."""
    if rank == broken_rank:
        merge = ObsNormalizer.update

        def broken_update(self, batch):
            merge(self, batch)
            self.count.add_(1)
        ObsNormalizer.update = broken_update
    cfg = small_tracking(root, iterations=2)
    cfg.dist.verify_every, cfg.dist.device = 1, "cpu"
    return trained_or_error(cfg)


@pytest.mark.slow
def test_the_periodic_check_covers_the_model_s_merged_buffers(tmp_path):
    """Mutant: --dist.verify-every checks parameters only, not the buffers the model's BUFFER_POLICY merges. A rank
    whose critic normalizer merged a different count is named with it after the first iteration."""
    assert run_ranks(merged_stats_body, 2, args=(str(tmp_path / "clean"), None)) == ["trained", "trained"]
    for message in run_ranks(merged_stats_body, 2, args=(str(tmp_path / "broken"), 1)):
        assert message.startswith("parameters diverged across ranks: rank(s) [1] differ from rank(s) [0]"), message
        assert message.endswith("tensors that differ: ['critic_normalizer.count']"), message
