"""Running mean/variance observation normalizer whose statistics change only when told to.

Buffers (count, mean, M2 in float64; mean/std float32 copies for the forward pass). Sync rule `merge`:
`update(batch)` folds this iteration's observations of *all ranks* into the statistics by an exact
count-weighted merge (dist.stats.merge_moments). Between updates the statistics are frozen, so the
values computed during the rollout and during learning see the same normalization.

Copying this file out takes dist/stats.py, dist/comm.py and dist/plan.py along, in a package named `dist`.
"""

import torch
from torch import nn

from dist.plan import PlanRow
from dist.stats import merge_moments, merge_plan_row


class ObsNormalizer(nn.Module):
    # CleanRL's epsilon and clip (ppo/export.py reads both), but added to the std as RSL-RL does (its eps is 1e-2),
    # not under CleanRL's square root: a feature that was constant so far (std 0) scales a later deviation d to
    # d / 1e-8, clipped at 10 (CleanRL's sqrt(0 + 1e-8) gives d / 1e-4).
    eps, clip = 1e-8, 10.0

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean64", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("m2", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mean) / (self.std + self.eps)).clamp(-self.clip, self.clip)

    @torch.no_grad()
    def set_first_shift(self, observations: torch.Tensor) -> None:
        """Before the first merge, shift the merge's sums by the mean of `observations` [B, dim].

        Every merge sums samples minus the running mean; before any data that mean is 0, so the first
        merge would be plain sums of squares, which lose digits when |mean| >> std (1e6 + N(0, 1)). The
        runner calls this with the reset observations before the start-up parameter broadcast, which
        then gives every rank rank 0's shift: no extra communication. The forward pass is unchanged.
        """
        if self.count.item() == 0:
            self.mean64.copy_(observations.detach().double().mean(0))

    @torch.no_grad()
    def update(self, batch: torch.Tensor) -> None:
        """Merge `batch` [B, dim] of every rank into the statistics.

        Crosses ranks: one all-reduce of 1 + 2*dim float64 values (see merge_moments); call once per
        iteration, at the same point on every rank.
        """
        merged = merge_moments(self.count, self.mean64, self.m2, batch)
        for buffer, value in zip((self.count, self.mean64, self.m2), merged):
            buffer.copy_(value)        # in place: a state_dict() taken earlier holds these tensors, and stays live
        # No sample on any rank yet (empty batches): keep the identity forward, not the shift and 0 / 0. On the device
        # (torch.where), as everywhere in the merges: no host read.
        seen = self.count > 0
        self.mean.copy_(torch.where(seen, self.mean64, self.mean.double()))
        self.std.copy_(torch.where(seen, (self.m2 / self.count.clamp(min=1.0)).sqrt(), self.std.double()))

    def plan_rows(self, of: str) -> list[PlanRow]:
        return [merge_plan_row(self.mean.numel(), of)]


class RewardNormalizer(nn.Module):
    """Scales rewards by the running std of the discounted return, like CleanRL's NormalizeReward, then
    clips them to [-clip, clip] (CleanRL's TransformReward clip at 10).

    Buffers: `returns` [N] is each env's running discounted return (sync rule `local`: it follows this
    rank's envs); count/mean64/m2/std are the return statistics (rule `merge`). The statistics are
    frozen while an iteration collects and learns; `update()` then merges the returns this iteration
    produced on every rank (one all-reduce of 3 float64).
    """

    BUFFER_POLICY = {"returns": "local", "count": "merge", "mean64": "merge", "m2": "merge", "std": "merge"}

    eps = 1e-8                # CleanRL's NormalizeReward epsilon, added to the std (CleanRL: under the root)

    def __init__(self, num_envs: int, gamma: float, clip: float):
        super().__init__()
        self.gamma, self.clip = gamma, clip
        self.register_buffer("returns", torch.zeros(num_envs))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean64", torch.zeros(1, dtype=torch.float64))
        self.register_buffer("m2", torch.zeros(1, dtype=torch.float64))
        self.register_buffer("std", torch.ones(()))
        self._seen: list[torch.Tensor] = []

    @torch.no_grad()
    def forward(self, reward: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """Record the discounted return after this step and return the scaled, clipped reward. `done` [N]: any
        dtype, nonzero where the episode ended (its return restarts at 0)."""
        self.returns.mul_(self.gamma).add_(reward)
        self._seen.append(self.returns.clone())
        self.returns.mul_(done.logical_not())  # not ~done: on integers that is -1 - done
        return (reward / (self.std + self.eps)).clamp(-self.clip, self.clip)

    @torch.no_grad()
    def update(self) -> None:
        """Merge this iteration's returns of every rank into the statistics.

        Crosses ranks: one all-reduce of 3 float64 values (see merge_moments); call once per iteration,
        at the same point on every rank.
        """
        # A rank that stepped no env since the last update still joins the all-reduce, with an empty batch.
        seen = torch.cat(self._seen)[:, None] if self._seen else self.returns.new_zeros(0, 1)
        self._seen.clear()
        merged = merge_moments(self.count, self.mean64, self.m2, seen)
        for buffer, value in zip((self.count, self.mean64, self.m2), merged):
            buffer.copy_(value)
        self.std.copy_(torch.where(self.count > 0, (self.m2[0] / self.count.clamp(min=1.0)).sqrt(), self.std.double()))

    def plan_rows(self) -> list[PlanRow]:
        return [merge_plan_row(1, "returns")]
