"""Exact cross-rank statistics from sufficient statistics: small float64 all-reduces.

None of these gathers samples: ranks exchange counts, sums and sums of squared deviations from a
value every rank already shares (a running mean, or a global mean computed first), so the bytes are
O(dim), independent of batch size and world size (except reduce_metrics' maxima: 8 bytes per rank each), and
the result equals the statistic over the union of all ranks' samples (up to float64 summation order;
merge_moments also up to its shift's conditioning: see there).

Each function but the plan rows is a collective: every rank calls it, in the same order as the other collectives. One
called on some ranks only (reduce_metrics under `if rank == 0:` for a log line) pairs with whatever the others issue
next: global_mean_std's first all-reduce on rank 0 met rank 1's reduce_metrics of one key (2 numbers each), and rank 1
got 0.875 for a mean of 2.0, with no error; a collective of another length aborts a rank in gloo; and with nothing
issued elsewhere the rank waits out the process group's timeout (init_process_group(timeout=...); gloo's default:
30 min).

To copy this file into another project, take dist/comm.py and dist/plan.py with it (the imports are
relative, so the package may have any name), as for dist/grad_sync.py. The sums of global_mean_std,
reduce_metrics and sum_counts are staged on `comm.device()`: the current CUDA device under NCCL, else the host,
unless `comm.set_device` chose (train.py's dist.setup does); merge_moments reduces on its batch's own device.
"""

import torch

from . import comm
from .plan import PlanRow


