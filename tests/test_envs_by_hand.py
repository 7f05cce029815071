"""The embedded envs (tracking, cartpole), the motion sampler and the gymnasium adapter against values
computed independently of the code under test: by hand, numpy float64, and plain-Python formulas from the
docstrings (the chain's H, C, G and implicit PD terms; the classic cart-pole equations)."""

import math

import gymnasium
import numpy as np
import pytest
import torch

from envs import CartPole, Tracking
from envs.motions import AdaptiveMotionSampler


# ---- helpers: the tracking task's formulas, re-derived from envs/tracking.py's docstring ---------------

def reference(m, motion: int, t: float):
    """Motion `motion` at time t from the library's parameters with math.sin/cos (bias + sum of sines)."""
    q, qd = [], []
    for j in range(m.freq.shape[1]):
        terms = [(2 * math.pi * float(m.freq[motion, j, s]), float(m.amp[motion, j, s]), float(m.phase[motion, j, s]))
                 for s in range(m.num_sines)]
        q.append(float(m.bias[motion, j]) + sum(a * math.sin(w * t + p) for w, a, p in terms))
        qd.append(sum(a * w * math.cos(w * t + p) for w, a, p in terms))
    return np.array(q), np.array(qd)


def body_positions(q: np.ndarray, l: float = 0.25) -> np.ndarray:
    """Link-end positions [..., J, 2] of the planar chain: phi = cumsum q, x = sum l sin phi, y = -sum l cos phi."""
    phi = np.cumsum(q, -1)
    return np.stack([np.cumsum(l * np.sin(phi), -1), np.cumsum(-l * np.cos(phi), -1)], -1)


def expected_reward(q: np.ndarray, ref: np.ndarray):
    """reward = 0.5 exp(-mean_j (q - ref)^2 / 0.05) + 0.5 exp(-body_err^2 / 0.005), body_err the mean link-end
    distance."""
    joint_err = ((q - ref) ** 2).mean(-1)
    body_err = np.linalg.norm(body_positions(q) - body_positions(ref), axis=-1).mean(-1)
    return 0.5 * np.exp(-joint_err / 0.05) + 0.5 * np.exp(-body_err ** 2 / 0.005), body_err


def set_reference_state(env, ids, times):
    """Put every env on its reference (q, qd) at `times` of motions `ids` (float64 math, cast to float32)."""
    env.motion_ids = torch.tensor(ids, dtype=torch.long)
    env.motion_time = torch.tensor(times, dtype=torch.float32)
    refs = [reference(env.motions, i, float(t)) for i, t in zip(ids, env.motion_time)]
    env.q = torch.tensor(np.stack([r[0] for r in refs]), dtype=torch.float32)
    env.qd = torch.tensor(np.stack([r[1] for r in refs]), dtype=torch.float32)


# ---- envs/tracking.py -------------------------------------------------------------------------------

