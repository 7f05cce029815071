"""Cross-rank statistics equal numpy over the union of all ranks' samples (unequal batch sizes), and the plan rows
of the metrics and sampler-count all-reduces; reduce_metrics matches keys by name, not by the order each rank
inserted them, and gives no entries for no keys."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dist import comm
from dist.plan import PlanRow
from dist.stats import (global_mean_std, merge_moments, metrics_plan_rows, reduce_metrics, sum_counts,
                        sum_counts_plan_rows)
from envs.motions import AdaptiveMotionSampler
from ppo.normalizer import ObsNormalizer
from tests.multirank import run_ranks

SIZES = [(7, 40), (3, 5), (11, 1)]          # per rank: (first iteration, second iteration) batch sizes


def rank_batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    # Different offsets per rank so the between-group variance matters.
    return [torch.randn(n, 4, generator=g, dtype=torch.float64) * (rank + 1) + 3.0 * rank for n in SIZES[rank]]


def normalizer_body(rank, world_size):
    norm = ObsNormalizer(4)
    for batch in rank_batches(rank):
        norm.update(batch.float())
    x = torch.cat(rank_batches(rank)).float()
    mean, std = global_mean_std(x)
    return {k: v.clone() for k, v in norm.state_dict().items()}, mean, std


@pytest.mark.slow
def test_normalizer_merge_and_global_mean_std_equal_numpy_over_the_union():
    results = run_ranks(normalizer_body, world_size=3)
    union = np.concatenate([b.float().double().numpy() for r in range(3) for b in rank_batches(r)])
    for state, mean, std in results:
        assert state["count"].item() == len(union)
        np.testing.assert_allclose(state["mean64"].numpy(), union.mean(0), rtol=1e-6)
        np.testing.assert_allclose((state["m2"] / state["count"]).numpy(), union.var(0), rtol=1e-6)
        np.testing.assert_allclose(mean.item(), union.mean(), rtol=1e-5)
        np.testing.assert_allclose(std.item(), union.std(), rtol=1e-5)
    for state, _, _ in results[1:]:   # every rank computed the same statistics, bit for bit
        for key in state:
            assert torch.equal(state[key], results[0][0][key])


def test_merge_moments_single_process_equals_numpy_over_sequential_batches():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, 3, generator=g, dtype=torch.float64) * 5 + 100 for n in (1, 17, 4)]
    count, mean, m2 = (torch.zeros((), dtype=torch.float64), torch.zeros(3, dtype=torch.float64),
                       torch.zeros(3, dtype=torch.float64))
    for b in batches:
        count, mean, m2 = merge_moments(count, mean, m2, b)
    union = torch.cat(batches).numpy()
    np.testing.assert_allclose(mean.numpy(), union.mean(0), rtol=1e-12)
    np.testing.assert_allclose((m2 / count).numpy(), union.var(0), rtol=1e-9)


def metrics_body(rank, world_size):
    sums = {"a": torch.tensor(float(rank + 1) * 10), "b": torch.tensor(0.0)}
    counts = {"a": torch.tensor(float(rank + 1)), "b": torch.tensor(0.0)}
    return reduce_metrics(sums, counts)


@pytest.mark.slow
def test_reduce_metrics_is_count_weighted_and_drops_empty_keys():
    for out in run_ranks(metrics_body, world_size=2):
        assert out == {"a": (10 + 20) / (1 + 2)}


def unequal_metrics_body(rank, world_size):
    # Per-rank means 2.5 and 30 over 4 and 3 samples: a count-weighted mean, a mean of the ranks' means and a
    # max all differ (the test above has equal per-rank means, so any averaging passes it).
    sums = {"x": torch.tensor([10.0, 90.0][rank]), "y": torch.tensor([0.0, 7.0][rank])}
    counts = {"x": torch.tensor([4.0, 3.0][rank]), "y": torch.tensor([0.0, 2.0][rank])}
    return reduce_metrics(sums, counts)


@pytest.mark.slow
def test_reduce_metrics_weights_each_rank_by_its_count():
    for out in run_ranks(unequal_metrics_body, world_size=2):
        assert out["x"] == pytest.approx((10.0 + 90.0) / (4 + 3), rel=1e-12)   # not (2.5 + 30) / 2, not 90 / 4
        assert out["y"] == pytest.approx(7.0 / 2, rel=1e-12)   # a key only rank 1 counted: rank 0 adds (0, 0)


def test_reduce_metrics_drops_a_key_of_zero_count_whatever_its_sum():
    """"Keys with a zero total count are dropped": by the count alone, also when the sum is not 0 (a sum of NaN-free
    junk with nothing counted is no mean; dividing by 0 must not be tried)."""
    out = reduce_metrics({"a": torch.tensor(3.0, dtype=torch.float64), "b": torch.tensor(5.0, dtype=torch.float64)},
                         {"a": torch.tensor(2.0, dtype=torch.float64), "b": torch.tensor(0.0, dtype=torch.float64)})
    assert out == {"a": 1.5}


def reordered_metrics_body(rank, world_size):
    """The same two keys inserted in opposite orders on the two ranks; "big" has a rank-0 sum of 2**24 + 1, which
    float64 holds and float32 does not (it rounds to 2**24)."""
    sums = {"big": torch.tensor(2.0**24 + 1, dtype=torch.float64), "small": torch.tensor(3.0)} if rank == 0 else \
        {"small": torch.tensor(5.0), "big": torch.tensor(2.0, dtype=torch.float64)}
    counts = {"big": torch.tensor(1.0), "small": torch.tensor(1.0)} if rank == 0 else \
        {"small": torch.tensor(3.0), "big": torch.tensor(1.0)}
    return reduce_metrics(sums, counts)


@pytest.mark.slow
def test_reduce_metrics_pairs_keys_by_name_not_insertion_order_and_sums_in_float64():
    """Each rank packs its keys in sorted order (the docstring: the insertion order does not matter), so rank 0's
    "big" adds to rank 1's "big" though rank 1 inserted "small" first; and the packed vector is float64, so a sum
    that float32 cannot hold stays exact: (2**24 + 1 + 2) / 2, not (2**24 + 2) / 2."""
    for out in run_ranks(reordered_metrics_body, world_size=2):
        assert out == {"big": (2.0**24 + 1 + 2.0) / (1 + 1), "small": (3.0 + 5.0) / (1 + 3)}


def maxima_body(rank, world_size):
    """Rank r's times: collection 1 + r (rank 2 the slowest), minus learning -(5 - r) (rank 2 waited least)."""
    comm.reset_ledger()
    out = reduce_metrics({"a": torch.tensor(float(rank))}, {"a": torch.tensor(1.0)},
                         {"slowest": 1.0 + rank, "-learning": -(5.0 - rank)})
    planned = metrics_plan_rows(1, num_maxima=2)[0]
    return out, comm.ledger_snapshot(), (planned.calls, sum(planned.call_bytes))


