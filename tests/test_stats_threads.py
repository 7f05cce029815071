"""dist/stats.py over W simulated ranks in one process: each rank a thread, and the dist.comm functions stats calls
(rank, world_size, all_reduce) replaced by tests/thread_ranks.py's fake, whose all-reduce sums every thread's tensor and
writes the sum back into each thread's tensor in place, as torch.distributed.all_reduce(op=SUM) does. The checks of
tests/test_stats_merge.py run gloo processes (slow, so `make test-fast` skips them); these run in milliseconds.
Expected values are numpy's over the concatenated per-rank data, or written out by hand."""

import math

import numpy as np
import pytest
import torch

from dist import comm
from dist.stats import global_mean_std, merge_moments, reduce_metrics
from tests.thread_ranks import run_threads


def test_the_fake_all_reduce_sums_every_ranks_tensor_in_place_in_its_dtype(monkeypatch):
    """The fake itself: each rank's own tensor object holds the sum afterwards (int64 stays int64), the call returns
    it, and a rank whose tensor has another length makes every rank fail instead of hanging.
    Mutant (of the fake): the sum returned as a new tensor (`return total`), the rank's own tensor left as it was."""
    def body(rank):
        mine = torch.tensor([rank, 10 * rank], dtype=torch.int64)
        return mine, comm.all_reduce(mine, "test"), comm.rank(), comm.world_size()

    for rank, (mine, returned, seen_rank, size) in enumerate(run_threads(monkeypatch, 3, body)):
        assert returned is mine and mine.dtype == torch.int64 and mine.tolist() == [0 + 1 + 2, 0 + 10 + 20]
        assert (seen_rank, size) == (rank, 3)
    with pytest.raises(AssertionError, match="ranks' tensors differ"):
        run_threads(monkeypatch, 2, lambda rank: comm.all_reduce(torch.zeros(1 + rank), "test"))


# Per rank: (size, offset, scale); unequal sizes, so a rank's own count is not the global one, and offsets apart so
# the between-rank spread is most of the variance.
ADVANTAGES = [(2, 0.0, 1.0), (5, 4.0, 2.0), (9, -3.0, 0.5)]


def rank_advantages(rank: int) -> torch.Tensor:
    n, offset, scale = ADVANTAGES[rank]
    return torch.randn(n, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64) * scale + offset


def test_global_mean_std_over_ranks_of_unequal_sizes_is_numpy_over_their_union(monkeypatch):
    """Every rank gets numpy's mean and population std over all 16 elements of the 3 ranks (2, 5 and 9 of them),
    bit for bit the same on every rank.
    Mutant: `mean = total / count` -> `total / x64.numel()` (the local count) in global_mean_std."""
    union = np.concatenate([rank_advantages(r).numpy() for r in range(3)])
    results = run_threads(monkeypatch, 3, lambda rank: global_mean_std(rank_advantages(rank)))
    for mean, std in results:
        assert mean.dtype == std.dtype == torch.float64
        np.testing.assert_allclose([mean.item(), std.item()], [union.mean(), union.std()], rtol=1e-12)
        assert (mean.item(), std.item()) == (results[0][0].item(), results[0][1].item())


def rank_observations(rank: int) -> list[torch.Tensor]:
    """Two iterations' batches [B, 3] of a rank: sizes (4, 1), (1, 6) and (7, 3), rank r centred near 5r."""
    g = torch.Generator().manual_seed(20 + rank)
    return [torch.randn(n, 3, generator=g, dtype=torch.float64) * (1 + rank) + 5.0 * rank
            for n in [(4, 1), (1, 6), (7, 3)][rank]]


