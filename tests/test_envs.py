"""The built-in envs (cart-pole, tracking, the motion library and its sampler): the protocol's shapes and flags,
seeding, time limits, the chain's dynamics and state dicts, and constants written out by hand (cart-pole's failure
angle, tracking's PD gains and reference frames, the reset's spreads, the motions' frequency ranges)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from envs import CartPole, Tracking
from envs.motions import AdaptiveMotionSampler, MotionLibrary
from tests.test_envs_by_hand import numpy_substep, reference

ENVS = {"cartpole": lambda seed: CartPole(32, "cpu", seed),
        "tracking": lambda seed: Tracking(32, "cpu", seed, base_seed=0, num_motions=8)}


def rollout(env, steps=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    obs, _ = env.reset()
    out = []
    for _ in range(steps):
        obs, reward, terminated, truncated, extras = env.step(torch.randn(env.num_envs, env.num_actions, generator=g))
        out.append((obs, reward, terminated, truncated, extras))
    return out


@pytest.mark.parametrize("name", ENVS)
def test_protocol_shapes_and_flags(name):
    env = ENVS[name](0)
    saw_done = False
    for obs, reward, terminated, truncated, extras in rollout(env, 200):
        assert set(obs) >= {"policy", "critic"}
        for group, dim in env.obs_dims.items():
            assert obs[group].shape == (env.num_envs, dim) and extras["final_obs"][group].shape == (env.num_envs, dim)
        assert reward.shape == terminated.shape == truncated.shape == (env.num_envs,)
        assert terminated.dtype == truncated.dtype == torch.bool
        assert not (terminated & truncated).any(), "an env is either terminated or timed out, never both"
        done = terminated | truncated
        # Envs that did not finish: the final obs is the obs; finished envs were reset.
        assert torch.equal(extras["final_obs"]["policy"][~done], obs["policy"][~done])
        saw_done |= bool(done.any())
    assert saw_done


@pytest.mark.parametrize("name", ENVS)
def test_deterministic_under_seed(name):
    a, b, c = rollout(ENVS[name](3)), rollout(ENVS[name](3)), rollout(ENVS[name](4))
    assert all(torch.equal(x[0]["critic"], y[0]["critic"]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert not all(torch.equal(x[0]["critic"], y[0]["critic"]) for x, y in zip(a, c))


def test_cartpole_time_out_at_the_limit():
    env = CartPole(4, "cpu", 0, episode_length_s=0.1)      # 5 steps
    env.reset()
    env.episode_length.zero_()
    for step in range(5):
        _, _, terminated, truncated, _ = env.step(torch.zeros(4, 1))
    assert truncated.all() and not terminated.any()


def test_tracking_with_a_one_step_time_limit_times_out_every_step():
    # --env.episode-length-s 0.02 is one control step, which validate accepts: the reset's spread of episode
    # starts over [0, limit // 2) was an empty range there, and randint refused it.
    env = Tracking(4, "cpu", 0, base_seed=0, num_motions=2, episode_length_s=0.02)
    env.reset()
    for _ in range(3):
        _, _, terminated, truncated, _ = env.step(torch.zeros(4, env.num_actions))
        assert (terminated | truncated).all()


def test_chain_dynamics_hold_a_gravity_compensated_pose_and_conserve_energy():
    env = Tracking(2, "cpu", 0, base_seed=0)
    pose = torch.tensor([0.3, -0.2, 0.1, 0.4, -0.3, 0.2]).repeat(2, 1)
    phi = pose.cumsum(-1)
    gravity_torque = (env.gravity_coef * torch.sin(phi)).flip(-1).cumsum(-1).flip(-1)   # joint j holds links >= j
    env.q, env.qd = pose.clone(), torch.zeros(2, 6)
    for _ in range(50):
        env._simulate(pose + gravity_torque / env.kp)
    torch.testing.assert_close(env.q, pose, atol=1e-5, rtol=0)

    # Passive chain (no PD, no damping): kinetic + potential energy stays put over 1 s.
    env.kp, env.kd, env.joint_damping = 0.0, 0.0, 0.0
    env.stiffness_phi = env.stiffness_phi * 0
    env.damping_phi = env.damping_phi * 0

    def energy():
        phi, phid = env.q.cumsum(-1), env.qd.cumsum(-1)
        H = env.mass_pair * torch.cos(phi[:, :, None] - phi[:, None, :])
        kinetic = 0.5 * torch.einsum("ni,nij,nj->n", phid, H, phid)
        return kinetic + env.gravity * env.link_mass * env._body_positions(env.q)[..., 1].sum(-1)
    e0 = energy()
    for _ in range(50):
        env._simulate(torch.zeros(2, 6))
    assert ((energy() - e0).abs() / e0.abs()).max() < 0.01


def test_adaptive_sampler_probabilities_follow_failure_rates_with_a_floor():
    s = AdaptiveMotionSampler(4, uniform_floor=0.2, device="cpu")
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    ended = torch.ones(8, dtype=torch.bool)
    failed = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    s.record(ids, ended, failed)
    rate = torch.tensor([3 / 4, 2 / 4, 1 / 4, 1 / 4], dtype=torch.float64)     # (failures + 1) / (visits + 2)
    expected = 0.2 / 4 + 0.8 * rate / rate.sum()
    torch.testing.assert_close(s.probabilities(), expected)
    assert s.probabilities().sum().item() == pytest.approx(1.0)
    # Global counts (from the last cross-rank sync) and local counts add up.
    s.global_counts, s.local_counts = s.local_counts.clone(), torch.zeros_like(s.local_counts)
    torch.testing.assert_close(s.probabilities(), expected)


def test_tracking_state_dict_round_trip_and_shape_check():
    a = Tracking(16, "cpu", 0, base_seed=0, num_motions=8)
    rollout(a, 100)
    b = Tracking(16, "cpu", 1, base_seed=0, num_motions=8)
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b.sampler.probabilities(), a.sampler.probabilities())
    # Global counts come back global: loaded as local, the next commit_global would add them (every rank's) to
    # the cross-rank sum a second time. Saved local counts are folded into them (every rank loads the same
    # file, so kept local they would be summed once per rank): the same probabilities, nothing local.
    a.sampler.global_counts = torch.tensor([[5.0] * 8, [1.0] * 8], dtype=torch.float64)
    a.sampler.local_counts = torch.tensor([[2.0] * 8, [0.0] * 8], dtype=torch.float64)
    b.load_state_dict(a.state_dict())
    assert b.sampler.global_counts.tolist() == [[7.0] * 8, [1.0] * 8]
    assert b.sampler.local_counts.tolist() == [[0.0] * 8, [0.0] * 8]
    torch.testing.assert_close(b.sampler.probabilities(), a.sampler.probabilities())
    with pytest.raises(ValueError, match="num-motions"):
        Tracking(16, "cpu", 0, base_seed=0, num_motions=9).load_state_dict(a.state_dict())


def test_tracking_sampler_state_is_a_copy_both_ways():
    """The counts grow in place: a saved state must not keep growing with the env, and an env loaded from a
    state must not write into it (nor into the env it came from)."""
    a = Tracking(16, "cpu", 0, base_seed=0, num_motions=8)
    b = Tracking(16, "cpu", 1, base_seed=0, num_motions=8)
    saved = a.state_dict()
    b.load_state_dict(saved)
    ones = torch.ones(8, dtype=torch.bool)
    for env in (a, b):
        env.sampler.record(torch.arange(8), ones, ones)
        env.sampler.commit_global(torch.ones(2, 8, dtype=torch.float64))
    assert saved["sampler"]["global_counts"].sum().item() == 0 and saved["sampler"]["local_counts"].sum().item() == 0
    assert a.sampler.global_counts.sum().item() == b.sampler.global_counts.sum().item() == 16    # 2 x 8 ones, once



def test_tracking_saved_local_counts_do_not_grow_with_the_env():
    """The saved local counts are a copy too: episodes recorded after the save (before any sync, which would zero
    the live counts and so hide an alias) are not in the state that was saved."""
    a = Tracking(16, "cpu", 0, base_seed=0, num_motions=8)
    a.sampler.record(torch.tensor([1, 3]), torch.tensor([True, True]), torch.tensor([True, False]))
    saved = a.state_dict()["sampler"]
    a.sampler.record(torch.arange(8), torch.ones(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool))
    want = [[0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    assert saved["local_counts"].tolist() == want
    assert saved["global_counts"].tolist() == [[0.0] * 8, [0.0] * 8]
    assert a.sampler.local_counts.tolist() == [[1.0, 2.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0],
                                               [1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]


def test_tracking_observations_hold_the_reference_frames_they_name():
    """Policy obs = [q, 0.1 qd, last action, reference q at the future frames, 0.1 reference qd at the next frame],
    the critic's adds body positions and the phase; final_obs is taken before the resets. Checked against the
    motion library evaluated with plain Python floats (math.sin/cos), not against the env's own frame()."""
    import math
    env = Tracking(5, "cpu", 2, base_seed=0, num_motions=4, episode_length_s=1.0)
    obs, _ = env.reset()
    g = torch.Generator().manual_seed(1)
    m = env.motions

    def reference(motion: int, t: float):
        q, qd = [], []
        for j in range(env.num_joints):
            terms = [(2 * math.pi * float(m.freq[motion, j, s]), float(m.amp[motion, j, s]),
                      float(m.phase[motion, j, s]))
                     for s in range(m.num_sines)]
            q.append(float(m.bias[motion, j]) + sum(a * math.sin(w * t + p) for w, a, p in terms))
            qd.append(sum(a * w * math.cos(w * t + p) for w, a, p in terms))
        return torch.tensor(q, dtype=torch.float64), torch.tensor(qd, dtype=torch.float64)

    j, f = env.num_joints, len(env.future_steps)
    for _ in range(60):
        before = (env.motion_ids.clone(), env.motion_time.clone())
        obs, _, terminated, truncated, extras = env.step(torch.randn(5, j, generator=g))
        for group_obs, (ids, time) in ((obs, (env.motion_ids, env.motion_time)),
                                       (extras["final_obs"], (before[0], before[1] + env.dt))):
            policy = group_obs["policy"].double()
            for n in range(5):
                t = float(time[n])
                future = torch.stack([reference(int(ids[n]), t + k * env.dt)[0] for k in env.future_steps])
                torch.testing.assert_close(policy[n, 3 * j:3 * j + f * j], future.flatten(), atol=2e-5, rtol=0)
                torch.testing.assert_close(policy[n, 3 * j + f * j:], 0.1 * reference(int(ids[n]), t + env.dt)[1],
                                           atol=2e-5, rtol=0)
        # the final observation is the pre-reset state: equal to the returned obs wherever no episode ended
        done = terminated | truncated
        for group in ("policy", "critic"):
            assert torch.equal(extras["final_obs"][group][~done], obs[group][~done])


