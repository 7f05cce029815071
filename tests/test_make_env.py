"""envs/__init__.py's make_env: it builds the env that --env.name names and hands it every setting of its EnvConfig
(episode length, seeds, motion library size and sampling floor, action scale/clip, observation groups, launcher
flags, task overrides), and refuses an unknown name. Expected values are computed here by hand."""

import sys

import gymnasium
import pytest
import torch

import envs.isaaclab
from configs.config import EnvConfig
from envs import CartPole, GymnasiumEnv, IsaacLabEnv, Tracking, make_env
from envs.motions import MotionLibrary
from tests.fake_isaaclab import TASK, Record, fake_modules, spec

CPU = torch.device("cpu")


def test_make_env_cartpole_gets_its_episode_length_and_rank_seed():
    env = make_env(EnvConfig(name="cartpole", num_envs=3, episode_length_s=2.0), CPU, seed=5, base_seed=11)
    assert type(env) is CartPole and env.num_envs == 3
    assert env.max_episode_length == 100                       # 2.0 s / 0.02 s
    assert env.generator.initial_seed() == 5


def test_make_env_tracking_gets_every_setting_and_both_seeds():
    cfg = EnvConfig(name="tracking", num_envs=4, episode_length_s=3.0, num_motions=7, sampling_uniform_floor=0.35)
    env = make_env(cfg, CPU, seed=5, base_seed=11)
    assert type(env) is Tracking and env.num_envs == 4
    assert env.max_episode_length == 150                       # 3.0 s / (0.005 s x 4)
    assert env.generator.initial_seed() == 5                   # per rank
    assert env.sampler.uniform_floor == 0.35 and env.sampler.global_counts.shape == (2, 7)
    library = MotionLibrary(7, env.num_joints, 11, CPU)        # shared by every rank: from base_seed
    assert env.motions.duration.shape == (7,)
    torch.testing.assert_close(env.motions.sines, library.sines, rtol=0, atol=0)
    other_rank = make_env(cfg, CPU, seed=6, base_seed=11)
    torch.testing.assert_close(other_rank.motions.sines, env.motions.sines, rtol=0, atol=0)


def test_make_env_gymnasium_gets_task_action_scale_clip_and_rank_seed():
    cfg = EnvConfig(name="gymnasium", task="Pendulum-v1", num_envs=2, action_scale=0.5, action_clip=1.5)
    env = make_env(cfg, CPU, seed=5, base_seed=11)
    try:
        assert type(env) is GymnasiumEnv and env.num_envs == 2 and env.env.spec.id == "Pendulum-v1"
        assert env.action_scale == 0.5 and env.action_clip == 1.5
        assert env.generator.initial_seed() == 5
        # Pendulum's bounds are +-2: 4 x 0.5 = 2 is clipped to 1.5, -1 x 0.5 passes.
        torch.testing.assert_close(env.env_actions(torch.tensor([[4.0], [-1.0]])), torch.tensor([[1.5], [-0.5]]))
    finally:
        env.env.close()


def test_make_env_isaaclab_gets_groups_actions_launcher_flags_overrides_and_rank_seed(monkeypatch):
    record = Record()
    modules = fake_modules(record)
    launcher_flags = []
    fake_launch = modules["isaaclab.app"].launch_simulation

    def launch_simulation(cfg, launcher_args=None):
        launcher_flags.append(vars(launcher_args).copy())
        return fake_launch(cfg, launcher_args)

    modules["isaaclab.app"].launch_simulation = launch_simulation
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(gymnasium.registry, TASK, spec(record))
    monkeypatch.setattr(envs.isaaclab, "simulation_device", lambda device: "cuda:0")
    cfg = EnvConfig(name="isaaclab", task=TASK, num_envs=4, actor_obs_groups=("critic",),
                    critic_obs_groups=("policy", "critic"), action_scale=2.0, action_clip=1.5,
                    launcher_args="--viz none", task_overrides=("physics=ovphysx",))
    env = make_env(cfg, CPU, seed=7, base_seed=99)
    try:
        assert type(env) is IsaacLabEnv and env.num_envs == 4
        assert env.group_names == {"policy": ("critic",), "critic": ("policy", "critic")}
        assert env.obs_dims == {"policy": 4, "critic": 3 + 4}     # fake groups: policy 3, critic a 2x2 history
        (launch,) = record.launches
        assert launch["physics"] == "ovphysx" and launch["seed"] == 7 and launch["num_envs"] == 4
        assert launcher_flags[0]["visualizer"] == ["none"]
        assert env.generator.initial_seed() == 7
        torch.testing.assert_close(env.env_actions(torch.tensor([[0.5, -1.0]])), torch.tensor([[1.0, -1.5]]))
    finally:
        env.close()


@pytest.mark.parametrize("name", ["mujoco", "", "Cartpole", "reach"])
def test_make_env_refuses_an_unknown_name(name):
    """From train.py the name passed the parser's Literal, so the likely cause is a new env added to
    configs/config.py without its make_env branch: the error names the file to edit and the docs' recipe.
    Mutant: the message "unknown --env.name 'reach'; choose cartpole, tracking, gymnasium or isaaclab"
    (a researcher who chose reach on purpose was told to choose another)."""
    with pytest.raises(ValueError) as exc:
        make_env(EnvConfig(name=name, num_envs=2), CPU, seed=0, base_seed=0)
    assert str(exc.value) == (f"unknown --env.name {name!r}: make_env (envs/__init__.py) builds cartpole, tracking, "
                              f"gymnasium or isaaclab; an env of your own needs a branch there (docs/design.md, "
                              f"\"Adding an env of your own\")")