def test_tracking_reward_and_failure_flag_match_a_numpy_recomputation():
    """The reward (0.5 joint kernel + 0.5 body kernel, with their widths 0.05 and 0.005) and `terminated`
    (mean link-end error > fail_distance 0.15) recomputed in numpy float64 from the pre-reset state in
    final_obs and the reference evaluated with math.sin. The reward is what PPO optimises and the flag decides
    whether a return is bootstrapped: a wrong kernel width or threshold changes what is learned."""
    n = 48
    env = Tracking(n, "cpu", 0, base_seed=0, num_motions=4, episode_length_s=100.0)
    env.reset()
    env.episode_length.zero_()
    offsets = torch.linspace(0.0, 0.6, n)[:, None] * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    body_errs, rewards_seen = [], []
    for _ in range(6):
        ids, time = env.motion_ids.clone(), env.motion_time.clone() + env.dt
        set_reference_state(env, ids.tolist(), env.motion_time.tolist())
        env.q += offsets
        actions = torch.stack([torch.tensor(reference(env.motions, int(i), float(t))[0], dtype=torch.float32)
                               for i, t in zip(ids, time)]) + offsets
        _, reward, terminated, truncated, extras = env.step(actions)
        q = extras["final_obs"]["policy"][:, :6].double().numpy()
        ref = np.stack([reference(env.motions, int(i), float(t))[0] for i, t in zip(ids, time)])
        want, body_err = expected_reward(q, ref)
        np.testing.assert_allclose(reward.double().numpy(), want, rtol=0, atol=2e-5)
        clear = np.abs(body_err - 0.15) > 1e-4                  # float32 vs float64: skip the razor's edge
        assert np.array_equal(terminated.numpy()[clear], (body_err > 0.15)[clear])
        # The log holds this step's means (failures_per_step: the terminated share, not the done share).
        assert extras["log"]["Episode/failures_per_step"].item() == pytest.approx(float(terminated.float().mean()))
        assert extras["log"]["Episode/body_error"].item() == pytest.approx(body_err.mean(), abs=1e-5)
        kernels = np.exp(-((q - ref) ** 2).mean(-1) / 0.05).mean(), np.exp(-body_err ** 2 / 0.005).mean()
        logged = extras["log"]["Episode/reward_joint"].item(), extras["log"]["Episode/reward_body"].item()
        assert logged == pytest.approx(kernels, abs=1e-5) and abs(kernels[0] - kernels[1]) > 1e-3
        body_errs.append(body_err)
        rewards_seen.append(want)
    body_errs = np.concatenate(body_errs)
    # The data spans the threshold (failures between 0.15 and 0.3, successes below 0.15) and the kernels' range.
    assert ((body_errs > 0.16) & (body_errs < 0.29)).sum() >= 5 and (body_errs < 0.14).sum() >= 5
    assert np.concatenate(rewards_seen).min() < 0.3 and np.concatenate(rewards_seen).max() > 0.9


def test_tracking_time_limit_clip_end_and_failure_precedence():
    """Time-outs by hand: an env is truncated when its step count reaches max_episode_length (not one later)
    or its motion time reaches the clip's duration; a failure on the same step is terminated only (a failure
    must never be bootstrapped). The envs that finished restart with episode_length 0 (phase 0 in the critic
    obs) and a zeroed previous action; the sampler counts visits of finished episodes and failures of
    terminated ones only, per motion."""
    env = Tracking(6, "cpu", 0, base_seed=0, num_motions=4, episode_length_s=1.0)    # 50 steps
    env.reset()
    m, dt, T = env.motions, env.dt, env.max_episode_length
    ids = [0, 1, 2, 3, 1, 2]
    dur = [float(m.duration[i]) for i in ids]
    times = [0.5, 0.5, dur[2] - 0.5 * dt, dur[3] - 1.5 * dt, 0.5, 0.5]
    set_reference_state(env, ids, times)
    env.q[4] += 1.0                                           # far off its reference: a failure...
    env.episode_length = torch.tensor([T - 1, T - 2, 0, 0, T - 1, 3])   # ...at the time limit
    env.last_action = torch.ones(6, 6)
    actions = torch.stack([torch.tensor(reference(m, i, t + dt)[0], dtype=torch.float32) for i, t in zip(ids, times)])
    obs, _, terminated, truncated, extras = env.step(actions)
    assert terminated.tolist() == [False, False, False, False, True, False]
    assert truncated.tolist() == [True, False, True, False, False, False]
    done = (terminated | truncated).numpy()
    assert obs["critic"][done, -1].tolist() == [0.0, 0.0, 0.0]
    assert obs["critic"][1, -1].item() == pytest.approx((T - 1) / T)
    assert obs["critic"][5, -1].item() == pytest.approx(4 / T)
    assert torch.equal(obs["policy"][done, 12:18], torch.zeros(3, 6))
    torch.testing.assert_close(obs["policy"][~done, 12:18], actions[~done])
    visits = np.bincount([ids[i] for i in range(6) if done[i]], minlength=4)
    assert env.sampler.local_counts[0].tolist() == visits.tolist()
    assert env.sampler.local_counts[1].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert extras["log"]["Episode/failures_per_step"].item() == pytest.approx(1 / 6)     # terminated, not done (3/6)


def test_tracking_actions_are_clamped_to_5_before_the_pd_targets_and_the_observation():
    """Actions beyond +-5 act (and are observed as the previous action) as +-5: two envs in the same state,
    one given 5 and one given 100, end in bit-identical states and observations."""
    env = Tracking(2, "cpu", 0, base_seed=0, num_motions=4, episode_length_s=100.0)
    env.reset()
    set_reference_state(env, [1, 1], [0.5, 0.5])
    env.episode_length.zero_()
    a = torch.tensor([[5.0, -5.0, 5.0, 0.1, -5.0, 5.0], [100.0, -7.0, 5.5, 0.1, -1e4, 6.0]])
    obs, _, _, _, extras = env.step(a)
    final = extras["final_obs"]["policy"]
    assert torch.equal(final[0], final[1])
    assert final[1, 12:18].tolist() == pytest.approx([5.0, -5.0, 5.0, 0.1, -5.0, 5.0])