@pytest.mark.slow
def test_reduce_metrics_maxima_are_the_largest_value_over_ranks_in_the_same_all_reduce():
    """Declared op max beside the count-weighted means (mean of 0, 1, 2 = 1): each rank's value in its own slot, so
    the result is one rank's value exactly, negative ones too (a minimum as the max of minus it); one all-reduce of
    16 B per key + 8 B per rank per maximum, as the plan row says."""
    for out, ledger, planned in run_ranks(maxima_body, world_size=3):
        assert out == {"a": 1.0, "slowest": 3.0, "-learning": -3.0}
        assert ledger == {"metrics": (1, 16 + 8 * 3 * 2)} and ledger["metrics"] == planned


def nan_maxima_body(rank, world_size):
    """Maximum `nan_on_j` is NaN on rank j and the rank's number elsewhere; `finite` is the rank's number."""
    values = {f"nan_on_{j}": float("nan") if j == rank else float(rank) for j in range(world_size)}
    return reduce_metrics({}, {}, {**values, "finite": float(rank)})


@pytest.mark.slow
def test_a_nan_maximum_on_any_rank_is_nan_on_every_rank():
    """Python's max over the ranks' slots kept or dropped a NaN by its place: NaN on rank 0 gave nan, on rank 1 the
    max of the rest, on rank 2 the max of ranks 0-1 (rank 2's own value lost)."""
    for out in run_ranks(nan_maxima_body, world_size=3):
        assert out["finite"] == 2.0 and [math.isnan(out[f"nan_on_{j}"]) for j in range(3)] == [True] * 3


def test_reduce_metrics_maxima_of_one_process_are_its_own_values():
    assert reduce_metrics({}, {}, {"t": -2.5}) == {"t": -2.5} and reduce_metrics({}, {}, {}) == {}
    with pytest.raises(ValueError, match=r"^reduce_metrics: \['t'\] are both means and maxima$"):
        reduce_metrics({"t": torch.tensor(1.0)}, {"t": torch.tensor(1.0)}, {"t": 2.0})   # the max replaced the mean


