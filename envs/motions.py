"""Procedural reference motions and the adaptive motion sampler of the tracking task.

`MotionLibrary`: each motion is, per joint, a bias plus a sum of sinusoids with its own duration and
difficulty (frequency and amplitude). Frames are evaluated analytically, so any time t is exact and
the library costs 464 bytes a motion with 6 joints (`bytes_per_motion`: 29 KiB for the preset's 64). It is
generated from the *base* seed so every rank has the same motions and sampler counts refer to the same thing
on every rank.

`AdaptiveMotionSampler`: SONIC-style adaptive sampling. Per motion it counts episodes that ended
(visits: counted at the end, so a checkpoint holds no half-run episode) and those of them that ended in a tracking
failure (failures). The sampling probability mixes a uniform floor with each motion's share of the total
failure rate:

    rate_m = (failures_m + 1) / (visits_m + 2)          # Laplace-smoothed failure rate
    p_m    = floor / M + (1 - floor) * rate_m / sum(rate)

Counts are kept in two parts: `global_counts` (the sum over all ranks at the last sampler sync) and
`local_counts` (this rank's episodes since then). Probabilities use their sum, so between syncs a
rank adapts to its own failures on top of the shared picture. The cross-rank sum lives in dist/.
"""

import math

import torch


class MotionLibrary:
    num_sines = 3

    def __init__(self, num_motions: int, num_joints: int, seed: int, device: torch.device):
        g = torch.Generator().manual_seed(seed)
        shape = (num_motions, num_joints, self.num_sines)
        self.difficulty = torch.rand(num_motions, generator=g)                       # 0 easy .. 1 hard
        max_freq = 0.2 + 0.8 * self.difficulty                                        # Hz
        max_amp = 0.2 + 0.5 * self.difficulty                                         # rad per joint
        self.freq = (0.1 + torch.rand(shape, generator=g) * max_freq[:, None, None] * 0.9)
        self.amp = torch.rand(shape, generator=g) * (max_amp[:, None, None] / self.num_sines)
        self.phase = torch.rand(shape, generator=g) * 2 * math.pi
        self.bias = (torch.rand(num_motions, num_joints, generator=g) - 0.5) * 0.4
        self.duration = 4.0 + 8.0 * torch.rand(num_motions, generator=g)            # seconds
        for name in ("difficulty", "freq", "amp", "phase", "bias", "duration"):
            setattr(self, name, getattr(self, name).to(device))
        # Angular frequency, amplitude and phase stacked, so that a frame gathers one table, not four.
        self.sines = torch.stack([2 * math.pi * self.freq, self.amp, self.phase])   # [3, M, J, S]

    @classmethod
    def bytes_per_motion(cls, num_joints: int) -> int:
        """What one motion of the tensors __init__ keeps costs (float32): difficulty and duration [M], bias [M, J],
        freq, amp and phase [M, J, S] and their stack `sines` [3, M, J, S]; its temporaries come on top."""
        return 4 * (2 + num_joints + 6 * num_joints * cls.num_sines)

    def frame(self, motion_ids: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint positions and velocities [..., num_joints] of motions `motion_ids` at times `t` (seconds).

        `t` may carry extra trailing dims (e.g. [N, F] for F future frames); `motion_ids` is [N].
        """
        extra = t.dim() - 1
        idx = motion_ids.view(-1, *([1] * extra))
        w, amp, phase = self.sines[:, idx]                                   # each [N, (F,) J, S]
        arg = w * t[..., None, None] + phase
        q = self.bias[idx] + sum_sines(amp * torch.sin(arg))
        qd = sum_sines(amp * w * torch.cos(arg))
        return q, qd


def sum_sines(terms: torch.Tensor) -> torch.Tensor:
    """`terms.sum(-1)` over the library's 3 sines, bit for bit (torch adds 3 values in this order; not 5 to 7),
    but ~3x faster: torch's reduction over a last dimension of 3 costs more than two elementwise adds."""
    first, second, third = terms.unbind(-1)
    return first + second + third


class AdaptiveMotionSampler:
    def __init__(self, num_motions: int, uniform_floor: float, device: torch.device):
        self.uniform_floor = uniform_floor
        self.global_counts = torch.zeros(2, num_motions, dtype=torch.float64, device=device)  # visits, failures
        self.local_counts = torch.zeros_like(self.global_counts)

    @staticmethod
    def bytes_per_motion() -> int:
        """What one motion of the counts costs: global_counts and local_counts, each [2, M] float64."""
        return 2 * 2 * 8

    def probabilities(self) -> torch.Tensor:
        visits, failures = self.global_counts + self.local_counts
        rate = (failures + 1) / (visits + 2)
        num_motions = rate.numel()
        return self.uniform_floor / num_motions + (1 - self.uniform_floor) * rate / rate.sum()

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.multinomial(self.probabilities().float(), n, replacement=True, generator=generator)

    def record(self, motion_ids: torch.Tensor, ended: torch.Tensor, failed: torch.Tensor) -> None:
        """Count the episodes that just ended (`ended` mask) and which of them failed."""
        self.local_counts[0].index_add_(0, motion_ids, ended.double())
        self.local_counts[1].index_add_(0, motion_ids, (ended & failed).double())

    def commit_global(self, summed_local: torch.Tensor) -> None:
        """Fold the cross-rank sum of every rank's local counts into the global counts; restart local."""
        self.global_counts += summed_local
        self.local_counts.zero_()

    def state_dict(self) -> dict:
        # Copies: the counts grow in place, and .cpu() of a host tensor would hand out the live one
        return {"global_counts": self.global_counts.to("cpu", copy=True),
                "local_counts": self.local_counts.to("cpu", copy=True)}

    def load_state_dict(self, state: dict) -> None:
        for key in ("global_counts", "local_counts"):
            if state[key].shape != self.global_counts.shape:
                raise ValueError(f"sampler {key} has shape {tuple(state[key].shape)}, expected "
                                 f"{tuple(self.global_counts.shape)}: "
                                 "was the checkpoint made with another --env.num-motions?")
        # Saved local counts are one rank's episodes not yet in the cross-rank sum (versions before 1e8f1c5,
        # 2026-11-30, saved rank 0's unsummed; this one sums before every save, so they are 0). Every rank (every
        # rollout rank) loads the same file: kept local, they would be summed once per rank at the next sync.
        # Folded into the global counts, they count once on any layout, with the same probabilities.
        self.global_counts = (state["global_counts"] + state["local_counts"]).to(self.global_counts, copy=True)
        self.local_counts = torch.zeros_like(self.global_counts)
