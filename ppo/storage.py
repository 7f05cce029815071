"""Rank-local rollout storage [T, N, ...] and the minibatch generator (whole trajectories or single transitions).

Every field a minibatch reads is a column block of ONE packed float buffer [T, N, F], so drawing a
minibatch is a single `index_select` (one pass over the bytes) instead of one gather per field; the
fields are views into it. Rewards and dones, which only GAE reads, live in their own tensors.
"""

from collections.abc import Iterator

import torch


def split_fields(packed: torch.Tensor, widths: dict[str, int]) -> dict[str, torch.Tensor]:
    """Views of every field in `packed` [..., F], laid out by `widths` (RolloutStorage.widths): each field a
    column block at the same offset in whatever buffer is split (the storage, a minibatch, a graph's input)."""
    views, start = {}, 0
    for name, width in widths.items():
        views[name] = packed[..., start] if width == 0 else packed[..., start:start + width]
        start += max(width, 1)
    return views


def field_widths(obs_dims: dict[str, int], num_actions: int) -> dict[str, int]:
    """Width of each packed field; 0 marks a scalar per transition (a [T, N] view, not [T, N, 1])."""
    return {"actor_obs": obs_dims["policy"], "critic_obs": obs_dims["critic"], "actions": num_actions,
            "action_mean": num_actions, "action_std": num_actions, "log_probs": 0, "values": 0, "advantages": 0,
            "returns": 0}


def packed_width(widths: dict[str, int]) -> int:
    """Columns of the packed buffer: a scalar field (width 0) takes one."""
    return sum(max(w, 1) for w in widths.values())


def storage_bytes(num_steps: int, num_envs: int, obs_dims: dict[str, int], num_actions: int) -> int:
    """Bytes a RolloutStorage of these sizes allocates: the packed float32 buffer, rewards (float32), dones (bool)."""
    return num_steps * num_envs * (4 * packed_width(field_widths(obs_dims, num_actions)) + 4 + 1)


class _Column:
    """A named column block of the packed buffer. Reading gives a view; assigning copies into the view,
    so `storage.advantages = compute(...)` keeps the packing (rebinding would silently detach it)."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, storage, owner=None):
        return self if storage is None else storage.columns[self.name]

    def __set__(self, storage, value):
        storage.columns[self.name].copy_(value)


class RolloutStorage:
    """Fixed-size buffers for one iteration. fill_storage (ppo/rollout.py) writes a whole batch; the update reads
    minibatches (`minibatches`)."""

    actor_obs, critic_obs, actions, action_mean, action_std = _Column(), _Column(), _Column(), _Column(), _Column()
    log_probs, values, advantages, returns = _Column(), _Column(), _Column(), _Column()

    def __init__(self, num_steps: int, num_envs: int, obs_dims: dict[str, int], num_actions: int,
                 device: torch.device):
        T, N = num_steps, num_envs
        self.num_steps, self.num_envs = T, N
        self.widths = field_widths(obs_dims, num_actions)
        self.data = torch.zeros(T, N, packed_width(self.widths), device=device)
        self.columns = self.split(self.data)
        self.rewards = torch.zeros(T, N, device=device)
        self.dones = torch.zeros(T, N, dtype=torch.bool, device=device)

    def split(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of every field in `packed` [..., F] (the storage buffer, or a gathered minibatch)."""
        return split_fields(packed, self.widths)

    def minibatches(self, num_mini_batches: int, generator: torch.Generator | None = None,
                    unit: str = "trajectory") -> Iterator[torch.Tensor]:
        """One epoch: a fresh permutation split into `num_mini_batches` equal minibatches.

        unit "trajectory": permute the N envs; each minibatch holds N / M whole trajectories (all T
        steps, in time order), as flat [T * N / M, ...] tensors. unit "transition": permute all T * N
        transitions. Either way every sample appears exactly once per epoch. No communication: each
        rank shuffles its own data with its own generator. Each minibatch is one freshly gathered packed
        [T * N / M, F] tensor (contiguous); `split(minibatch)` gives its fields as views into it. The packed
        tensor is what a CUDA graph of the step takes as its input, in one copy (ppo/minibatch_step.py).
        """
        if unit not in ("trajectory", "transition"):
            raise ValueError(f"minibatch unit must be 'trajectory' or 'transition', got {unit!r}")
        if isinstance(num_mini_batches, bool) or not isinstance(num_mini_batches, int) or num_mini_batches < 1:
            raise ValueError(f"num_mini_batches must be an integer >= 1, got {num_mini_batches!r}")
        count = self.num_envs if unit == "trajectory" else self.num_envs * self.num_steps
        if count % num_mini_batches:
            what = "trajectories (envs)" if unit == "trajectory" else "transitions"
            raise ValueError(f"{count} {what} per rank are not divisible by num_mini_batches ({num_mini_batches})")
        size = count // num_mini_batches
        perm = torch.randperm(count, generator=generator, device="cpu")
        if self.data.is_cuda:   # pinned, so the copy is queued: from pageable memory it waits for the GPU to drain
            perm = perm.pin_memory()
        perm = perm.to(self.data.device, non_blocking=self.data.is_cuda)
        for i in range(num_mini_batches):
            ids = perm[i * size:(i + 1) * size]
            if unit == "trajectory":
                packed = self.data.index_select(1, ids).flatten(0, 1)
            else:
                packed = self.data.flatten(0, 1).index_select(0, ids)
            yield packed