def test_tracking_observation_layout_and_reset_state():
    """policy = [q, 0.1 qd, ...], critic = [policy, link ends of q, link ends of the reference, phase], with the
    link ends recomputed in numpy; reset starts every env on its reference at a time in [0, duration / 2)
    and spreads episode_length over [0, max_episode_length // 2)."""
    n = 256
    env = Tracking(n, "cpu", 3, base_seed=0, num_motions=8, episode_length_s=10.0)
    obs, _ = env.reset()
    dur = env.motions.duration[env.motion_ids]
    frac = env.motion_time / dur
    assert frac.min() >= 0 and frac.max() < 0.5 and frac.max() > 0.4
    half = env.max_episode_length // 2
    assert env.episode_length.min() >= 0 and env.episode_length.max() < half
    assert env.episode_length.max() >= 0.9 * half
    refs = [reference(env.motions, int(i), float(t)) for i, t in zip(env.motion_ids, env.motion_time)]
    ref_q = np.stack([r[0] for r in refs])
    np.testing.assert_allclose(obs["policy"][:, :6].double().numpy(), ref_q, atol=2e-5)
    np.testing.assert_allclose(obs["policy"][:, 6:12].double().numpy(), 0.1 * np.stack([r[1] for r in refs]), atol=2e-5)
    assert torch.equal(obs["policy"][:, 12:18], torch.zeros(n, 6))
    critic = obs["critic"].double().numpy()
    p = env.obs_dims["policy"]
    np.testing.assert_allclose(critic[:, p:p + 12], body_positions(ref_q).reshape(n, 12), atol=2e-5)
    np.testing.assert_allclose(critic[:, p + 12:p + 24], body_positions(ref_q).reshape(n, 12), atol=2e-5)
    np.testing.assert_allclose(critic[:, -1], env.episode_length.double().numpy() / env.max_episode_length, atol=1e-7)
    # After a step: q and 0.1 qd of the env's own state.
    obs, _, terminated, truncated, _ = env.step(torch.zeros(n, 6))
    keep = ~(terminated | truncated)
    torch.testing.assert_close(obs["policy"][keep, :6], env.q[keep], rtol=0, atol=0)
    torch.testing.assert_close(obs["policy"][keep, 6:12], 0.1 * env.qd[keep], rtol=0, atol=1e-7)
    # ...and the critic's link ends of q and of the reference, which the step's zero actions pulled apart.
    ref_q = np.stack([reference(env.motions, int(i), float(t))[0] for i, t in zip(env.motion_ids, env.motion_time)])
    q_ends = body_positions(env.q.double().numpy()).reshape(n, 12)
    assert np.abs(q_ends - body_positions(ref_q).reshape(n, 12)).max() > 1e-2
    after = obs["critic"].double().numpy()
    np.testing.assert_allclose(after[:, p:p + 12], q_ends, atol=2e-5)
    np.testing.assert_allclose(after[:, p + 12:p + 24], body_positions(ref_q).reshape(n, 12), atol=2e-5)
    np.testing.assert_allclose(critic.shape[1], p + 2 * 2 * 6 + 1)


