"""Tests written to kill mutants of ppo/actor_critic.py, ppo/export.py and ppo/evaluate.py that the other tests
let survive: the orthogonal init's gains and biases, and more (see each test's Mutant line)."""

import re

import numpy as np
import pytest
import torch

from ppo import evaluate as evaluation
from ppo import export
from ppo.actor_critic import ActorCritic, Gaussian
from tests.test_export import small_checkpoint


def gain(weight: torch.Tensor) -> float:
    """g for an orthogonal init W (out x in) of gain g: the smaller Gram matrix of W is g^2 times the identity."""
    w = weight.detach().double().numpy()
    gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
    g2 = gram[0, 0]
    np.testing.assert_allclose(gram, g2 * np.eye(len(gram)), atol=1e-6 * g2)
    return float(np.sqrt(g2))


def test_orthogonal_init_gives_hidden_layers_gain_sqrt2_heads_001_and_1_and_zero_biases():
    """--policy.orthogonal-init (CleanRL's layer_init): every hidden Linear of both networks orthogonal with gain
    sqrt(2), the actor head 0.01, the critic head 1.0, every bias zero (wide and narrow layers both ways).
    Mutant: the hidden layers' gain 2**0.5 -> 1.0.
    Mutant: the critic head's gain 1.0 -> 0.01."""
    torch.manual_seed(0)
    model = ActorCritic(7, 11, 3, actor_hidden=(16, 5), critic_hidden=(4, 9), orthogonal_init=True)
    for net, head in ((model.actor, 0.01), (model.critic, 1.0)):
        linears = [m for m in net if isinstance(m, torch.nn.Linear)]
        assert len(linears) == 3
        gains = [gain(layer.weight) for layer in linears]
        np.testing.assert_allclose(gains, [np.sqrt(2), np.sqrt(2), head], rtol=1e-6)
        assert all(not layer.bias.any() for layer in linears)


