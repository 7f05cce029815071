"""The gymnasium adapter's build-time probe step (envs/gymnasium.py check_reset_and_step): the action it takes is
the one nearest 0 inside the action space's bounds, so an env that checks its actions accepts the probe; an env
whose step still returns the old gym API's 4-tuple is one line while built; a reward of an unsigned integer type is
one number, and a 0-d Box observation space is refused."""

import re

import gymnasium
import numpy as np
import pytest
import torch

import train
from configs import preset
from envs.gymnasium import GymnasiumEnv
from tests.test_envs_by_hand import _Toy

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


def test_the_probe_step_keeps_to_the_bounds_of_the_env_beneath_an_action_wrapper(monkeypatch):
    """The probe steps the env beneath its wrappers, so its action must lie in that env's bounds: with a wrapper that
    rescales actions to [-1, 1], 0 is inside the wrapped space and outside StrictBounds' own, which refused it."""
    def rescaled():
        return gymnasium.wrappers.RescaleAction(StrictBounds(), np.float32(-1.0), np.float32(1.0))
    monkeypatch.setitem(gymnasium.registry, "Rescaled-v0", gymnasium.envs.registration.EnvSpec(
        "Rescaled-v0", entry_point=rescaled, max_episode_steps=5))
    monkeypatch.setattr(StrictBounds, "received", [])
    GymnasiumEnv("Rescaled-v0", 2, torch.device("cpu"), seed=0)
    (probe,) = StrictBounds.received
    assert probe.tolist() == [0.5, -0.25, 0.0]     # the in-bounds action nearest 0 of StrictBounds itself


def old_gym_env(dim: int) -> type:
    """An env written for gym < 0.26: reset returns the observation alone, step (obs, reward, done, info)."""
    class OldGym(gymnasium.Env):
        observation_space = gymnasium.spaces.Box(-1.0, 1.0, (dim,))
        action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,))

        def reset(self, seed=None, options=None):
            return np.zeros(dim, dtype=np.float32)

        def step(self, action):
            return np.zeros(dim, dtype=np.float32), 1.0, False, {}

    return OldGym


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.filterwarnings("ignore:.*env.reset\\(\\)` was not a tuple:UserWarning")   # gymnasium's env checker
def test_an_env_of_the_old_gym_api_is_one_line_from_the_cli(monkeypatch, tmp_path, capsys, dim):
    """Its first reset failed inside gymnasium's vector env, after the model was built: a traceback ending in
    "not enough values to unpack" (1 observation), "'numpy.float32' object has no attribute 'items'" (2) or
    "too many values to unpack" (3)."""
    monkeypatch.setitem(gymnasium.registry, "OldGym-v0", gymnasium.envs.registration.EnvSpec(
        "OldGym-v0", entry_point=old_gym_env(dim), max_episode_steps=10))
    cfg = preset("mujoco")
    cfg.env.task, cfg.dry_run, cfg.log.root = "OldGym-v0", True, str(tmp_path)
    assert train.cli(cfg) == 2
    assert capsys.readouterr().err == ("error: --env.task OldGym-v0: reset() returned ndarray, not gymnasium's (obs, "
                                       "info dict): the env is written for the old gym API; port it to gymnasium's "
                                       "(reset -> (obs, info), step -> (obs, reward, terminated, truncated, info))\n")


class HalfPorted(gymnasium.Env):
    """reset ported to gymnasium's (obs, info); step still gym's (obs, reward, done, info)."""
    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,))
    action_space = gymnasium.spaces.Box(-np.inf, np.inf, (1,))            # unbounded: the probe action must be finite
    stepped_with: list = []

    def reset(self, seed=None, options=None):
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        self.stepped_with.append(action)
        return np.zeros(2, dtype=np.float32), 1.0, False, {}


def test_an_env_half_ported_from_the_old_gym_api_is_one_line_while_built(monkeypatch, tmp_path, capsys):
    """Its reset passed, and its first step failed inside gymnasium's TimeLimit wrapper, after the model was built:
    "not enough values to unpack (expected 5, got 4)". A probe step of the sub-env at build says what to port."""
    monkeypatch.setitem(gymnasium.registry, "HalfPorted-v0", gymnasium.envs.registration.EnvSpec(
        "HalfPorted-v0", entry_point=HalfPorted, max_episode_steps=10))
    cfg = preset("mujoco")
    cfg.env.task, cfg.dry_run, cfg.log.root = "HalfPorted-v0", True, str(tmp_path)
    assert train.cli(cfg) == 2
    assert capsys.readouterr().err == ("error: --env.task HalfPorted-v0: step() returned a tuple of 4, not gymnasium's "
                                       "(obs, reward, terminated, truncated, info): the env is written for the old gym "
                                       "API; port it to gymnasium's (reset -> (obs, info), step -> (obs, reward, "
                                       "terminated, truncated, info))\n")
    assert [a.tolist() for a in HalfPorted.stepped_with] == [[0.0]]    # in bounds, finite


class ArrayReward(gymnasium.Env):
    """A lab env whose step returns its reward as a 1-element array (or a bool, or a string)."""
    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,))
    action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,))
    reward = np.array([1.0])

    def reset(self, seed=None, options=None):
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        return np.zeros(2, dtype=np.float32), self.reward, False, False, {}


@pytest.mark.parametrize("reward, said", [
    (np.array([1.0]), "ndarray of shape [1], dtype float64"), (True, "bool of shape [], dtype bool"),
    ("1", "str of shape [], dtype <U1"), (np.float32(1.0), None), (2, None)])
