"""Gaps found by a mutation audit of envs/isaaclab.py against tests/fake_isaaclab.py: AUDIT_SUMMARY"""

import contextlib
import sys
import types

import gymnasium
import pytest
import torch

import envs.isaaclab
from envs.base import MissingSimulator
from envs.isaaclab import IsaacLabEnv, process_exit_code
from tests.fake_isaaclab import TASK, FakeRLEnv
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


@pytest.mark.parametrize("recorded, status", [(SystemExit(0), 0), (SystemExit("bad input"), 1)],
                         ids=["zero", "message"])
def test_a_recorded_system_exit_of_zero_or_a_message_gives_its_real_status(monkeypatch, recorded, status):
    """SystemExit(0) ends a process with 0 and SystemExit("message") (sys.exit's form that prints the message) with 1,
    as CPython does; Kit is handed that status.
    Mutant: `exc.code or 1` (0 became 1, a message was handed on as the status) or `else 0` for a non-int code."""
    monkeypatch.setattr(sys, "last_exc", recorded, raising=False)
    monkeypatch.setattr(sys, "last_value", recorded, raising=False)
    assert process_exit_code() == status


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


def test_a_failed_env_build_still_closes_the_runtime_at_exit(fake, monkeypatch):
    """Once the runtime has started, the exit handler is registered before the env is built: an env whose build
    raises still has its runtime closed at exit (Kit would otherwise end the process without the real status).
    Mutant: atexit.register(self.close) moved after gym.make."""
    closers = []
    monkeypatch.setattr(envs.isaaclab.atexit, "register", closers.append)

    def entry_point(cfg, **kw):
        raise RuntimeError("the task's scene does not build")

    fake.entry_point = entry_point
    with pytest.raises(RuntimeError, match="scene does not build"):
        IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)
    (launch,) = fake.launches
    assert len(closers) == 1 and fake.runtime_open and launch["exit_code"] is None
    closers[0]()                                         # the exit handler: no uncaught exception recorded, status 0
    assert not fake.runtime_open and launch["exit_code"] == 0


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
        assert torch.equal(obs["policy"][:, 2], lengths.float() / 8)        # MAX_EPISODE_LENGTH of the fake: 8
    finally:
        env.close()


def test_reset_hands_no_log(make):
    """The build's reset already named the metrics and the first step hands its values (Isaac Lab keeps them in
    extras["log"]): reset() itself logs nothing, or the runner would count the reset's values once more.
    Mutant: reset() returning the converted extras["log"] of the env."""
    env = make()
    assert env.reset()[1] == {"log": {}}
    env.step(torch.zeros(4, 2))
    assert env.reset()[1] == {"log": {}}              # a later, real reset too
