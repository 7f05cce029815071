"""Building and driving the Isaac Lab adapter against tests/fake_isaaclab.py: a broken install, the launcher flags it
refuses (--device, -h), task names matched against Isaac tasks only, the task config parsed for the rank's device,
observation groups (a mapping of terms, no critic group), a DirectRLEnv observed again after the reset's spread, and
the caller's actions left as they were."""

import sys
import warnings

import gymnasium
import pytest
import torch

import envs.isaaclab
from envs.base import MissingSimulator
from envs.isaaclab import IsaacLabEnv
from tests.fake_isaaclab import MAX_EPISODE_LENGTH, TASK, FakeRLEnv
from tests.test_env_isaaclab import fake, make  # noqa: F401 - the fixtures that install the fake and build adapters


def test_a_broken_isaac_lab_install_is_a_missing_simulator_naming_the_install_command(fake, monkeypatch):
    """An installed but broken Isaac Lab (isaaclab.app without launch_simulation: an older or partial install) makes
    `from isaaclab.app import launch_simulation` raise a plain ImportError, not ModuleNotFoundError: it is the same
    one line naming the install command.
    Mutant: `except ModuleNotFoundError` instead of `except ImportError` in import_isaaclab."""
    monkeypatch.delattr(sys.modules["isaaclab.app"], "launch_simulation")
    with pytest.raises(MissingSimulator, match=r"needs Isaac Lab 3\.0 .*cannot import name 'launch_simulation'.*"
                                               r"make setup-isaaclab"):
        envs.isaaclab.import_isaaclab()


def test_device_given_as_a_separate_token_is_refused_too(fake):
    """`--device cuda:1` (two tokens) moves the simulation as `--device=cuda:1` does: refused the same way.
    Mutant: only `--device=...` refused (the `token == "--device"` half dropped)."""
    add_launcher_args = sys.modules["isaaclab.app"].add_launcher_args
    with pytest.raises(ValueError, match=r"must not set --device: each rank simulates on its own GPU"):
        envs.isaaclab.launcher_namespace(add_launcher_args, "--viz none --device cuda:1", "cuda:3", False)


def test_a_help_flag_in_launcher_args_is_an_unknown_flag_not_a_help_page_and_exit(fake):
    """`-h` among --env.launcher-args must not print argparse's help and raise SystemExit from inside the env's build:
    the launcher parser has no help flag, so it is an unknown flag, named in one line.
    Mutant: LauncherParser built with argparse's default add_help=True."""
    add_launcher_args = sys.modules["isaaclab.app"].add_launcher_args
    with pytest.raises(ValueError, match=r"^--env.launcher-args: Isaac Lab's launcher does not know -h$"):
        envs.isaaclab.launcher_namespace(add_launcher_args, "-h", "cuda:3", False)


def test_an_unknown_task_is_matched_against_isaac_tasks_only(fake):
    """gymnasium's registry also holds its own tasks (CartPole-v1): a typo of one is not "did you mean CartPole-v1"
    (not an Isaac Lab task), it gets the extension-project hint.
    Mutant: close matches drawn from every registered id, not only the Isaac-* ones."""
    assert "CartPole-v1" in gymnasium.registry
    with pytest.raises(ValueError, match=r"^unknown --env.task 'CartPole-v2' for Isaac Lab; a task of an extension "
                                         r"project is written package:TaskId \(importing the package registers it\)$"):
        IsaacLabEnv("CartPole-v2", 2, torch.device("cpu"), 0)


def test_an_unknown_task_lists_several_close_isaac_tasks(fake, monkeypatch):
    """With several near-misses registered, the error lists them all (up to five), not just the closest.
    Mutant: difflib's n=1 instead of n=5."""
    for other in ("Isaac-Velocity-Rough-H1", "Isaac-Velocity-Flat-G1"):
        monkeypatch.setitem(gymnasium.registry, other, gymnasium.registry[TASK])
    with pytest.raises(ValueError) as error:
        IsaacLabEnv("Isaac-Velocity-Rough-G2", 2, torch.device("cpu"), 0)
    listed = str(error.value).split("did you mean: ")[1].split(", ")
    assert sorted(listed) == ["Isaac-Velocity-Flat-G1", "Isaac-Velocity-Rough-G1", "Isaac-Velocity-Rough-H1"]


