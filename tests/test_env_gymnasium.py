"""The gymnasium adapter on real gymnasium/MuJoCo envs: its autoreset, final observations, time-outs and float32
rewards against single envs stepped by hand, then a short real training run."""

import re
import sys

import gymnasium
import numpy as np
import pytest
import torch

import envs.gymnasium
import train
from configs import preset, validate
from dist.errors import UsageError
from dist.grad_sync import GradSync
from envs.base import MissingSimulator
from envs.gymnasium import GymnasiumEnv
from ppo.normalizer import RewardNormalizer
from ppo.storage import RolloutStorage
from ppo.update import ppo_update
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg

pytestmark = pytest.mark.filterwarnings("ignore:.*is out of date:DeprecationWarning")


def recording_seeds(env: GymnasiumEnv) -> list:
    """Record the seeds the adapter passes to the vector env's reset."""
    calls, reset = [], env.env.reset
    env.env.reset = lambda **kwargs: (calls.append(kwargs["seed"]), reset(**kwargs))[1]
    return calls


@pytest.mark.parametrize("task, expect", [("Hopper-v4", "terminated"), ("Pendulum-v1", "truncated")])
def test_steps_like_single_envs_stepped_by_hand(task, expect):
    num_envs, steps = 3, 420                         # Pendulum times out after 200 steps; Hopper falls much sooner
    env = GymnasiumEnv(task, num_envs, torch.device("cpu"), seed=5)
    seeds = recording_seeds(env)
    obs, _ = env.reset()
    singles = [gymnasium.make(task) for _ in range(num_envs)]
    hand_obs = [single.reset(seed=seed)[0] for single, seed in zip(singles, seeds[0])]
    actions = 2.5 * torch.randn(steps, num_envs, env.num_actions, generator=torch.Generator().manual_seed(0))
    counts = {"terminated": 0, "truncated": 0}
    f32 = lambda array: torch.as_tensor(np.asarray(array), dtype=torch.float32)  # noqa: E731
    torch.testing.assert_close(obs["policy"], f32(hand_obs), rtol=0, atol=0)
    for t in range(steps):
        obs, reward, terminated, truncated, extras = env.step(actions[t])
        for i, single in enumerate(singles):
            low, high = single.action_space.low, single.action_space.high
            hand_action = np.clip(actions[t, i].numpy(), low, high).astype(single.action_space.dtype)
            final, hand_reward, hand_terminated, hand_truncated, _ = single.step(hand_action)
            hand_obs[i] = single.reset()[0] if hand_terminated or hand_truncated else final
            assert terminated[i].item() == hand_terminated
            assert truncated[i].item() == (hand_truncated and not hand_terminated)
            assert reward[i].item() == pytest.approx(hand_reward, rel=1e-6)
            # The returned obs already starts the next episode; final_obs is where the finished one ended.
            torch.testing.assert_close(obs["policy"][i], f32(hand_obs[i]), rtol=0, atol=0)
            torch.testing.assert_close(extras["final_obs"]["critic"][i], f32(final), rtol=0, atol=0)
        counts["terminated"] += int(terminated.sum())
        counts["truncated"] += int(truncated.sum())
    assert counts[expect] >= num_envs


class FallsAtTheTimeLimit(gymnasium.Env):
    """Terminates on its 3rd step, which is also where its time limit truncates it."""

    observation_space = gymnasium.spaces.Box(-10.0, 10.0, (1,))
    action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,))

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(1, self.t, dtype=np.float32), 1.0, self.t == 3, False, {}


def test_a_failure_at_the_time_limit_is_a_failure(monkeypatch):
    monkeypatch.setitem(gymnasium.registry, "FallsAtTheTimeLimit-v0", gymnasium.envs.registration.EnvSpec(
        "FallsAtTheTimeLimit-v0", entry_point=FallsAtTheTimeLimit, max_episode_steps=3))
    env = GymnasiumEnv("FallsAtTheTimeLimit-v0", 2, torch.device("cpu"), seed=0)
    env.reset()
    for _ in range(2):
        env.step(torch.zeros(2, 1))
    obs, _, terminated, truncated, extras = env.step(torch.zeros(2, 1))
    assert terminated.all() and not truncated.any()           # gymnasium's TimeLimit flagged both
    assert extras["final_obs"]["policy"].tolist() == [[3.0], [3.0]] and obs["policy"].tolist() == [[0.0], [0.0]]