def test_the_metrics_plan_row_says_max_only_when_there_are_maxima():
    """The printed plan describes the metrics all-reduce: count-weighted means alone, or with the maxima's slot per
    rank (one process: 8 bytes per maximum)."""
    assert metrics_plan_rows(3) == [PlanRow("metrics", "count-weighted mean", "all_reduce", "iteration", [48])]
    assert metrics_plan_rows(3, num_maxima=2) == [PlanRow("metrics", "count-weighted mean, max (a slot per rank)",
                                                          "all_reduce", "iteration", [48 + 16])]


def test_the_sampler_rows_plan_the_counts_in_their_own_dtype():
    """sum_counts all-reduces the counts in their own dtype (float64 in envs/motions.py; a curriculum may keep int32):
    6 int32 counts are 24 bytes a call, every 3 iterations and before each save (every 4)."""
    sampler = SimpleNamespace(local_counts=torch.zeros(2, 3, dtype=torch.int32))
    assert sum_counts_plan_rows(sampler, 3, 4) == [
        PlanRow("sampler", "sum of counts", "all_reduce", "every", [24], every=3),
        PlanRow("sampler", "sum of counts before save", "all_reduce", "checkpoint", [24], every=4)]
    assert sum_counts_plan_rows(None, 3, 4) == []


class ZeroLocalFirstSampler:
    """A sampler (envs/base.py's protocol: local_counts, commit_global(summed)) whose commit restarts its local counts
    before it folds the summed ones in, as a curriculum may: the summed counts must be a tensor of their own."""

    def __init__(self, local):
        self.local_counts = local.clone()
        self.global_counts = torch.zeros_like(local)

    def commit_global(self, summed):
        self.local_counts.zero_()
        self.global_counts += summed


def test_sum_counts_hands_the_sampler_summed_counts_that_do_not_alias_its_local_ones():
    """One process: the sum over ranks is this rank's own counts. A sampler zeroing its local counts first must
    still commit them, not the zeros an all-reduce done in place in local_counts would leave."""
    local = torch.tensor([[1.0, 0.0, 4.0], [0.0, 0.0, 2.0]], dtype=torch.float64)
    sampler = ZeroLocalFirstSampler(local)
    sum_counts(sampler)
    assert sampler.global_counts.tolist() == local.tolist()
    assert sampler.local_counts.tolist() == [[0.0] * 3] * 2


def overlapping_sampler_body(rank, world_size):
    s = AdaptiveMotionSampler(3, 0.2, "cpu")
    # Both ranks visit motion 0 (1 and 2 episodes, rank 1's both failed); only rank 0 visits motion 2.
    ids = torch.tensor([[0, 2, 2], [0, 0, 1]][rank])
    ended = torch.tensor([[True, True, False], [True, True, False]][rank])
    failed = torch.tensor([[False, True, True], [True, True, True]][rank])
    s.record(ids, ended, failed)
    sum_counts(s)
    return s.global_counts.clone()


@pytest.mark.slow
def test_sampler_counts_of_a_motion_both_ranks_visited_add_up():
    """sum_counts must add every rank's counts of the SAME motion (a max or a mean of them is wrong); the
    sampler test in test_sync_contract has each rank visit a different motion, where max == sum."""
    visits = [1 + 2, 0, 1]             # motion 0: 1 on rank 0 + 2 on rank 1; motion 2: rank 0's one ended episode
    failures = [0 + 2, 0, 1]
    for counts in run_ranks(overlapping_sampler_body, world_size=2):
        assert counts.tolist() == [[float(v) for v in visits], [float(f) for f in failures]]


@pytest.mark.parametrize("offset, scale", [(1e6, 1.0), (5.0, 1e-6)])
def test_first_merge_and_global_std_stay_exact_when_the_mean_dominates(offset, scale):
    g = torch.Generator().manual_seed(0)
    x = (offset + scale * torch.randn(4096, 2, generator=g, dtype=torch.float64)).float()
    reference = x.double().numpy().std(0)                 # numpy float64 over the same float32 values

    def first_merge_std(shift: bool) -> np.ndarray:
        norm = ObsNormalizer(2)
        if shift:
            norm.set_first_shift(x[:64])                 # what the runner does with the reset observations
        norm.update(x)
        return (norm.m2 / norm.count).sqrt().numpy()

    assert np.allclose(first_merge_std(shift=True), reference, rtol=1e-9, atol=0)
    assert not np.allclose(first_merge_std(shift=False), reference, rtol=1e-6, atol=0)   # the old first merge

    x64 = x.double()[:, 0]
    mean, std = global_mean_std(x64)
    assert abs(std.item() - reference[0]) <= 1e-9 * reference[0]
    assert abs(mean.item() - x64.numpy().mean()) <= 1e-12 * abs(offset)
    one_pass = (x64.square().mean() - x64.mean().square()).clamp_min(0).sqrt().item()   # (n, sum, sum sq)
    assert abs(one_pass - reference[0]) > 1e-6 * reference[0]


