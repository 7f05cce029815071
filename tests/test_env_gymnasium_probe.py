"""The gymnasium adapter's build-time probe step (envs/gymnasium.py check_reset_and_step): the action it takes is
the one nearest 0 inside the action space's bounds, so an env that checks its actions accepts the probe."""

import gymnasium
import numpy as np
import pytest
import torch

from envs.gymnasium import GymnasiumEnv

pytestmark = pytest.mark.filterwarnings("ignore:.*is out of date:DeprecationWarning")


class StrictBounds(gymnasium.Env):
    """Refuses any action outside its action space, as a simulator with hard joint limits would."""
    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,))
    action_space = gymnasium.spaces.Box(np.array([0.5, -2.0, -1.0], dtype=np.float32),
                                        np.array([2.0, -0.25, 1.0], dtype=np.float32))
    received: list = []

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        if not self.action_space.contains(np.asarray(action, dtype=np.float32)):
            raise AssertionError(f"action {action} outside {self.action_space}")
        self.received.append(np.array(action))
        return np.zeros(2, dtype=np.float32), 0.0, False, False, {}


def test_the_probe_step_takes_the_action_nearest_zero_inside_bounds_that_exclude_zero(monkeypatch):
    """Bounds [0.5, 2], [-2, -0.25], [-1, 1]: the in-bounds action nearest 0 is (0.5, -0.25, 0), picked by hand.
    A zero action would be outside the first two intervals, and the env would refuse it while being built."""
    monkeypatch.setitem(gymnasium.registry, "StrictBounds-v0", gymnasium.envs.registration.EnvSpec(
        "StrictBounds-v0", entry_point=StrictBounds, max_episode_steps=5))
    monkeypatch.setattr(StrictBounds, "received", [])
    GymnasiumEnv("StrictBounds-v0", 2, torch.device("cpu"), seed=0)
    (probe,) = StrictBounds.received        # one probe step, of one sub-env
    assert probe.dtype == np.float32 and probe.tolist() == [0.5, -0.25, 0.0]