def test_actions_are_scaled_clipped_then_held_inside_the_bounds():
    env = GymnasiumEnv("Pendulum-v1", 1, torch.device("cpu"), seed=0, action_scale=2.0, action_clip=3.0)
    actions = torch.tensor([[0.5], [1.2], [-1.7], [-0.3]])
    # x2, then clip to [-3, 3], then Pendulum's torque bounds [-2, 2]
    assert torch.equal(env.env_actions(actions), torch.tensor([[1.0], [2.0], [-2.0], [-0.6]]))
    # a clip inside the bounds is what holds: x1, then clip to [-1.5, 1.5] (Pendulum's [-2, 2] no longer binds)
    env = GymnasiumEnv("Pendulum-v1", 1, torch.device("cpu"), seed=0, action_scale=1.0, action_clip=1.5)
    actions = torch.tensor([[1.8], [-1.9], [0.7], [2.5]])
    assert torch.equal(env.env_actions(actions), torch.tensor([[1.5], [-1.5], [0.7], [1.5]]))


def test_sub_envs_get_distinct_seeds_and_a_seed_replays_exactly():
    seeds, rollouts = [], []
    for seed in (1, 1, 2):
        env = GymnasiumEnv("Hopper-v4", 4, torch.device("cpu"), seed=seed)
        recorded = recording_seeds(env)
        obs, _ = env.reset()
        trajectory = [obs["policy"]]
        for _ in range(50):
            trajectory.append(env.step(torch.full((4, 3), 0.3))[0]["policy"])
        seeds.append(recorded[0])
        rollouts.append(torch.stack(trajectory))
    assert seeds[0] == seeds[1] and torch.equal(rollouts[0], rollouts[1])
    assert len(set(seeds[0]) | set(seeds[2])) == 8           # two envs' seeds never share a sub-env seed
    # Seeds come from the generator's current state (restored by --resume): a later reset does not replay the first.
    env = GymnasiumEnv("Pendulum-v1", 2, torch.device("cpu"), seed=1)
    recorded, state = recording_seeds(env), env.generator.get_state()
    env.reset(), env.reset(), env.generator.set_state(state), env.reset()
    assert recorded[0] != recorded[1] and recorded[2] == recorded[0]


class Float64Bounds(gymnasium.Env):
    """Actions in a float64 Box [-0.3, 0.3]; records what it receives."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (1,))
    action_space = gymnasium.spaces.Box(-0.3, 0.3, (2,), dtype=np.float64)
    received: list = []

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, dtype=np.float32), {}

    def step(self, action):
        Float64Bounds.received.append(action)
        return np.zeros(1, dtype=np.float32), 0.0, False, False, {}


def test_actions_stay_inside_a_float64_space_exactly(monkeypatch):
    """The bound 0.3 rounded to float32 is 0.30000001: clipped to that, the action lies just outside the space.
    Clipped to the float64 bounds, it is 0.3 and -0.3 exactly, in the space's dtype."""
    monkeypatch.setitem(gymnasium.registry, "Float64Bounds-v0", gymnasium.envs.registration.EnvSpec(
        "Float64Bounds-v0", entry_point=Float64Bounds, max_episode_steps=5))
    monkeypatch.setattr(Float64Bounds, "received", [])
    env = GymnasiumEnv("Float64Bounds-v0", 1, torch.device("cpu"), seed=0)
    assert [a.tolist() for a in Float64Bounds.received] == [[0.0, 0.0]]    # the build's probe step
    Float64Bounds.received.clear()
    env.reset()
    env.step(torch.tensor([[5.0, -5.0]]))
    (action,) = Float64Bounds.received
    assert action.dtype == np.float64 and action.tolist() == [0.3, -0.3]
    assert env.env.single_action_space.contains(action)


def test_bad_tasks_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown --env.task 'Hoper-v4'"):
        GymnasiumEnv("Hoper-v4", 1, torch.device("cpu"), seed=0)
    with pytest.raises(ValueError, match=r"unknown --env.task 'hopper-v4' for gymnasium; registered: .*Hopper-v4"):
        GymnasiumEnv("hopper-v4", 1, torch.device("cpu"), seed=0)          # case: no suggestion before
    with pytest.raises(MissingSimulator, match=r"^--env.task Hopper-v3: The mujoco v2 and v3 based environments have "
                                               r"been moved to the gymnasium-robotics project [^;]*$"):
        GymnasiumEnv("Hopper-v3", 1, torch.device("cpu"), seed=0)          # gymnasium's ImportError, no mujoco hint
    with pytest.raises(ValueError, match="CartPole-v1: needs a 1-D continuous"):
        GymnasiumEnv("CartPole-v1", 1, torch.device("cpu"), seed=0)