def test_a_reward_that_is_not_one_number_is_named_while_built(monkeypatch, reward, said):
    """A [1] array failed the first rollout step inside gymnasium's vector env, after the run directory was made:
    "ValueError: setting an array element with a sequence." (exit 1, a traceback)."""
    monkeypatch.setattr(ArrayReward, "reward", reward)
    monkeypatch.setitem(gymnasium.registry, "ArrayReward-v0", gymnasium.envs.registration.EnvSpec(
        "ArrayReward-v0", entry_point=ArrayReward, max_episode_steps=10))
    if said is None:
        assert GymnasiumEnv("ArrayReward-v0", 2, torch.device("cpu"), seed=0).num_envs == 2   # a number is taken
        return
    with pytest.raises(ValueError, match=re.escape(f"--env.task ArrayReward-v0: step()'s reward is {said}, not a "
                                                   "single number: return float(reward)")):
        GymnasiumEnv("ArrayReward-v0", 2, torch.device("cpu"), seed=0)


class ResetInfoNone(gymnasium.Env):
    """Half ported the other way: reset returns (obs, None), an info that is no dict."""
    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,))
    action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,))

    def reset(self, seed=None, options=None):
        return np.zeros(2, dtype=np.float32), None

    def step(self, action):
        return np.zeros(2, dtype=np.float32), 0.0, False, False, {}


def test_a_reset_whose_info_is_no_dict_is_named_while_built(monkeypatch):
    monkeypatch.setitem(gymnasium.registry, "ResetInfoNone-v0", gymnasium.envs.registration.EnvSpec(
        "ResetInfoNone-v0", entry_point=ResetInfoNone, max_episode_steps=10))
    with pytest.raises(ValueError, match=r"^--env.task ResetInfoNone-v0: reset\(\) returned a tuple of 2, not "
                                         r"gymnasium's \(obs, info dict\)"):
        GymnasiumEnv("ResetInfoNone-v0", 2, torch.device("cpu"), seed=0)


def reshaped_by_a_wrapper():
    """An env of 4 features that a wrapper in its entry point cuts to 2, declaring the 2 (as gymnasium's observation
    wrappers do): the vector env sees 2, its own reset 4."""
    base = StrictBounds()
    base.observation_space = gymnasium.spaces.Box(-1.0, 1.0, (4,))
    base.reset = lambda seed=None, options=None: (np.arange(4, dtype=np.float32) / 4, {})
    base.step = lambda action: (np.arange(4, dtype=np.float32) / 4, 1.0, False, False, {})
    return gymnasium.wrappers.TransformObservation(base, lambda obs: obs[:2],
                                                   gymnasium.spaces.Box(-1.0, 1.0, (2,)))


def test_an_observation_a_wrapper_reshapes_is_probed_against_the_env_s_own_space(monkeypatch):
    """The probe resets the env beneath its wrappers, so it compares that observation with the env's own space: with
    the wrapped space (2) it refused a 4-feature env whose wrapper declares and returns 2, which the run steps fine."""
    monkeypatch.setitem(gymnasium.registry, "Reshaped-v0", gymnasium.envs.registration.EnvSpec(
        "Reshaped-v0", entry_point=reshaped_by_a_wrapper, max_episode_steps=10))
    env = GymnasiumEnv("Reshaped-v0", 2, torch.device("cpu"), seed=0)
    obs, _ = env.reset()
    assert env.obs_dims == {"policy": 2, "critic": 2}
    assert torch.equal(obs["policy"], torch.tensor([[0.0, 0.25]] * 2))


class WrongShape(gymnasium.Env):
    """Declares 3 observation features but returns 2."""
    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (3,))
    action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,))

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        return np.zeros(2, dtype=np.float32), 0.0, False, False, {}


def test_an_observation_of_another_shape_than_declared_is_named_while_built(monkeypatch):
    """Else the vector env's first reset fails inside numpy ("Output array is the wrong shape")."""
    monkeypatch.setitem(gymnasium.registry, "WrongShape-v0", gymnasium.envs.registration.EnvSpec(
        "WrongShape-v0", entry_point=WrongShape, max_episode_steps=5))
    with pytest.raises(ValueError, match=r"^--env.task WrongShape-v0: reset\(\)'s observation has shape \(2,\), but "
                                         r"the env declares observation_space Box\(-1.0, 1.0, \(3,\), float32\); "
                                         r"make the two agree$"):
        GymnasiumEnv("WrongShape-v0", 2, torch.device("cpu"), seed=0)


class _UintReward(_Toy):
    def step(self, action):
        return self.observation_space.sample(), np.uint8(1), False, False, {}


class _ScalarObs(_Toy):
    observation_space = gymnasium.spaces.Box(-1.0, 1.0, ())


def _register(monkeypatch, name, cls):
    spec = gymnasium.envs.registration.EnvSpec(name, entry_point=cls, max_episode_steps=5)
    monkeypatch.setitem(gymnasium.registry, name, spec)


def test_an_unsigned_integer_reward_is_one_number(monkeypatch):
    """Mutant: the probe step accepting float and signed int rewards only. A np.uint8 reward is one number (the
    vector env's float array takes it): the env is built and steps, its reward 1.0."""
    _register(monkeypatch, "UintReward-v0", _UintReward)
    env = GymnasiumEnv("UintReward-v0", 2, torch.device("cpu"), seed=0)
    env.reset()
    _, reward, _, _, _ = env.step(torch.zeros(2, 1))
    assert reward.tolist() == [1.0, 1.0]


def test_a_0_d_box_observation_space_is_refused(monkeypatch):
    """Mutant: only observation spaces of 2 or more dims refused. A 0-d Box (one scalar) is not 1-D either."""
    _register(monkeypatch, "ScalarObs-v0", _ScalarObs)
    with pytest.raises(ValueError, match="ScalarObs-v0: needs a 1-D Box observation space"):
        GymnasiumEnv("ScalarObs-v0", 1, torch.device("cpu"), seed=0)
