"""The `mujoco` preset's env pipeline against CleanRL's (ppo_continuous_action wraps each env in gymnasium's
RecordEpisodeStatistics, ClipAction, NormalizeObservation, NormalizeReward, ...): gymnasium's own wrappers are the
oracle, fed the same actions or rewards as the adapter and the learner's normalizers. docs/simulators.md lists what
differs on purpose; these tests pin both what agrees and the documented differences, by number."""

import gymnasium
import numpy as np
import pytest
import torch

from envs.gymnasium import GymnasiumEnv
from ppo.normalizer import ObsNormalizer, RewardNormalizer
from ppo.rollout import TRAIN_KEYS, EpisodeStats

pytestmark = pytest.mark.filterwarnings("ignore:.*is out of date:DeprecationWarning")


def cleanrl_env(task: str, gamma: float):
    """CleanRL's wrapper stack, in its order, from gymnasium's wrappers (FlattenObservation is a no-op here)."""
    env = gymnasium.wrappers.RecordEpisodeStatistics(gymnasium.make(task))
    env = gymnasium.wrappers.NormalizeObservation(gymnasium.wrappers.ClipAction(env))
    env = gymnasium.wrappers.TransformObservation(env, lambda o: np.clip(o, -10, 10), env.observation_space)
    env = gymnasium.wrappers.NormalizeReward(env, gamma=gamma)
    return gymnasium.wrappers.TransformReward(env, lambda r: np.clip(r, -10, 10))


def wrapper(env, kind):
    while not isinstance(env, kind):
        env = env.env
    return env


def test_raw_episode_returns_and_observation_statistics_match_cleanrls_wrappers():
    """Mutant: `env_actions` without its final clamp to the action space's bounds (CleanRL's ClipAction): Hopper's
    control cost reads the unclipped action, so every return differs.
    Mutant: `EpisodeStats.step` adds the reward after `episode_return *= ~done` (its last reward goes to the next).
    Hopper-v4 with actions N(0, 1.5), often outside [-1, 1], from the same seed: the adapter's raw episode returns
    (Train/mean_reward, Episode/return) equal RecordEpisodeStatistics' (charts/episodic_return). The observation
    normalizer's statistics over the steps' observations equal NormalizeObservation's once each finished episode's
    final observation is added (CleanRL's wrapper sees it before the reset; the learner's normalizer does not),
    and differ by several % of a std without them (the documented difference)."""
    steps, seed = 600, 5
    ours = GymnasiumEnv("Hopper-v4", 1, torch.device("cpu"), seed=seed)
    obs, _ = ours.reset()
    reset_seed = torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(seed)).tolist()
    theirs = gymnasium.vector.SyncVectorEnv([lambda: cleanrl_env("Hopper-v4", 0.99)],
                                            autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP)
    theirs.reset(seed=reset_seed)
    actions = np.random.default_rng(0).normal(0.0, 1.5, (steps, 1, 3)).astype(np.float32)
    assert (np.abs(actions) > 1).mean() > 0.4
    stats = EpisodeStats(1, TRAIN_KEYS, "cpu")
    seen, finals, cleanrl_returns = [obs["policy"]], [], []
    for t in range(steps):
        obs, reward, terminated, truncated, extras = ours.step(torch.as_tensor(actions[t]))
        *_, info = theirs.step(actions[t])
        done = terminated | truncated
        stats.step(reward, done, {}, True)
        if "final_info" in info and info["final_info"]["_episode"][0]:
            cleanrl_returns.append(float(info["final_info"]["episode"]["r"][0]))
        finals += list(extras["final_obs"]["policy"][done])
        seen.append(obs["policy"])
    returns = [r for r in torch.cat(stats.ended).tolist() if r == r]
    assert len(returns) == len(cleanrl_returns) > 20
    np.testing.assert_allclose(returns, cleanrl_returns, rtol=1e-5, atol=1e-4)

    rms = wrapper(theirs.envs[0], gymnasium.wrappers.NormalizeObservation).obs_rms
    for extra, close in ((finals, True), ([], False)):
        samples = torch.cat(seen + [torch.stack(extra)] if extra else seen).double()   # every observation returned
        normalizer = ObsNormalizer(samples.shape[1])
        normalizer.set_first_shift(samples)
        normalizer.update(samples)
        if close:
            assert normalizer.count.item() == pytest.approx(rms.count, abs=1e-3)   # gymnasium's count starts at 1e-4
        worst = np.abs(normalizer.mean64.numpy() - rms.mean).max() / np.sqrt(rms.var).min()
        assert (worst < 1e-3) == close, worst


def test_reward_normalizer_records_returns_in_gym_021s_order_not_gymnasium_1s():
    """Mutant: `self.returns.mul_(done.logical_not())` before the reward is added (the return restarts before the
    step that ended the episode, gymnasium's order but at time-outs too).
    Mutant: no restart at all (that line removed).
    The running discounted return the statistics are computed from, step by step, beside gymnasium 1.x's
    NormalizeReward (CleanRL's) on the same rewards, gamma 0.5: equal until the first episode end; at a termination
    ours records the whole return and restarts after it, gymnasium's restarts before the terminal reward (it records
    3.0, then carries 0.5 * 3.0 into the next episode); at a time-out ours restarts, gymnasium's does not. These are
    docs/simulators.md's numbers."""

    class Scripted(gymnasium.Env):
        observation_space = gymnasium.spaces.Box(-1.0, 1.0, (1,))
        action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,))

        def __init__(self):
            self.t = 0

        def reset(self, seed=None, options=None):
            return np.zeros(1, np.float32), {}

        def step(self, action):
            self.t += 1
            return np.zeros(1, np.float32), float(self.t), self.t == 3, self.t == 5, {}

    theirs = gymnasium.wrappers.NormalizeReward(Scripted(), gamma=0.5)
    theirs.reset()
    ours = RewardNormalizer(num_envs=1, gamma=0.5, clip=10.0)
    recorded_theirs = []
    for t in range(1, 8):           # rewards 1..7; terminated at step 3, timed out at step 5
        theirs.step(np.zeros(1, np.float32))
        recorded_theirs.append(np.asarray(theirs.discounted_reward).item())
        ours(torch.tensor([float(t)]), torch.tensor([t in (3, 5)]))
    recorded_ours = torch.cat(ours._seen).tolist()
    assert recorded_theirs == [1.0, 2.5, 3.0, 5.5, 7.75, 9.875, 11.9375]
    assert recorded_ours == [1.0, 2.5, 4.25, 4.0, 7.0, 6.0, 10.0]