def spaced(action_space, observation_space):
    """An env class with these spaces, whose observations have the declared shape."""
    class Spaced(gymnasium.Env):
        def reset(self, seed=None, options=None):
            super().reset(seed=seed)
            return np.zeros(observation_space.shape, dtype=np.float32), {}

        def step(self, action):
            return np.zeros(observation_space.shape, dtype=np.float32), 0.0, False, False, {}
    Spaced.action_space, Spaced.observation_space = action_space, observation_space
    return Spaced


BOX2 = gymnasium.spaces.Box(-1.0, 1.0, (2,))


@pytest.mark.parametrize("action_space, observation_space, steps, said", [
    (gymnasium.spaces.Box(-1, 1, (2,), dtype=np.int64), BOX2, 5, "needs a 1-D continuous (Box) action space"),
    (BOX2, gymnasium.spaces.Box(-1.0, 1.0, (2, 2)), 5, "needs a 1-D Box observation space"),
    (BOX2, BOX2, None, "has no time limit (max_episode_steps); PPO rollouts need one")],
    ids=["integer-actions", "2d-observation", "no-time-limit"])
def test_spaces_and_tasks_without_a_time_limit_are_refused_by_name(monkeypatch, action_space, observation_space, steps,
                                                                  said):
    """An integer Box is discrete (actions would be cast), a 2-D observation is no [num_envs, width] input, and a task
    without max_episode_steps never times out: each is one ValueError while built."""
    monkeypatch.setitem(gymnasium.registry, "Spaced-v0", gymnasium.envs.registration.EnvSpec(
        "Spaced-v0", entry_point=spaced(action_space, observation_space), max_episode_steps=steps))
    with pytest.raises(ValueError, match=re.escape(f"--env.task Spaced-v0: {said}")):
        GymnasiumEnv("Spaced-v0", 2, torch.device("cpu"), seed=0)
    if steps is not None:           # the same spaces otherwise fine build: the refusal is the space's
        ok = gymnasium.envs.registration.EnvSpec("Spaced-v0", entry_point=spaced(BOX2, BOX2), max_episode_steps=steps)
        monkeypatch.setitem(gymnasium.registry, "Spaced-v0", ok)
        assert GymnasiumEnv("Spaced-v0", 2, torch.device("cpu"), seed=0).obs_dims == {"policy": 2, "critic": 2}


LAB_ROBOTS = """
import gymnasium
import numpy as np


class Reach(gymnasium.Env):
    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (5,))
    action_space = gymnasium.spaces.Box(-1.0, 1.0, (2,))

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(5, dtype=np.float32), {}

    def step(self, action):
        return np.zeros(5, dtype=np.float32), 0.0, False, False, {}


gymnasium.register("LabReach-v0", entry_point=Reach, max_episode_steps=7)
"""


def test_a_task_of_another_package_is_written_module_colon_task_id(monkeypatch, tmp_path):
    """gymnasium's `module:TaskId` imports the module that registers the task (gymnasium-robotics, a lab's own
    robots); it was refused as an unknown task, the registry looked up before anything imported the module."""
    (tmp_path / "lab_robots.py").write_text(LAB_ROBOTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        env = GymnasiumEnv("lab_robots:LabReach-v0", 2, torch.device("cpu"), seed=0)
        assert (env.num_actions, env.obs_dims["policy"], env.max_episode_length) == (2, 5, 7)
        with pytest.raises(ValueError, match=r"^unknown --env.task 'lab_robots:Xyzzy-v0' for gymnasium; importing "
                                             r"lab_robots registered no such task$"):
            GymnasiumEnv("lab_robots:Xyzzy-v0", 1, torch.device("cpu"), seed=0)
    finally:
        gymnasium.registry.pop("LabReach-v0", None)
        sys.modules.pop("lab_robots", None)
    with pytest.raises(MissingSimulator, match=r"^--env.task no_lab:Reach-v0: cannot import no_lab \(No module named "
                                               r"'no_lab'\); install the package that registers Reach-v0"):
        GymnasiumEnv("no_lab:Reach-v0", 1, torch.device("cpu"), seed=0)
    with pytest.raises(ValueError, match=r"^unknown --env.task 'Xyzzy-v0' for gymnasium; a task of another package "
                                         r"is written module:TaskId \(e.g. gymnasium_robotics:AdroitHandDoor-v1\)"):
        GymnasiumEnv("Xyzzy-v0", 1, torch.device("cpu"), seed=0)             # no close match: the way out


def test_missing_gymnasium_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)       # what an absent package looks like to import
    with pytest.raises(ImportError, match="make setup-mujoco"):
        envs.gymnasium.import_gymnasium()
    with pytest.raises(ValueError, match="needs the gymnasium package.*make setup-mujoco"):
        validate(preset("mujoco"))


