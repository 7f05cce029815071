"""Rank-local rollout storage [T, N, ...] and the minibatch generator over whole trajectories."""

from collections.abc import Iterator

import torch


class RolloutStorage:
    """Fixed-size buffers for one iteration. `add` writes step t; the update reads whole trajectories."""

    def __init__(self, num_steps: int, num_envs: int, obs_dims: dict[str, int], num_actions: int,
                 device: torch.device):
        T, N = num_steps, num_envs
        self.num_steps, self.num_envs, self.step = T, N, 0
        z = lambda *shape: torch.zeros(T, N, *shape, device=device)  # noqa: E731
        self.actor_obs, self.critic_obs = z(obs_dims["policy"]), z(obs_dims["critic"])
        self.actions, self.action_mean, self.action_std = z(num_actions), z(num_actions), z(num_actions)
        self.log_probs, self.rewards, self.values = z(), z(), z()
        self.dones = torch.zeros(T, N, dtype=torch.bool, device=device)
        self.advantages, self.returns = z(), z()

    def add(self, actor_obs, critic_obs, actions, action_mean, action_std, log_probs, rewards, values, dones):
        if self.step >= self.num_steps:
            raise RuntimeError("rollout storage is full: call clear() at the start of each iteration")
        t = self.step
        for name, value in zip(("actor_obs", "critic_obs", "actions", "action_mean", "action_std", "log_probs",
                                "rewards", "values", "dones"),
                               (actor_obs, critic_obs, actions, action_mean, action_std, log_probs, rewards,
                                values, dones)):
            getattr(self, name)[t] = value
        self.step += 1

    def clear(self) -> None:
        self.step = 0

    FIELDS = ("actor_obs", "critic_obs", "actions", "action_mean", "action_std", "log_probs", "values",
              "advantages", "returns")

    def minibatches(self, num_mini_batches: int, generator: torch.Generator | None = None,
                    unit: str = "trajectory") -> Iterator[dict[str, torch.Tensor]]:
        """One epoch: a fresh permutation split into `num_mini_batches` equal minibatches.

        unit "trajectory": permute the N envs; each minibatch holds N / M whole trajectories (all T
        steps, in time order), as flat [T * N / M, ...] tensors. unit "transition": permute all T * N
        transitions. Either way every sample appears exactly once per epoch. No communication: each
        rank shuffles its own data with its own generator.
        """
        count = self.num_envs if unit == "trajectory" else self.num_envs * self.num_steps
        if count % num_mini_batches:
            raise ValueError(f"{count} {unit}s per rank are not divisible by num_mini_batches ({num_mini_batches})")
        size = count // num_mini_batches
        perm = torch.randperm(count, generator=generator, device="cpu").to(self.rewards.device)
        for i in range(num_mini_batches):
            ids = perm[i * size:(i + 1) * size]
            if unit == "trajectory":
                yield {f: getattr(self, f)[:, ids].flatten(0, 1) for f in self.FIELDS}
            else:
                yield {f: getattr(self, f).flatten(0, 1)[ids] for f in self.FIELDS}