def normalized_by_hand(obs: torch.Tensor, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    """(obs - mean) / (std + 1e-8) clipped to [-10, 10] in float64, as float32."""
    z = (obs.double().numpy() - mean) / (std + 1e-8)
    return torch.from_numpy(np.clip(z, -10.0, 10.0)).float()


def test_actor_and_critic_read_their_observations_through_their_own_normalizers():
    """The mean action is the actor MLP of the actor-normalized observation, the value the critic MLP of the
    critic-normalized one (each normalizer with its own statistics, some observations past the clip at 10).
    Mutant: distribution() feeds the raw observation to the actor.
    Mutant: value() feeds the raw observation to the critic."""
    torch.manual_seed(0)
    model = ActorCritic(3, 4, 2, actor_hidden=(8,), critic_hidden=(8,), normalize_actor_obs=True)
    stats = {"actor_normalizer": (np.array([1.0, -2.0, 0.5]), np.array([0.5, 2.0, 4.0])),
             "critic_normalizer": (np.array([3.0, 0.0, -1.0, 2.0]), np.array([1.5, 0.25, 3.0, 0.1]))}
    for name, (mean, std) in stats.items():
        getattr(model, name).mean.copy_(torch.from_numpy(mean))
        getattr(model, name).std.copy_(torch.from_numpy(std))
    g = torch.Generator().manual_seed(1)
    xa, xc = torch.randn(16, 3, generator=g) * 5, torch.randn(16, 4, generator=g) * 5
    with torch.no_grad():
        expected_mean = model.actor(normalized_by_hand(xa, *stats["actor_normalizer"]))
        expected_value = model.critic(normalized_by_hand(xc, *stats["critic_normalizer"]))[:, 0]
        torch.testing.assert_close(model.distribution(xa).mean, expected_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.value(xc), expected_value, rtol=1e-5, atol=1e-6)


# ---- ppo/evaluate.py against a scripted env ------------------------------------------------------------------------

class ScriptedEnv:
    """Two envs whose episodes last the given numbers of steps, whatever the actions: the k-th step of an episode
    rewards k, an episode of max_episode_length steps is a time-out (truncated), a shorter one a failure."""

    def __init__(self, episodes: list[list[int]], limit=4, num_actions: int = 3):
        self.episodes, self.max_episode_length, self.num_actions = episodes, limit, num_actions
        self.num_envs, self.device, self.obs_dims = len(episodes), torch.device("cpu"), {"policy": 5, "critic": 6}
        self.step_in_episode, self.episode = [0] * self.num_envs, [0] * self.num_envs

    def observe(self):
        return {"policy": torch.zeros(self.num_envs, 5), "critic": torch.zeros(self.num_envs, 6)}

    def reset(self):
        return self.observe(), {"log": {}}

    def step(self, actions):
        assert actions.shape == (self.num_envs, 3)
        reward, terminated, truncated = torch.zeros(self.num_envs), [False] * self.num_envs, [False] * self.num_envs
        for i in range(self.num_envs):
            self.step_in_episode[i] += 1
            reward[i] = self.step_in_episode[i]
            if self.step_in_episode[i] == self.episodes[i][self.episode[i]]:
                truncated[i] = self.step_in_episode[i] == self.max_episode_length
                terminated[i] = not truncated[i]
                self.step_in_episode[i], self.episode[i] = 0, self.episode[i] + 1
        return (self.observe(), reward, torch.tensor(terminated), torch.tensor(truncated),
                {"final_obs": self.observe(), "log": {}})


def scripted_evaluation(tmp_path, monkeypatch, env, **kwargs):
    path = small_checkpoint(tmp_path / "model_3.pt", env={"name": "cartpole"})
    monkeypatch.setattr(evaluation, "make_env", lambda *args: env)
    notes = []
    return evaluation.evaluate(path, progress=notes.append, **kwargs), notes


def test_evaluate_scores_the_whole_episodes_after_each_envs_first_and_notes_nothing_when_all_finished(
        tmp_path, monkeypatch):
    """Env 0's episodes last 3, 2, 4 (a time-out), 1 steps, env 1's 1, 3, 4 (a time-out), 2: with 4 episodes on 2
    envs each env counts its 2nd and 3rd, lengths 2, 4, 3, 4, returns 1+2, 1+..+4, 1+2+3, 1+..+4 = 3, 10, 6, 10,
    and, every counted episode having finished, no note about the step cap.
    Mutant: the step-cap note printed when every episode finished (`<` -> `<=`)."""
    env = ScriptedEnv([[3, 2, 4, 1, 4, 4], [1, 3, 4, 2, 4, 4]])
    scores, notes = scripted_evaluation(tmp_path, monkeypatch, env, episodes=4, num_envs=2)
    r, n = np.array([3.0, 10.0, 6.0, 10.0]), np.array([2.0, 4.0, 3.0, 4.0])
    assert scores == pytest.approx({"episodes": 4, "return_mean": r.mean(), "return_std": r.std(), "return_min": 3.0,
                                    "return_max": 10.0, "length_mean": n.mean(), "length_std": n.std()}, rel=1e-12)
    assert notes == []


def test_evaluate_refuses_an_env_whose_time_limit_is_zero_naming_the_limit(tmp_path, monkeypatch):
    """max_episode_length 0 is no time limit: refused as such, not run for (quota + 1) * 0 steps and then blamed on
    episodes that never ended.
    Mutant: the limit's check `limit < 1` -> `limit < 0`."""
    with pytest.raises(ValueError, match=r"has no time limit \(max_episode_length 0\), so an episode may never end"):
        scripted_evaluation(tmp_path, monkeypatch, ScriptedEnv([[1], [1]], limit=0), episodes=2, num_envs=2)


def test_evaluate_refuses_a_policy_with_another_number_of_actions_than_the_env(tmp_path, monkeypatch):
    """The policy writes 3 actions, the env takes 2: refused by name before any step (the observation sizes agree).
    Mutant: the action size left out of the size check."""
    with pytest.raises(ValueError, match=r"its policy's action size 3 \(the env's: 2\) does not fit the cartpole env"):
        scripted_evaluation(tmp_path, monkeypatch, ScriptedEnv([[1], [1]], num_actions=2), episodes=2, num_envs=2)


@pytest.mark.parametrize("kwargs, said", [
    ({"seed": 2**32}, "--seed must be an integer in [0, 4294967296), got 4294967296"),
    ({"seed": -1}, "--seed must be an integer in [0, 4294967296), got -1"),
    ({"episodes": 0}, "--episodes must be an integer in [1, inf), got 0"),
    ({"num_envs": True}, "--num-envs must be an integer in [1, inf), got True"),
    ({"seed": 2**32 - 1, "episodes": 1, "num_envs": 1}, "no such checkpoint file"),    # in range: the path is next
])
def test_evaluate_checks_its_counts_and_seed_at_their_bounds_before_the_checkpoint(tmp_path, kwargs, said):
    """--seed takes [0, 2**32) (2**32 - 1 passes, 2**32 does not), the counts [1, inf), no bool, all before the
    checkpoint path is looked at.
    Mutant: the seed's upper bound `value >= high` -> `value > high`."""
    with pytest.raises(ValueError, match=re.escape(said)):
        evaluation.evaluate(str(tmp_path / "missing.pt"), **kwargs)


def test_export_refuses_a_fork_whose_actions_differ_only_off_the_zero_observation(tmp_path, monkeypatch):
    """Without an actor normalizer, an encoder x + 0.5 tanh(x) before the actor MLP leaves the zero observation as it
    is: the check that the exported actor gives distribution(obs).mean must look at other observations too, and refuse
    before writing anything.
    Mutant: check_same_actions' observations `randn * 3` -> `randn * 0`."""
    path = small_checkpoint(tmp_path / "model_3.pt", normalize_actor_obs=False)

    def with_encoder(self, obs):
        return Gaussian(self.actor(obs + 0.5 * obs.tanh()), self.log_std)
    monkeypatch.setattr(ActorCritic, "distribution", with_encoder)
    with pytest.raises(ValueError, match=r"does not give the model's mean action"):
        export.export(path, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