def test_a_task_missing_its_simulator_names_the_install_command(monkeypatch):
    def needs_mujoco(**kwargs):
        raise gymnasium.error.DependencyNotInstalled("MuJoCo is not installed")

    monkeypatch.setitem(gymnasium.registry, "NeedsMujoco-v0", gymnasium.envs.registration.EnvSpec(
        "NeedsMujoco-v0", entry_point=needs_mujoco, max_episode_steps=10))
    with pytest.raises(ImportError, match="NeedsMujoco-v0: MuJoCo is not installed; make setup-mujoco"):
        GymnasiumEnv("NeedsMujoco-v0", 1, torch.device("cpu"), seed=0)


def test_a_task_missing_another_simulator_is_one_line_from_the_cli_without_the_mujoco_hint(monkeypatch, tmp_path,
                                                                                          capsys):
    """gymnasium's own message says what to install (Box2D here); train.py caught only ValueError from the env build,
    so this was a traceback, and the hint named make setup-mujoco whatever was missing."""
    message = 'Box2D is not installed, run `pip install "gymnasium[box2d]"`'

    def needs_box2d(**kwargs):
        raise gymnasium.error.DependencyNotInstalled(message)

    monkeypatch.setitem(gymnasium.registry, "NeedsBox2d-v0", gymnasium.envs.registration.EnvSpec(
        "NeedsBox2d-v0", entry_point=needs_box2d, max_episode_steps=10))
    cfg = preset("mujoco")
    cfg.env.task, cfg.dry_run, cfg.log.root = "NeedsBox2d-v0", True, str(tmp_path)
    assert train.cli(cfg) == 2
    assert capsys.readouterr().err == f"error: --env.task NeedsBox2d-v0: {message}\n"


@pytest.mark.parametrize("index", [0, 1])
def test_a_rollout_rank_missing_a_simulator_package_says_so_once(monkeypatch, index):
    """With rollout ranks no learner builds an env: the first rollout rank says it (a UsageError that only it
    prints); an ImportError there was a traceback on every rollout rank. A message over several lines is said on one."""
    import types

    import rollout_ranks

    def missing(*args, **kwargs):
        raise MissingSimulator("--env.task NeedsBox2d-v0: Box2D is not installed\n  pip install box2d\n")

    monkeypatch.setattr(rollout_ranks, "make_env", missing)
    roles = types.SimpleNamespace(rollout_index=index, team=[0])
    with pytest.raises(UsageError) as exc:
        rollout_ranks.run_rollout_rank(preset("mujoco"), roles, torch.device("cpu"), None, 0)
    assert str(exc.value) == "--env.task NeedsBox2d-v0: Box2D is not installed pip install box2d"
    assert exc.value.say_here == (index == 0)

    def broken(*args, **kwargs):     # an import inside an env's own code failing: a bug, not a missing package
        raise ImportError("cannot import name 'thing' from 'task_module'")

    monkeypatch.setattr(rollout_ranks, "make_env", broken)
    with pytest.raises(ImportError, match="cannot import name 'thing'"):      # not made a UsageError (a ValueError)
        rollout_ranks.run_rollout_rank(preset("mujoco"), roles, torch.device("cpu"), None, 0)


