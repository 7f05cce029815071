"""Gaps found by a mutation audit of envs/ (cartpole.py, tracking.py, motions.py, gymnasium.py, make_env in
__init__.py; not isaaclab.py): 153 hand-made mutants, each run against the env tests and the tests that build these
envs (test_envs*, test_env_gymnasium*, test_env_adapter_model_rules, test_env_check*, test_resume_settings,
test_export_logger_env_rules and others). 133 were killed by existing tests; each test below fails on a mutant that
every earlier test let through. Expected values are written by hand or recomputed in numpy from literal constants.

Pinned: cart-pole's 12-degree failure angle (13 passed); the tracking PD gains kp 40, kd 2 and joint damping 0.1 (the
float64 check read them back from the env); the future reference frames 1, 2, 5 and 10 steps ahead (read back from
the env too); the reset's episode-length spread for limits under 4 steps (floor of the range 2, not 1); the motion
draw, start time and episode-length spread taken from a fixed generator instead of the env's seeded one (every rank
the same episodes); the frequency range's slope 0.8 per unit of difficulty (0.7 passed); the motion library ignoring
its seed; a gymnasium reward handed on as float64; an unsigned-integer reward refused by the probe step; a 0-d Box
observation space accepted.

Equivalent or not worth a test: cart-pole's critic obs sharing the policy's tensor (the state is replaced each step,
never written in place); tracking's final_obs recomputing the reference instead of reusing ref_q (same value);
load_state_dict's .to() without copy=True (the sum of the two counts is a new tensor already); `if action_clip:`
for `is not None` (config refuses a clip <= 0); clipping to the bounds min-then-max instead of max-then-min (a Box
has low <= high); failure at body error >= 0.15 instead of > 0.15 (a float32 tie, not constructible by hand)."""

import math
from types import SimpleNamespace

import gymnasium
import numpy as np
import pytest
import torch

from envs import CartPole, Tracking
from envs.gymnasium import GymnasiumEnv
from envs.motions import MotionLibrary
from tests.test_envs_by_hand import _Toy, numpy_substep, reference

CHAIN = SimpleNamespace(num_joints=6, link_length=0.25, link_mass=0.5, gravity=9.81, sim_dt=0.005,
                        kp=40.0, kd=2.0, joint_damping=0.1)        # the docstring's chain, written out


def test_cartpole_fails_past_12_degrees_not_13():
    """Mutant: theta_limit 13 degrees. A pole at rest at 12.5 degrees (falling further) fails; one at 11.5 does not."""
    env = CartPole(2, "cpu", 0)
    env.reset()
    env.episode_length.zero_()
    deg = math.pi / 180
    env.state = torch.tensor([[0.0, 0.0, 12.5 * deg, 0.0], [0.0, 0.0, -11.5 * deg, 0.0]])
    _, _, terminated, truncated, _ = env.step(torch.zeros(2, 1))
    assert terminated.tolist() == [True, False] and truncated.tolist() == [False, False]


def test_tracking_substep_uses_kp_40_and_damping_2_1():
    """Mutants: kp 45, kd 2.5, joint damping 0. One substep against numpy float64 with the gains written out here,
    not read back from the env (the earlier float64 test took env.kp, env.kd and env.joint_damping)."""
    env = Tracking(3, "cpu", 0, base_seed=0, num_motions=4)
    env.decimation = 1
    g = torch.Generator().manual_seed(5)
    q, qd = torch.randn(3, 6, generator=g) * 0.6, torch.randn(3, 6, generator=g) * 3.0
    target = torch.randn(3, 6, generator=g) * 0.5
    env.q, env.qd = q.clone(), qd.clone()
    env._simulate(target)
    for i in range(3):
        want_q, want_qd = numpy_substep(CHAIN, q[i].double().numpy(), qd[i].double().numpy(),
                                        target[i].double().numpy())
        np.testing.assert_allclose(env.q[i].double().numpy(), want_q, rtol=0, atol=1e-5)
        np.testing.assert_allclose(env.qd[i].double().numpy(), want_qd, rtol=0,
                                   atol=2e-4 * max(1, np.abs(want_qd).max()))