def test_sum_sines_adds_in_the_order_of_torch_sum():
    from envs.motions import sum_sines
    g = torch.Generator().manual_seed(0)
    for shape in [(512, 6, 3), (37, 4, 6, 3), (1, 6, 3), (4096, 4, 6, 3)]:
        x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(8) * 1e3   # magnitudes far apart
        assert torch.equal(sum_sines(x).view(torch.int32), x.sum(-1).view(torch.int32))


def test_resets_draw_start_states_and_episode_lengths_over_their_whole_ranges():
    """Cart-pole restarts uniformly in [-0.05, 0.05]^4 (both signs of every coordinate, centred on 0) and spreads
    episode_length over [0, limit); tracking spreads it over [0, limit // 2). 4096 envs hit both ends of each range."""
    n = 4096
    cart = CartPole(n, "cpu", 0, episode_length_s=1.0)              # 50 steps
    obs, _ = cart.reset()
    start = obs["policy"]
    assert (start.min(0).values < -0.049).all() and (start.max(0).values > 0.049).all()
    assert start.abs().max() <= 0.05 and (start.mean(0).abs() < 0.003).all()     # std of the mean: 0.1 / sqrt(12 n)
    assert cart.episode_length.min() == 0 and cart.episode_length.max() == 49
    track = Tracking(n, "cpu", 0, base_seed=0, num_motions=4, episode_length_s=1.0)
    track.reset()
    assert track.episode_length.min() == 0 and track.episode_length.max() == 24