def numpy_substep(env, q, qd, target):
    """One substep from the docstring in float64: H phi_ddot = tau_phi - C - G, tau_phi = D^T tau, with the PD
    torque tau = kp (target - q_new) - (kd + joint_damping) qd_new taken at the end of the step (implicit) and
    C, G at its start (explicit): H (phid' - phid) = dt (D^T tau(phid') - C - G), then phi' = phi + dt phid'."""
    J, l, mass, g, dt = env.num_joints, env.link_length, env.link_mass, env.gravity, env.sim_dt
    M = [mass * (J - j) for j in range(J)]
    D = np.eye(J) - np.eye(J, k=-1)                  # q = D phi
    phi, phid = np.cumsum(q), np.cumsum(qd)
    H = np.array([[M[max(j, k)] * l * l * math.cos(phi[j] - phi[k]) for k in range(J)] for j in range(J)])
    C = np.array([sum(M[max(j, k)] * l * l * math.sin(phi[j] - phi[k]) * phid[k] ** 2 for k in range(J))
                  for j in range(J)])
    G = np.array([g * l * M[j] * math.sin(phi[j]) for j in range(J)])
    kp, kdd = env.kp, env.kd + env.joint_damping
    # tau(phid') = kp (target - D (phi + dt phid')) - kdd D phid'
    A = H + dt * D.T @ (kp * dt * D + kdd * D)
    b = H @ phid + dt * (D.T @ (kp * (target - D @ phi)) - C - G)
    phid_new = np.linalg.solve(A, b)
    phi_new = phi + dt * phid_new
    return D @ phi_new, D @ phid_new


def test_tracking_substep_matches_the_documented_equations_in_float64():
    """One simulation substep (decimation 1) against numpy float64 built from the docstring's mass matrix,
    velocity term, gravity and implicit PD+damping: pins the damping, the stiffness's implicit part and the
    velocity term's sign, which the static-hold and energy tests do not see (zero velocity / no damping)."""
    env = Tracking(3, "cpu", 0, base_seed=0, num_motions=4)
    env.decimation = 1
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, generator=g) * 0.6
    qd = torch.randn(3, 6, generator=g) * 3.0
    target = torch.randn(3, 6, generator=g) * 0.5
    env.q, env.qd = q.clone(), qd.clone()
    env._simulate(target)
    for i in range(3):
        want_q, want_qd = numpy_substep(env, q[i].double().numpy(), qd[i].double().numpy(), target[i].double().numpy())
        np.testing.assert_allclose(env.q[i].double().numpy(), want_q, rtol=0, atol=1e-5)
        np.testing.assert_allclose(env.qd[i].double().numpy(), want_qd, rtol=0,
                                   atol=2e-4 * max(1, np.abs(want_qd).max()))


def test_tracking_policy_step_is_decimation_substeps_toward_the_current_clamped_action():
    """One env step = `decimation` (4) substeps of the float64 equations, all with the PD target
    clamp(action, -5, 5) of *this* step's action: not the previous one (a one-step action delay),
    not fewer substeps than the 0.02 s the motion clock advances."""
    env = Tracking(3, "cpu", 0, base_seed=0, num_motions=4, episode_length_s=100.0)
    env.reset()
    env.episode_length.zero_()
    set_reference_state(env, [0, 1, 2], [0.5, 0.7, 0.9])
    q0, qd0 = env.q.double().numpy(), env.qd.double().numpy()
    g = torch.Generator().manual_seed(3)
    env.last_action = torch.randn(3, 6, generator=g)                   # the previous step's: must not act now
    actions = env.q + 0.3 * torch.randn(3, 6, generator=g)
    actions[2, 4] = 7.0                                                  # acts as 5
    _, _, _, _, extras = env.step(actions)
    final = extras["final_obs"]["policy"].double().numpy()              # the state before any reset
    for i in range(3):
        target = np.clip(actions[i].double().numpy(), -5.0, 5.0)
        q, qd = q0[i], qd0[i]
        for _ in range(4):
            q, qd = numpy_substep(env, q, qd, target)
        np.testing.assert_allclose(final[i, :6], q, rtol=0, atol=2e-5)
        np.testing.assert_allclose(final[i, 6:12], 0.1 * qd, rtol=0, atol=2e-4)


def test_the_time_limit_in_steps_is_rounded_not_truncated():
    """--env.episode-length-s 2.3 is 115 steps of 0.02 s; in floats 2.3 / 0.02 = 114.99999999999999, which a
    truncating int() made 114."""
    assert CartPole(1, "cpu", 0, episode_length_s=2.3).max_episode_length == 115
    assert Tracking(1, "cpu", 0, base_seed=0, num_motions=2, episode_length_s=2.3).max_episode_length == 115


# ---- envs/motions.py --------------------------------------------------------------------------------