def test_tracking_observes_the_reference_1_2_5_and_10_steps_ahead():
    """Mutant: future_steps (1, 2, 5, 11). policy[18:42] holds the reference at t + 0.02 k for k = 1, 2, 5, 10,
    the offsets written out here (the earlier test iterated env.future_steps)."""
    env = Tracking(4, "cpu", 0, base_seed=0, num_motions=4, episode_length_s=100.0)
    obs, _ = env.reset()
    for n in range(4):
        motion, t = int(env.motion_ids[n]), float(env.motion_time[n])
        want = np.concatenate([reference(env.motions, motion, t + 0.02 * k)[0] for k in (1, 2, 5, 10)])
        np.testing.assert_allclose(obs["policy"][n, 18:42].double().numpy(), want, rtol=0, atol=2e-5)


def test_tracking_short_limits_start_every_episode_at_step_0():
    """Mutant: the reset's spread max(limit // 2, 2). For a 1- or 3-step limit the range [0, max(limit // 2, 1)) is
    {0}: every env starts at step 0, phase 0 in the critic observation."""
    for seconds in (0.02, 0.06):
        env = Tracking(64, "cpu", 0, base_seed=0, num_motions=4, episode_length_s=seconds)
        obs, _ = env.reset()
        assert env.episode_length.tolist() == [0] * 64
        assert obs["critic"][:, -1].tolist() == [0.0] * 64


def test_tracking_resets_draw_motions_start_times_and_lengths_from_the_env_seed():
    """Mutants: the motion draw, the start time or the episode-length spread from a fixed generator instead of
    env.generator: every rank (rank seeds 0 and 1 here) would start the same episodes. Each of the three differs
    between the two seeds (64 envs: equal by chance with probability far below 1e-20)."""
    a = Tracking(64, "cpu", 0, base_seed=0, num_motions=8)
    b = Tracking(64, "cpu", 1, base_seed=0, num_motions=8)
    a.reset()
    b.reset()
    assert not torch.equal(a.motion_ids, b.motion_ids)
    fraction_a = a.motion_time / a.motions.duration[a.motion_ids]
    fraction_b = b.motion_time / b.motions.duration[b.motion_ids]
    assert not torch.allclose(fraction_a, fraction_b)
    assert not torch.equal(a.episode_length, b.episode_length)


def test_the_hardest_motions_reach_the_top_of_their_frequency_range():
    """Mutant: max_freq = 0.2 + 0.7 d. Motions of difficulty above 0.9 draw frequencies up to 0.1 + 0.9 (0.2 + 0.8 d)
    Hz: over their ~900 draws the largest share of that range is above 0.97 (under 0.91 with the slope 0.7)."""
    m = MotionLibrary(512, 6, seed=7, device="cpu")
    d = m.difficulty.double()
    hard = d > 0.9
    share = (m.freq.double()[hard] - 0.1) / (0.9 * (0.2 + 0.8 * d[hard]))[:, None, None]
    assert hard.sum() >= 30 and share.max() > 0.97 and share.max() < 1 + 1e-6


def test_the_motion_library_follows_its_seed():
    """Mutant: the library generated from seed 0 whatever it is given. Seeds 1 and 2 give different motions, seed 1
    twice the same ones."""
    one, again, two = (MotionLibrary(8, 6, seed=s, device="cpu") for s in (1, 1, 2))
    assert torch.equal(one.sines, again.sines) and torch.equal(one.duration, again.duration)
    assert not torch.equal(one.freq, two.freq) and not torch.equal(one.duration, two.duration)


def test_a_gymnasium_reward_is_float32():
    """Mutant: the reward handed on as gymnasium's float64 array. The protocol (envs/base.py) says float32."""
    env = GymnasiumEnv("Pendulum-v1", 2, torch.device("cpu"), seed=0)
    env.reset()
    _, reward, _, _, _ = env.step(torch.zeros(2, 1))
    assert reward.dtype == torch.float32 and reward.shape == (2,)


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