def test_both_normalizers_merge_into_their_own_buffers_so_an_earlier_state_dict_stays_live():
    """A state_dict() taken before update() holds the buffer tensors themselves; the merge writes into them, so it
    reads the merged statistics: numpy's count, mean and sum of squared deviations over the two batches."""
    from ppo.normalizer import ObsNormalizer, RewardNormalizer
    rng = np.random.default_rng(3)
    first, second = rng.normal(2.0, 3.0, (5, 2)), rng.normal(-1.0, 0.5, (7, 2))
    obs = ObsNormalizer(2)
    held = obs.state_dict()
    for batch in (first, second):
        obs.update(torch.from_numpy(batch))
    union = np.concatenate([first, second])
    assert held["count"].item() == 12
    np.testing.assert_allclose(held["mean64"].numpy(), union.mean(0), rtol=1e-12)
    np.testing.assert_allclose(held["m2"].numpy(), ((union - union.mean(0)) ** 2).sum(0), rtol=1e-12)
    rewards = RewardNormalizer(num_envs=2, gamma=0.5, clip=10.0)
    held = rewards.state_dict()
    rewards(torch.tensor([1.0, 2.0]), torch.tensor([False, True]))
    rewards(torch.tensor([4.0, 8.0]), torch.tensor([False, False]))
    rewards.update()
    returns = np.array([1.0, 2.0, 0.5 * 1.0 + 4.0, 8.0])  # env 1's return restarts after its episode ended
    assert held["count"].item() == 4
    np.testing.assert_allclose(held["m2"].numpy(), [((returns - returns.mean()) ** 2).sum()], rtol=1e-12)
    np.testing.assert_allclose(held["std"].numpy(), returns.std(), rtol=1e-6)


def reward_normalizer_body(rank, world_size):
    """Rank r has 2 + r envs and 3 steps of rewards; every rank's returns merge into the statistics."""
    from dist import comm
    from ppo.normalizer import RewardNormalizer
    rewards, dones = reward_stream(rank)
    rn = RewardNormalizer(num_envs=rewards.shape[1], gamma=0.9, clip=10.0)
    for r, d in zip(rewards, dones):
        rn(r, d)
    comm.reset_ledger()
    rn.update()
    ledger = comm.ledger_snapshot()
    planned = {row.purpose: (row.calls, sum(row.call_bytes)) for row in rn.plan_rows()}
    return rn.count.item(), rn.std.item(), ledger, planned


def reward_stream(rank):
    g = torch.Generator().manual_seed(40 + rank)
    rewards = torch.rand(3, 2 + rank, generator=g) * (rank + 1) + 2.0 * rank
    dones = torch.zeros(3, 2 + rank, dtype=torch.bool)
    dones[1, 0] = True
    return rewards, dones


@pytest.mark.slow
def test_reward_normalizer_merges_every_ranks_returns_in_the_one_all_reduce_its_plan_row_declares():
    """Equivalence principle for the reward scale: after update() every rank's std is numpy's population std over the
    discounted returns of all ranks' envs (written out per env below, restarting after a done), and the merge's
    traffic is what its plan row says: one all-reduce of (count, sum, sum of squares), 3 float64."""
    returns = []
    for rank in range(2):
        rewards, dones = (t.double().numpy() for t in reward_stream(rank))
        carried = np.zeros(rewards.shape[1])
        for t in range(rewards.shape[0]):
            carried = 0.9 * carried + rewards[t]
            returns += list(carried)
            carried = np.where(dones[t], 0.0, carried)
    for count, std, ledger, planned in run_ranks(reward_normalizer_body, world_size=2):
        assert count == len(returns) == 3 * (2 + 3)
        assert std == pytest.approx(np.std(returns), rel=1e-6)
        assert planned == {"normalizer": (1, 3 * 8)}
        assert ledger == {"normalizer": planned["normalizer"]}


