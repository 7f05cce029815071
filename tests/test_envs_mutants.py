"""Surviving mutants of envs/tracking.py and envs/motions.py killed by hand-checked cases (the mutation pass of envs/,
ppo/rollout, ppo/restore, ppo/env_check and dist/stop)."""

import copy

import numpy as np
import pytest
import torch

from envs import Tracking
from envs.motions import AdaptiveMotionSampler


def one_env_off_its_reference():
    """A one-env tracking task near the start of motion 0, its joints 0.05 rad off the reference, at step 0 of its
    episode (no time-out is near: the limit is 500 steps and every clip lasts at least 4 s)."""
    env = Tracking(1, torch.device("cpu"), seed=3, base_seed=5)
    env.reset()
    env.motion_ids = torch.tensor([0])
    env.motion_time = torch.tensor([0.5])
    ref_q, ref_qd = env.motions.frame(env.motion_ids, env.motion_time)
    env.q, env.qd = ref_q + 0.05, ref_qd.clone()
    env.episode_length = torch.zeros(1, dtype=torch.long)
    return env


def test_a_body_error_exactly_at_fail_distance_is_not_a_failure_and_one_ulp_above_it_is():
    """The docstring: "Terminated when the mean body position error *exceeds* `fail_distance`". A one-env step's logged
    Episode/body_error is that env's error e exactly (the mean of one value); the same step from a copy of the state
    with fail_distance = e neither terminates nor truncates, and with fail_distance one float32 ulp below e it
    terminates (and is not a time-out).

    Mutant: tracking.py `terminated = body_err >= self.fail_distance` (for `>`)."""
    env = one_env_off_its_reference()
    at, below = copy.deepcopy(env), copy.deepcopy(env)
    action = torch.full((1, 6), 0.3)
    _, _, terminated, _, extras = env.step(action.clone())
    error = extras["log"]["Episode/body_error"]
    assert error.dtype == torch.float32 and 0.0 < float(error) < Tracking.fail_distance and not terminated.item()
    at.fail_distance = float(error)
    _, _, terminated, truncated, extras = at.step(action.clone())
    assert extras["log"]["Episode/body_error"].item() == float(error)              # the same step, bit for bit
    assert not terminated.item() and not truncated.item()
    below.fail_distance = float(np.nextafter(np.float32(error), np.float32(0)))
    _, _, terminated, truncated, _ = below.step(action.clone())
    assert terminated.item() and not truncated.item()


def test_a_sampler_that_loads_a_checkpoint_forgets_the_episodes_it_counted_before():
    """A loaded sampler's counts are the checkpoint's only: its saved local counts folded into the global ones and
    nothing of what this sampler recorded before the load (3 failed episodes of motion 0, not yet committed) left to
    add at the next sync. Saved: global visits [4, 2], failures [1, 2]; local visits [1, 0], failures [1, 0]. Loaded:
    visits [5, 2], failures [2, 2], so rates 3/7 and 3/4 (sum 33/28), shares 4/11 and 7/11, and with a 0.2 floor over
    2 motions p = 0.1 + 0.8 * share = [0.1 + 3.2/11, 0.1 + 5.6/11].

    Mutant: motions.py load_state_dict without `self.local_counts = torch.zeros_like(self.global_counts)`."""
    sampler = AdaptiveMotionSampler(2, 0.2, torch.device("cpu"))
    ended = torch.ones(3, dtype=torch.bool)
    sampler.record(torch.zeros(3, dtype=torch.long), ended, ended)
    saved = {"global_counts": torch.tensor([[4.0, 2.0], [1.0, 2.0]], dtype=torch.float64),
             "local_counts": torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)}
    sampler.load_state_dict(saved)
    assert sampler.local_counts.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert sampler.global_counts.tolist() == [[5.0, 2.0], [2.0, 2.0]]
    assert sampler.probabilities().tolist() == pytest.approx([0.1 + 3.2 / 11, 0.1 + 5.6 / 11], rel=1e-12)