def global_mean_std(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (population) std of `x` over all ranks' elements, exact even when |mean| >> std.

    Crosses ranks: two all-reduces per call (see `mean_std_plan_rows`), the runner calls it once per
    iteration for advantage normalization: (count, sum) in float64, then the sum of squared deviations
    from that global mean. Two passes cost one extra 8-byte message; one pass over (n, sum, sum of
    squares) loses about log10(mean^2 / var) of float64's 16 digits to cancellation. Over no element on any
    rank both are nan (0 / 0): nothing is read back to refuse it (the runner refuses such a batch at start-up).
    """
    x64 = x.detach().double().flatten()
    # The count filled in on the device: torch.tensor(count, device=...) copies from the host, a device sync on a GPU.
    first = torch.stack([x64.new_full((), float(x64.numel())), x64.sum()])
    count, total = comm.all_reduce(first.to(comm.device()), "advantages").to(x.device).unbind(0)
    mean = total / count
    m2 = comm.all_reduce((x64 - mean).square().sum().reshape(1).to(comm.device()), "advantages").to(x.device)[0]
    return mean.to(x.dtype), (m2 / count).sqrt().to(x.dtype)


def mean_std_plan_rows() -> list[PlanRow]:
    return [PlanRow("advantages", "global (n, sum), then dev^2", "all_reduce", "iteration", [16, 8])]


def merge_moments(count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor,
                  batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold `batch` [B, D] from every rank into running moments (count, mean [D], M2 [D]), all float64.

    Crosses ranks: one all-reduce of 1 + 2D float64 numbers per call (the runner: once per iteration
    per normalizer). Each rank sums its samples shifted by the current running mean (identical on all
    ranks, so the sums add up exactly and stay well conditioned); the global batch moments then merge
    with the running ones by Chan's parallel formula, which includes the between-group term
    delta^2 * n_a * n_b / n. Every rank computes the same result, so no broadcast follows.

    With `count` 0, `mean` is only that shift: zeros make the first merge plain sums of squares, which
    lose about log10(mean^2 / var) digits when |mean| >> std; pass a rough mean that every rank shares
    instead (ppo/normalizer.py's set_first_shift uses rank 0's first observations).

    A NaN or inf sample on any rank makes every rank's moments non-finite for good, and nothing here reads the
    sums back to the host to refuse it: check the batch first (train.py's check_finite names the step and env).
    Every rank must pass the same feature count D: with another D on one rank the all-reduce's sizes differ, and
    gloo aborts a rank while the others wait out the timeout.
    """
    shifted = batch.detach().to(torch.float64, copy=True).sub_(mean)   # one temporary, reused for the squares
    batch_count = shifted.new_full((1,), float(shifted.shape[0]))        # filled on the device (no host copy)
    batch_sum = shifted.sum(0)                                           # before the in-place square below
    local = torch.cat([batch_count, batch_sum, shifted.square_().sum(0)])
    summed = comm.all_reduce(local, "normalizer")
    dim = mean.numel()
    n_b, s1, s2 = summed[0], summed[1:1 + dim], summed[1 + dim:]
    # Clamped: counts are whole numbers, so only an empty batch (n_b = 0, sums 0) or none at all (n = 0) changes,
    # which now leaves the moments as they were instead of 0 / 0 = NaN.
    mean_b_shift = s1 / n_b.clamp(min=1.0)       # batch mean minus running mean
    # Never negative in exact arithmetic, but a (nearly) constant feature away from the shift cancels to a rounding
    # residue of either sign: a negative M2 made the std sqrt(M2 / n) nan until a later batch's spread outweighed it.
    m2_b = (s2 - s1 * mean_b_shift).clamp_(min=0.0)     # batch sum of squared deviations from its own mean
    n = count + n_b
    new_mean = mean + mean_b_shift * (n_b / n.clamp(min=1.0))
    new_m2 = m2 + m2_b + mean_b_shift.square() * count * n_b / n.clamp(min=1.0)
    return n, new_mean, new_m2


def merge_plan_row(dim: int, of: str) -> PlanRow:
    """The plan row of one merge_moments call per iteration over `dim` features of `of` (what is normalized)."""
    return PlanRow("normalizer", f"merge (n, mean, M2) of {of}", "all_reduce", "iteration", [(1 + 2 * dim) * 8])


def reduce_metrics(sums: dict[str, torch.Tensor], counts: dict[str, torch.Tensor],
                   maxima: dict[str, float] | None = None) -> dict[str, float]:
    """Count-weighted means over all ranks: key -> sum over ranks of sums[key] / sum of counts[key]; and for each
    key of `maxima` (this rank's value), the largest value over the ranks.

    Crosses ranks: one all-reduce of 2K + W*L float64 numbers (K = number of keys, L of maxima, W ranks), packed into
    one vector in sorted key order, once per log step. The maxima ride in the same sum: each rank writes its values
    into its own row of a [W, L] block and zeros elsewhere, so every summed entry is one rank's value, exactly. Every
    rank must pass the same keys, in `maxima` too (the order they were inserted in does not matter):
    a key a rank has nothing for must still be there, with count 0. A key missing on one rank is not counted as 0:
    the ranks' vectors then differ in length, and the all-reduce fails or sums one key's values into another's (where
    the keys may differ between ranks, check them first with dist/verify.py's same_names_everywhere: an int64 per rank).
    Keys with a zero total count are dropped (e.g. no episode finished anywhere). A NaN maximum on any rank is NaN.
    """
    keys, maxima = sorted(sums), maxima or {}
    if set(keys) & set(maxima):     # one name for two values: the max would replace the mean
        raise ValueError(f"reduce_metrics: {sorted(set(keys) & set(maxima))} are both means and maxima")
    if not keys and not maxima:
        return {}
    values = [v for k in keys for v in (sums[k], counts[k])]
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    slots = torch.zeros(comm.world_size(), len(maxima), dtype=torch.float64, device=device)
    slots[comm.rank()] = torch.tensor([float(maxima[k]) for k in sorted(maxima)], dtype=torch.float64)
    # Packed where the metrics live, then moved once: no per-key device copies (host syncs on GPU).
    packed = torch.cat([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(1) for v in values]
                       + [slots.view(-1)])
    packed = comm.all_reduce(packed.to(comm.device()), "metrics").tolist()   # the one host read
    sums, counts, rows = packed[0:len(values):2], packed[1:len(values):2], packed[len(values):]
    largest = {}
    for j, k in enumerate(sorted(maxima)):
        column = rows[j::len(maxima)]     # a NaN wins wherever it is (Python's max keeps or drops it by its place)
        largest[k] = float("nan") if any(v != v for v in column) else max(column)
    return {**{k: s / c for k, s, c in zip(keys, sums, counts) if c > 0}, **largest}


def metrics_plan_rows(num_keys: int, num_maxima: int = 0) -> list[PlanRow]:
    rule = "count-weighted mean" + (", max (a slot per rank)" if num_maxima else "")
    return [PlanRow("metrics", rule, "all_reduce", "iteration", [16 * num_keys + 8 * comm.world_size() * num_maxima])]


def sum_counts(sampler) -> None:
    """Sampler/curriculum counts: sum (not mean) of every rank's local counts, committed as the new global ones.

    Crosses ranks: one all-reduce of the counts (in their own dtype; float64 in envs/motions.py) every
    --dist.sampler-sync-every iterations and before every checkpoint; see `sum_counts_plan_rows`.
    """
    sampler.commit_global(comm.all_reduce(sampler.local_counts.clone().to(comm.device()), "sampler").to(
        sampler.local_counts.device))


def sum_counts_plan_rows(sampler, every: int, save_every: int) -> list[PlanRow]:
    if sampler is None:
        return []
    nbytes = [sampler.local_counts.numel() * sampler.local_counts.element_size()]
    return [PlanRow("sampler", "sum of counts", "all_reduce", "every", nbytes, every=every),
            PlanRow("sampler", "sum of counts before save", "all_reduce", "checkpoint", nbytes, every=save_every)]
