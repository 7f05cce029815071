"""Gaps a second mutation audit of train.py found (the lines changed since the first, tests/test_train_mutation_gaps.py):
each test here fails on a plausible change of train.py that every other test let through. Expected values come from
the docs and by hand, never from the code under test.

Pinned here: the replica check after a checkpoint load covering the model's merged buffers and the reward normalizer
beside it (both, after the start-up broadcast); the periodic check covering the merged buffers; every rank logging the
least waiting update (the reduced learning time), not its own clock's.
"""

import pytest
import torch

import train
from configs import preset
from ppo.normalizer import ObsNormalizer, RewardNormalizer
from tests.multirank import run_ranks
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
    try:
        train.main(cfg)
    except RuntimeError as exc:
        return str(exc)
    return "trained"


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
    try:
        train.main(cfg)
    except RuntimeError as exc:
        return str(exc)
    return "trained"


@pytest.mark.slow
def test_the_periodic_check_covers_the_model_s_merged_buffers(tmp_path):
    """Mutant: --dist.verify-every checks parameters only, not the buffers the model's BUFFER_POLICY merges. A rank
    whose critic normalizer merged a different count is named with it after the first iteration."""
    assert run_ranks(merged_stats_body, 2, args=(str(tmp_path / "clean"), None)) == ["trained", "trained"]
    for message in run_ranks(merged_stats_body, 2, args=(str(tmp_path / "broken"), 1)):
        assert message.startswith("parameters diverged across ranks: rank(s) [1] differ from rank(s) [0]"), message
        assert message.endswith("tensors that differ: ['critic_normalizer.count']"), message


def slow_update_body(rank, world_size, root):
    """Rank 1's clock reads its updates 1000 s long (train.finished shifted on its update ends only)."""
    import itertools
    import time
    calls = itertools.count()
    if rank == 1:
        train.finished = lambda device: time.time() + (1000.0 if next(calls) % 2 == 1 else 0.0)
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 8, 8, 2
    cfg.log.root, cfg.dist.device = root, "cpu"
    return train.main(cfg)[1]


@pytest.mark.slow
def test_every_rank_logs_the_least_waiting_update_not_its_own(tmp_path):
    """Mutant: the learning time read from this rank's clock instead of the reduced one (the minimum over ranks). Rank
    1's updates read 1000 s long; every rank logs rank 0's (real, under a minute) and total_fps uses it."""
    logged = run_ranks(slow_update_body, 2, args=(str(tmp_path),))
    for scalars in logged:
        assert 0.0 < scalars["Perf/learning_time"] < 60
        assert scalars["Perf/total_fps"] == 2 * 8 * 8 / (scalars["Perf/collection_time"] + scalars["Perf/learning_time"])
    assert logged[0]["Perf/learning_time"] == logged[1]["Perf/learning_time"]