def test_tracking_truncates_on_the_step_that_reaches_the_clip_end_exactly():
    """A motion clip ends when the motion time reaches its duration: the step that lands on it exactly times out."""
    env = Tracking(2, "cpu", 0, base_seed=0, num_motions=2, episode_length_s=100.0)
    env.reset()
    env.episode_length.zero_()
    env.motion_ids = torch.tensor([0, 1])
    env.motion_time = torch.tensor([3.0, 3.0])
    landing = (env.motion_time + env.dt)[0]                        # the float32 time after one step
    env.motions.duration = torch.stack([landing, torch.nextafter(landing, torch.tensor(100.0))])
    env.q, env.qd = env.motions.frame(env.motion_ids, env.motion_time)
    target, _ = env.motions.frame(env.motion_ids, env.motion_time + env.dt)
    _, _, terminated, truncated, _ = env.step(target)
    assert terminated.tolist() == [False, False] and truncated.tolist() == [True, False]


def test_motion_library_ranges_follow_each_motion_s_difficulty():
    """Per motion (difficulty d in [0, 1)): per joint and sine, frequency in [0.1, 0.1 + 0.9 (0.2 + 0.8 d)) Hz,
    amplitude in [0, (0.2 + 0.5 d) / 3) rad, phase in [0, 2 pi); bias in [-0.2, 0.2) rad; duration in [4, 12) s,
    drawn apart from d. Harder motions are faster and larger; every range is filled to both ends."""
    import math
    from envs.motions import MotionLibrary
    m = MotionLibrary(512, 6, seed=7, device="cpu")
    d = m.difficulty[:, None, None].double()
    freq_top, amp_top = 0.9 * (0.2 + 0.8 * d), (0.2 + 0.5 * d) / 3
    freq_share, amp_share = (m.freq.double() - 0.1) / freq_top, m.amp.double() / amp_top
    for share in (freq_share, amp_share, m.phase.double() / (2 * math.pi), (m.bias.double() + 0.2) / 0.4,
                  (m.duration.double() - 4.0) / 8.0, m.difficulty.double()):
        assert share.min() >= -1e-6 and share.max() < 1 + 1e-6
        assert share.min() < 0.03 and share.max() > 0.97
    # The shares are uniform draws of their own: not tied to the difficulty (which only sets the ranges' tops).
    for per_motion in (freq_share.mean((1, 2)), amp_share.mean((1, 2)), m.duration.double()):
        assert abs(np.corrcoef(per_motion.numpy(), m.difficulty.double().numpy())[0, 1]) < 0.2
    assert np.corrcoef(m.freq.double().amax((1, 2)).numpy(), m.difficulty.double().numpy())[0, 1] > 0.5
    assert np.corrcoef(m.amp.double().amax((1, 2)).numpy(), m.difficulty.double().numpy())[0, 1] > 0.5


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


def test_tracking_refuses_future_steps_that_do_not_start_with_the_next_frame():
    """_observe reuses the first future frame's velocity as the next frame's: a subclass starting at 2 observed a
    velocity two steps ahead under the next frame's name, silently.

    Mutant: no future_steps check in Tracking.__init__ (the env builds)."""

    class Sparse(Tracking):
        future_steps = (2, 5, 10)

    with pytest.raises(ValueError, match=r"future_steps must start with 1 .*; got \(2, 5, 10\)"):
        Sparse(2, "cpu", 0, base_seed=0, num_motions=2)


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
