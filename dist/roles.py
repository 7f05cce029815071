"""Learner and rollout roles: which rank does what, and the process groups each pair of roles talks in.

With `--rollout.ranks K` out of W ranks, ranks 0..L-1 (L = W - K) learn and ranks L..W-1 collect.
Learner l owns the K/L rollout ranks L + l*K/L ... L + (l+1)*K/L - 1 (its "team"). Rollout rank number
j = rank - L plays the part colocated rank j would (its seeds), so with K = L the split reproduces the
colocated run.

Groups (created by every rank, in the same order, once at start-up):
- `learners`: the learners' collectives (gradients, normalizers, metrics, ...); rollout ranks never join;
- `rollouts`: the rollout ranks' own collective (the sampler counts summed across all of them);
- per team, `batches` (trajectories up, stop/save decisions down, checkpoint state up) and `weights`
  (sync/'s point-to-point traffic, a group of its own so it never interleaves with the batches).
"""

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as torch_dist


@dataclass
class Roles:
    rank: int
    world_size: int
    num_learners: int
    num_rollouts: int                 # 0 = colocated: every rank collects and learns
    learner_group: object = None
    rollout_group: object = None
    batches_group: object = None      # this rank's team
    weights_group: object = None
    team: list[int] = field(default_factory=list)   # this rank's learner first, then its rollout ranks

    @property
    def colocated(self) -> bool:
        return self.num_rollouts == 0

    @property
    def is_learner(self) -> bool:
        return self.colocated or self.rank < self.num_learners

    @property
    def per_learner(self) -> int:
        return self.num_rollouts // self.num_learners if self.num_rollouts else 0

    @property
    def rollout_index(self) -> int:
        """j for rollout rank L + j: the colocated rank whose seeds it uses."""
        return self.rank - self.num_learners

    def describe(self) -> str:
        if self.colocated:
            return f"{self.world_size} colocated rank(s): each collects and learns"
        teams = "; ".join(f"learner {l} <- rollout ranks {self.team_of(l)[1:]}" for l in range(self.num_learners))
        return f"{self.num_learners} learner(s) + {self.num_rollouts} rollout rank(s): {teams}"

    def team_of(self, learner: int) -> list[int]:
        first = self.num_learners + learner * self.per_learner
        return [learner, *range(first, first + self.per_learner)]


def assign_roles(rank: int, world_size: int, num_rollouts: int, timeout_s: float | None = None) -> Roles:
    """The roles, with their process groups when rollout ranks exist. `timeout_s`: how long a message or
    collective in those groups waits for a peer (--dist.timeout-s; a new group does not inherit the world's,
    it would wait torch's default of 30 minutes).

    Crosses ranks: new_group is collective over all ranks: 2 + 2L groups created once at start-up.
    """
    roles = Roles(rank, world_size, world_size - num_rollouts, num_rollouts)
    if roles.colocated:
        return roles
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)

    def new_group(ranks: list[int]):
        return torch_dist.new_group(ranks, timeout=timeout)
    roles.learner_group = new_group(list(range(roles.num_learners)))
    roles.rollout_group = new_group(list(range(roles.num_learners, world_size)))
    for learner in range(roles.num_learners):
        team = roles.team_of(learner)
        batches, weights = new_group(team), new_group(team)
        if rank in team:
            roles.team, roles.batches_group, roles.weights_group = team, batches, weights
    return roles