def test_sampler_counts_only_ended_failures_and_commit_adds_then_restarts_local():
    """`record` counts a failure only for an episode that ended (a failed flag on a running env is not a
    failure); `commit_global` adds the cross-rank sum to the global counts and zeroes the local ones, so the
    next sync does not count this rank's episodes twice; a checkpoint's local counts of another size are refused."""
    s = AdaptiveMotionSampler(3, uniform_floor=0.2, device="cpu")
    s.record(torch.tensor([0, 1, 2, 2]), torch.tensor([True, False, True, False]),
             torch.tensor([True, True, False, True]))
    assert s.local_counts.tolist() == [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    s.global_counts = torch.tensor([[5.0, 1.0, 0.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    s.commit_global(torch.tensor([[3.0, 4.0, 1.0], [1.0, 2.0, 0.0]], dtype=torch.float64))
    assert s.global_counts.tolist() == [[8.0, 5.0, 1.0], [3.0, 2.0, 0.0]]
    assert s.local_counts.tolist() == [[0.0] * 3, [0.0] * 3]
    rate = np.array([4 / 10, 3 / 7, 1 / 3])           # (failures + 1) / (visits + 2)
    np.testing.assert_allclose(s.probabilities().numpy(), 0.2 / 3 + 0.8 * rate / rate.sum(), rtol=1e-12)
    bad = {"global_counts": torch.zeros(2, 3, dtype=torch.float64),
           "local_counts": torch.zeros(2, 4, dtype=torch.float64)}
    with pytest.raises(ValueError, match="local_counts.*num-motions"):
        s.load_state_dict(bad)


def test_tracking_episodes_start_on_motions_the_adaptive_sampler_draws():
    """Resets (the first and a step's) draw motions with the sampler's probabilities, not uniformly. With floor 0,
    motion 2 failing 999,000 of 10^6 episodes and the others 0 of 10^6: rate_2 = 999001/1000002, rate_other =
    1/1000002, so p_2 = 999001/999004 by hand (a uniform draw gives 1/4, one favouring the easy motions ~1e-6);
    the step's 400 episodes counted on motion 0 before its resets move that by less than 1e-3."""
    n = 400
    env = Tracking(n, "cpu", 0, base_seed=0, num_motions=4, uniform_floor=0.0)
    env.sampler.global_counts = torch.tensor([[1e6] * 4, [0.0, 0.0, 999e3, 0.0]], dtype=torch.float64)
    env.reset()
    assert (env.motion_ids == 2).float().mean().item() > 0.99
    env.motion_ids.fill_(0)
    env.episode_length.fill_(env.max_episode_length - 1)                # every env times out and restarts
    env.step(torch.zeros(n, env.num_actions))
    assert (env.motion_ids == 2).float().mean().item() > 0.99


# ---- envs/cartpole.py -------------------------------------------------------------------------------

def numpy_cartpole(state: np.ndarray, force: np.ndarray, dt=0.02):
    """Barto/Sutton cart-pole (gym's equations), semi-implicit Euler, float64."""
    g, mc, mp, l = 9.8, 1.0, 0.1, 0.5
    x, xd, th, thd = state.T
    total, pml = mc + mp, mp * l
    temp = (force + pml * thd ** 2 * np.sin(th)) / total
    thacc = (g * np.sin(th) - np.cos(th) * temp) / (l * (4.0 / 3.0 - mp * np.cos(th) ** 2 / total))
    xacc = temp - pml * thacc * np.cos(th) / total
    xd = xd + dt * xacc
    thd = thd + dt * thacc
    return np.stack([x + dt * xd, xd, th + dt * thd, thd], 1)


def test_cartpole_step_matches_the_classic_equations_and_limits():
    """Dynamics against a float64 numpy cart-pole, forces from actions clipped to [-1, 1] x 10 N; terminated
    exactly where |x| > 2.4 or |theta| > 12 degrees (states placed on both sides of each limit), truncated only
    at the time limit and never together with a failure; finished envs restart in [-0.05, 0.05]^4."""
    n = 10
    env = CartPole(n, "cpu", 0, episode_length_s=1.0)          # 50 steps
    env.reset()
    deg = math.pi / 180
    state = np.array([[0.0, 0.5, 0.05, -0.3], [2.39, 3.0, 0.0, 0.0], [2.39, -3.0, 0.0, 0.0], [-2.39, -3.0, 0.0, 0.0],
                      [0.0, 0.0, 11.9 * deg, -0.4], [0.0, 0.0, 11.9 * deg, -0.5], [0.0, 0.0, -13.0 * deg, 0.0],
                      [0.0, 0.0, 14.0 * deg, 0.0], [0.1, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    actions = torch.tensor([[0.3], [5.0], [-1.0], [-0.2], [2.0], [-3.0], [0.0], [0.0], [0.0], [0.0]])
    env.state = torch.tensor(state, dtype=torch.float32)
    env.episode_length = torch.tensor([0, 0, 0, 0, 0, 0, 0, 49, 49, 48])
    obs, reward, terminated, truncated, extras = env.step(actions)
    force = 10.0 * np.clip(actions[:, 0].double().numpy(), -1, 1)
    want = numpy_cartpole(state.astype(np.float32).astype(np.float64), force)
    np.testing.assert_allclose(extras["final_obs"]["policy"].double().numpy(), want, rtol=0, atol=1e-5)
    want_term = (np.abs(want[:, 0]) > 2.4) | (np.abs(want[:, 2]) > 12 * deg)
    assert terminated.tolist() == want_term.tolist()
    assert want_term.tolist() == [False, True, False, True, False, False, True, True, False, False]
    assert truncated.tolist() == [False] * 8 + [True, False]
    assert torch.equal(reward, torch.ones(n))
    done = (terminated | truncated).numpy()
    assert obs["policy"][done].abs().max() <= 0.05 and obs["policy"][done].abs().max() > 0.02
    assert torch.equal(env.episode_length[torch.tensor(done)], torch.zeros(int(done.sum()), dtype=torch.long))
    assert env.episode_length[9].item() == 49


def test_cartpole_reset_spreads_episode_lengths_over_the_whole_limit_and_has_no_state():
    """reset draws episode_length in [0, max_episode_length) (spread over the full limit); its start states lie in
    [-0.05, 0.05]; a checkpoint with env state for cartpole is refused by name."""
    env = CartPole(512, "cpu", 0, episode_length_s=1.0)
    obs, _ = env.reset()
    assert env.episode_length.min() >= 0 and env.episode_length.max() < 50 and env.episode_length.max() >= 45
    assert obs["policy"].abs().max() <= 0.05 and obs["policy"].abs().max() > 0.045
    with pytest.raises(ValueError, match="cartpole has no checkpointed state.*sampler"):
        env.load_state_dict({"sampler": {}})
    env.load_state_dict({})


# ---- envs/gymnasium.py ------------------------------------------------------------------------------

class _Toy(gymnasium.Env):
    action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,))
    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (1,))

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {}


class _DictObs(_Toy):
    observation_space = gymnasium.spaces.Dict({"a": gymnasium.spaces.Box(-1.0, 1.0, (1,))})


def test_gymnasium_action_clip_binds_inside_the_bounds_and_bad_tasks_are_refused(monkeypatch):
    """--env.action-clip below the space's bounds is applied (Pendulum's bounds are +-2: a clip of 1.5 must
    bind); a task with a non-Box observation space, or without a time limit, is refused with its reason; an
    unknown version lists the registered ones; the adapter refuses checkpointed env state."""
    from envs.gymnasium import GymnasiumEnv
    env = GymnasiumEnv("Pendulum-v1", 1, torch.device("cpu"), seed=0, action_scale=2.0, action_clip=1.5)
    assert env.env_actions(torch.tensor([[0.9], [-0.8], [0.5]])).tolist() == [[1.5], [-1.5], [1.0]]
    with pytest.raises(ValueError, match="gymnasium envs have no checkpointed state"):
        env.load_state_dict({"x": 1})
    reg = gymnasium.envs.registration.EnvSpec
    monkeypatch.setitem(gymnasium.registry, "DictObs-v0", reg("DictObs-v0", entry_point=_DictObs, max_episode_steps=5))
    monkeypatch.setitem(gymnasium.registry, "NoLimit-v0", reg("NoLimit-v0", entry_point=_Toy))
    with pytest.raises(ValueError, match="DictObs-v0: needs a 1-D Box observation space"):
        GymnasiumEnv("DictObs-v0", 1, torch.device("cpu"), seed=0)
    with pytest.raises(ValueError, match="NoLimit-v0: has no time limit"):
        GymnasiumEnv("NoLimit-v0", 1, torch.device("cpu"), seed=0)
    with pytest.raises(ValueError, match="registered: .*Hopper-v4"):
        GymnasiumEnv("Hopper-v99", 1, torch.device("cpu"), seed=0)
