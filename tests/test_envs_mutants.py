"""Surviving mutants of envs/tracking.py killed by hand-checked boundary cases (the mutation pass of envs/, ppo/rollout,
ppo/restore, ppo/env_check and dist/stop)."""

import copy

import numpy as np
import torch

from envs import Tracking


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
