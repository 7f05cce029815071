"""Checkpoints of earlier versions resumed on several ranks or another layout (2 ranks, rollout ranks, 1 rank): what
an old file holds that this version's own checkpoints never do, and how every rank that loads it takes it."""

import torch

from envs.tracking import Tracking


def _sum_counts(envs: list[Tracking]) -> None:
    """What dist.stats.sum_counts does on each of these ranks: the cross-rank sum of the local counts, committed."""
    summed = sum(env.sampler.local_counts for env in envs)
    for env in envs:
        env.sampler.commit_global(summed.clone())


def test_unsummed_sampler_counts_of_a_first_commit_checkpoint_count_once_on_any_number_of_ranks():
    """The first commit (a341c19, 2026-11-30) saved rank 0's sampler counts without the cross-rank sum before the
    save: global_counts 0, local_counts rank 0's episodes. Every rank (every rollout rank) loads the file; kept as
    local counts, the next sum counted them once per rank (a 2-rank resume doubled them). They count once."""
    local = torch.zeros(2, 8, dtype=torch.float64)
    local[0, :4], local[1, :2] = 3.0, 1.0           # visits, failures of rank 0's episodes since the last sum
    old = {"sampler": {"global_counts": torch.zeros(2, 8, dtype=torch.float64), "local_counts": local}}
    for ranks in (1, 2, 3):
        envs = [Tracking(16, "cpu", rank, base_seed=0, num_motions=8) for rank in range(ranks)]
        for env in envs:
            env.load_state_dict(old)
        probabilities = envs[0].sampler.probabilities()
        _sum_counts(envs)                           # no episode ended in between: nothing new to add
        for env in envs:
            assert env.sampler.global_counts.tolist() == local.tolist(), ranks
            torch.testing.assert_close(env.sampler.probabilities(), probabilities)