def test_merge_moments_over_ranks_of_unequal_batches_is_numpy_over_their_union(monkeypatch):
    """Two merges on 3 ranks, starting from count 0 and a shift every rank shares: after each, every rank holds
    numpy's count, mean and sum of squared deviations over all ranks' batches so far (12 rows, then 22).
    Mutant: `s1 / n_b.clamp(min=1.0)` -> `s1 / batch_count.clamp(min=1.0)` (the local batch count) in merge_moments."""
    def body(rank):
        count, mean = torch.zeros((), dtype=torch.float64), torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
        m2, states = torch.zeros(3, dtype=torch.float64), []
        for batch in rank_observations(rank):
            count, mean, m2 = merge_moments(count, mean, m2, batch)
            states.append((count.clone(), mean.clone(), m2.clone()))
        return states

    results = run_threads(monkeypatch, 3, body)
    for step in range(2):
        union = np.concatenate([rank_observations(r)[i].numpy() for i in range(step + 1) for r in range(3)])
        assert len(union) == [12, 22][step]
        for states in results:
            count, mean, m2 = states[step]
            assert count.item() == len(union)
            np.testing.assert_allclose(mean.numpy(), union.mean(0), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(m2.numpy(), ((union - union.mean(0)) ** 2).sum(0), rtol=1e-10)
            assert all(torch.equal(a, b) for a, b in zip(states[step], results[0][step]))


def test_reduce_metrics_maxima_are_one_ranks_value_not_the_sum_of_all_ranks(monkeypatch):
    """Each rank writes its maxima into its own slot, so the result is the largest rank's value exactly: the
    slowest collection 1 + 2 = 3 (not 1 + 2 + 3 = 6), minus learning -(5 - 2) = -3 (not -12, and not the 0 of an
    empty slot), beside a count-weighted mean (0 + 10 + 40) / (1 + 2 + 4).
    Mutant: `slots[comm.rank()]` -> `slots[0]` in reduce_metrics (every rank writes into rank 0's slot)."""
    def body(rank):
        return reduce_metrics({"a": torch.tensor([0.0, 10.0, 40.0][rank])}, {"a": torch.tensor(float(2 ** rank))},
                              {"slowest": 1.0 + rank, "-learning": -(5.0 - rank)})

    for out in run_threads(monkeypatch, 3, body):
        assert out == {"a": pytest.approx(50.0 / 7, rel=1e-12), "slowest": 3.0, "-learning": -3.0}


@pytest.mark.parametrize("world_size, num_maxima", [(3, 2), (2, 3), (3, 4)])
def test_reduce_metrics_takes_each_maximum_from_its_own_column_of_the_rank_slots(monkeypatch, world_size,
                                                                                  num_maxima):
    """The slots are a [W, L] block, rank-major: maximum j is column j, every L-th entry from j. Maximum j is
    100 * j + (the rank's place in a rotation), so each maximum's largest value comes from another rank and no
    other entry of the block is its answer: 100 * j + W - 1. W != L, so a stride of W is wrong too.
    Mutant: the column stride `rows[j::len(maxima)]` changed (e.g. to W, L + 1, or a contiguous run of W)."""
    def body(rank):
        return reduce_metrics({}, {}, {f"m{j}": 100.0 * j + (rank + j) % world_size for j in range(num_maxima)})

    for out in run_threads(monkeypatch, world_size, body):
        assert out == {f"m{j}": 100.0 * j + world_size - 1 for j in range(num_maxima)}


def test_a_nan_maximum_on_any_rank_is_nan_on_every_rank_also_in_one_process(monkeypatch):
    """Maximum `nan_on_j` is NaN on rank j and the rank's number elsewhere: NaN on every rank for each j. Python's
    max over the slots keeps a NaN only in first place: NaN on rank 1 or 2 gave the max of the others' numbers.
    Mutant: the NaN check dropped in reduce_metrics (`largest[k] = max(column)`)."""
    def body(rank):
        values = {f"nan_on_{j}": float("nan") if j == rank else float(rank) for j in range(3)}
        return reduce_metrics({}, {}, {**values, "finite": float(rank)})

    for out in run_threads(monkeypatch, 3, body):
        assert out["finite"] == 2.0 and [math.isnan(out[f"nan_on_{j}"]) for j in range(3)] == [True] * 3