def test_mujoco_preset_is_cleanrl_ppo_continuous_action():
    cfg = preset("mujoco")
    assert (cfg.env.name, cfg.env.task, cfg.env.num_envs, cfg.ppo.num_steps) == ("gymnasium", "Hopper-v4", 1, 2048)
    assert cfg.max_iterations * cfg.ppo.num_steps * cfg.env.num_envs == 1_000_000 // 2048 * 2048
    assert (cfg.ppo.num_mini_batches, cfg.ppo.minibatch_unit, cfg.ppo.num_epochs) == (32, "transition", 10)
    assert (cfg.ppo.learning_rate, cfg.ppo.schedule, cfg.ppo.gamma, cfg.ppo.lam) == (3e-4, "linear", 0.99, 0.95)
    assert (cfg.ppo.clip_param, cfg.ppo.clip_value_loss) == (0.2, True)
    assert (cfg.ppo.entropy_coef, cfg.ppo.max_grad_norm) == (0.0, 0.5)
    assert cfg.ppo.value_loss_coef == 0.25                     # CleanRL's 0.5 x its inner 0.5
    assert cfg.ppo.normalize_rewards and not cfg.ppo.bootstrap_time_outs
    assert (cfg.ppo.adam_eps, cfg.ppo.reward_clip, cfg.ppo.advantage_norm) == (1e-5, 10.0, "minibatch")
    assert cfg.log.episode_returns                             # CleanRL's statistic needs every episode's return
    assert (cfg.policy.actor_hidden, cfg.policy.critic_hidden, cfg.policy.activation) == ((64, 64), (64, 64), "tanh")
    assert cfg.policy.orthogonal_init and cfg.policy.normalize_actor_obs and cfg.policy.normalize_critic_obs
    assert cfg.policy.init_noise_std == 1.0                    # state-independent std starting at 1
    validate(cfg)


def test_reward_normalizer_clips_after_scaling():
    normalizer = RewardNormalizer(num_envs=3, gamma=0.9, clip=10.0)
    not_done = torch.zeros(3, dtype=torch.bool)
    first, second = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.5, 1.0, -1.0])
    normalizer(first, not_done)
    normalizer(second, not_done)
    normalizer.update()
    std = np.concatenate([first.numpy(), 0.9 * first.numpy() + second.numpy()]).astype(np.float64).std()
    reward = torch.tensor([1000.0, -1000.0, 0.1])
    expected = np.clip(reward.numpy() / (std + 1e-8), -10.0, 10.0)
    np.testing.assert_allclose(normalizer(reward, not_done).numpy(), expected, rtol=1e-6)
    assert expected[0] == 10.0 and expected[1] == -10.0 and abs(expected[2]) < 10.0


def update_with(advantage_norm: str, prepare=lambda storage: None) -> dict:
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, torch.device("cpu"))
    fill(storage, 0, model)
    prepare(storage)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    cfg = ppo_cfg(num_epochs=1, num_mini_batches=2, minibatch_unit="transition", advantage_norm=advantage_norm)
    ppo_update(model, optimizer, storage, GradSync(list(model.parameters()), num_extras=2), cfg,
               generator=torch.Generator().manual_seed(7))
    return model.state_dict()


def test_minibatch_advantage_normalization_is_cleanrls():
    def normalize_each_minibatch_by_hand(storage):
        # The same permutation the update draws; each half normalized in numpy with torch.std's ddof 1.
        perm = torch.randperm(T * N, generator=torch.Generator().manual_seed(7)).numpy()
        adv = storage.advantages.flatten().numpy().astype(np.float64)
        for ids in np.split(perm, 2):
            adv[ids] = (adv[ids] - adv[ids].mean()) / (adv[ids].std(ddof=1) + 1e-8)
        storage.advantages = torch.tensor(adv, dtype=torch.float32).view(T, N)

    state = update_with("minibatch")
    oracle = update_with("none", normalize_each_minibatch_by_hand)
    for key in state:
        torch.testing.assert_close(state[key], oracle[key], rtol=1e-5, atol=1e-6, msg=key)
    rollout_wide = update_with("local")        # guards the oracle: normalizing the whole rollout differs
    assert max((state[k] - rollout_wide[k]).abs().max().item() for k in state if k.startswith("actor.")) > 1e-5


def test_a_gymnasium_reward_is_float32():
    """Mutant: the reward handed on as gymnasium's float64 array. The protocol (envs/base.py) says float32."""
    env = GymnasiumEnv("Pendulum-v1", 2, torch.device("cpu"), seed=0)
    env.reset()
    _, reward, _, _, _ = env.step(torch.zeros(2, 1))
    assert reward.dtype == torch.float32 and reward.shape == (2,)