def test_the_task_config_is_parsed_for_this_ranks_simulation_device(fake, make, monkeypatch):
    """The env config carries the rank's simulation device (cuda:LOCAL_RANK), not the task's default cuda:0.
    Mutant: parse_env_cfg called without device=sim_device."""
    monkeypatch.setattr(envs.isaaclab, "simulation_device", lambda device: "cuda:3")
    make()
    assert fake.envs[0].cfg.sim.device == "cuda:3" and fake.launches[0]["device"] == "cuda:3"


def test_a_group_that_is_a_mapping_but_no_dict_is_named_a_dict_of_terms(fake):
    """Isaac Lab can hand a group of separate terms as a TensorDict, a mapping that is no `dict` subclass: still named
    a dict of terms with the concatenate_terms fix, not "TensorDict, not a [num_envs, ...] tensor".
    Mutant: `isinstance(value, dict)` instead of `hasattr(value, "keys")` in group_error."""
    class Terms:                                    # what matters of a TensorDict here: keys(), no dict base
        def __init__(self, **terms):
            self.terms = terms

        def keys(self):
            return self.terms.keys()

    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)
        env._observe = lambda: {"policy": Terms(pos=env.pos.clone()), "critic": torch.stack([env.pos, env.prev], 1)}
        return env

    fake.entry_point = entry_point
    with pytest.raises(ValueError, match=r"^--env.actor-obs-groups: observation group 'policy' is a dict of terms; "
                                         r"set its concatenate_terms=True in the task config$"):
        IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)


def test_a_task_without_a_critic_group_is_not_warned_of_one(fake):
    """The warning about an unused privileged 'critic' group is for tasks that have one: a task with only a policy
    group and the default --env.critic-obs-groups builds silently.
    Mutant: the `"critic" in obs` half of the warning's condition dropped."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)
        observe = env._observe
        env._observe = lambda: {"policy": observe()["policy"]}
        return env

    fake.entry_point = entry_point
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env = IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)
    env.close()
    assert env.obs_dims == {"policy": 3, "critic": 3}


def test_a_direct_rl_env_is_observed_again_after_the_spread(fake):
    """A DirectRLEnv task has no observation manager: reset() observes it again through `_get_observations` after
    spreading the episode lengths, so the progress column shows each env's spread length, not the reset's 0.
    Mutant: the DirectRLEnv branch left out (the build's observations handed on)."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)
        del env.observation_manager
        env._get_observations = env._observe
        return env

    fake.entry_point = entry_point
    env = IsaacLabEnv(TASK, 16, torch.device("cpu"), 2, critic_obs_groups=("policy", "critic"))
    try:
        obs, _ = env.reset()
        lengths = env.unwrapped.episode_length_buf
        assert len(lengths.unique()) > 1              # some env starts past step 0: the progress column must show it
        assert torch.equal(obs["policy"][:, 2], lengths.float() / MAX_EPISODE_LENGTH)
    finally:
        env.close()


def test_stepping_leaves_the_callers_actions_as_they_were(make):
    """The runner's rollout hands step a copy, but bench/bench_train.py's RSL-RL wrapper hands RSL-RL's own actions
    straight through, which RSL-RL stores after the step: scaling and clipping must make a new tensor.
    Mutant: `actions *= self.action_scale` (in place) in env_actions."""
    env = make(action_scale=2.0, action_clip=1.5)
    env.reset()
    actions = torch.tensor([[0.5, -0.5], [1.0, -1.0], [0.25, 0.0], [-3.0, 3.0]])
    env.step(actions)
    assert torch.equal(actions, torch.tensor([[0.5, -0.5], [1.0, -1.0], [0.25, 0.0], [-3.0, 3.0]]))
    assert torch.equal(env.unwrapped.received_actions[-1], torch.tensor([[1.0, -1.0], [1.5, -1.5], [0.5, 0.0],
                                                                         [-1.5, 1.5]]))