def test_the_sums_are_staged_on_the_device_collectives_need(monkeypatch):
    """Under NCCL the all-reduced sums must be on the GPU (NCCL refuses host tensors) though sampler counts and
    metric sums may live on the host. On a CPU machine the meta device stands for it: every all-reduce of
    global_mean_std, reduce_metrics and sum_counts is handed a tensor on comm.device(), whatever the inputs' device
    (the stand-in all-reduce answers ones on the host, as the real one would after the copy back)."""
    from dist import comm
    seen = []

    def all_reduce(tensor, purpose, async_op=False):
        seen.append((purpose, tensor.device.type))
        return torch.ones(tensor.shape, dtype=tensor.dtype)

    monkeypatch.setattr(comm, "_DEVICE", torch.device("meta"))
    monkeypatch.setattr(comm, "all_reduce", all_reduce)
    global_mean_std(torch.tensor([1.0, 2.0, 4.0]))
    reduce_metrics({"a": torch.tensor(3.0)}, {"a": torch.tensor(1.0)})
    sum_counts(ZeroLocalFirstSampler(torch.ones(2, 3, dtype=torch.float64)))
    assert seen == [("advantages", "meta"), ("advantages", "meta"), ("metrics", "meta"), ("sampler", "meta")]


def test_statistics_of_a_tensor_that_requires_grad_are_values_without_autograd_history():
    """Advantages or observations still attached to a graph give plain statistics: a normalizer's running moments
    (or an advantage mean) that required grad would keep every iteration's graph alive and let the loss backpropagate
    into the statistics. Values as numpy's over the same numbers."""
    x = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    values = x.detach().numpy()
    mean, std = global_mean_std(x)
    count, running_mean, m2 = merge_moments(torch.zeros((), dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
                                            torch.zeros(2, dtype=torch.float64), x)
    assert not any(t.requires_grad for t in (mean, std, count, running_mean, m2))
    np.testing.assert_allclose([mean.item(), std.item()], [values.mean(), values.std()], rtol=1e-12)
    np.testing.assert_allclose(m2.numpy(), ((values - values.mean(0)) ** 2).sum(0), rtol=1e-12)


def metrics_in_rank_order(rank, world_size):
    # Rank 1 builds its dicts in the other order: the keys must still meet their own key on rank 0.
    order = ["a", "b"] if rank == 0 else ["b", "a"]
    sums = {"a": [1.0, 5.0], "b": [100.0, 300.0]}
    counts = {"a": [1.0, 3.0], "b": [10.0, 10.0]}
    return reduce_metrics({k: torch.tensor(sums[k][rank]) for k in order},
                          {k: torch.tensor(counts[k][rank]) for k in order})


@pytest.mark.slow
def test_reduce_metrics_matches_keys_by_name_whatever_order_each_rank_built_them_in():
    for out in run_ranks(metrics_in_rank_order, 2):
        assert out == {"a": pytest.approx((1.0 + 5.0) / (1 + 3), rel=1e-12),
                       "b": pytest.approx((100.0 + 300.0) / (10 + 10), rel=1e-12)}


def test_reduce_metrics_of_no_keys_is_an_empty_dict():
    """Nothing to log (no metric registered): no entries, not an error from stacking an empty list."""
    assert reduce_metrics({}, {}) == {}


def test_reduce_metrics_packs_the_metrics_where_they_live_python_numbers_included(monkeypatch):
    """Metrics on the GPU are packed there and moved once: no per-key copy to the host (a host sync each); a count
    given as a Python number joins them. The meta device stands for the GPU: a metric copied to the host fails
    there (no data), and the stand-in all-reduce is handed one packed vector (sums, counts, the maximum's slot).
    Mutant: the packing device taken from the first value that is not a tensor (`if not isinstance(v, ...)`)."""
    seen = []

    def all_reduce(tensor, purpose, async_op=False):
        seen.append((purpose, tensor.device.type, tuple(tensor.shape)))
        return torch.tensor([6.0, 3.0, 4.0, 2.0, 1.5], dtype=tensor.dtype)

    monkeypatch.setattr(comm, "_DEVICE", torch.device("meta"))
    monkeypatch.setattr(comm, "all_reduce", all_reduce)
    meta = torch.device("meta")
    out = reduce_metrics({"a": torch.tensor(6.0, device=meta), "b": torch.tensor(4.0, device=meta)},
                         {"a": 3, "b": torch.tensor(2.0, device=meta)}, {"m": 1.5})
    assert seen == [("metrics", "meta", (5,))] and out == {"a": 2.0, "b": 2.0, "m": 1.5}
