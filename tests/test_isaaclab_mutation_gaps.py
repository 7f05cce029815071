"""Gaps found by a mutation audit of envs/isaaclab.py (the Isaac Lab adapter) against tests/fake_isaaclab.py: 119
hand-made mutants, each run against the tests that build the adapter (test_env_isaaclab*, test_env_adapter_model_rules,
and the isaaclab tests of test_export_logger_env_rules, test_startup_errors, test_loop_config_rules, test_tools,
test_typed_flags and others; the survivors also against the 2-rank run of test_env_isaaclab_runs). 81 were killed by
existing tests; each test below fails on a mutant that every earlier test let through (23 mutants, 20 tests).

Pinned: a broken install's plain ImportError (not only ModuleNotFoundError) as MissingSimulator; `--device cuda:1` as
two tokens refused; SystemExit(0) and SystemExit("message") recorded giving status 0 and 1; a non-dict mapping group
(TensorDict) named a dict of terms; close matches drawn from Isaac-* ids only, and up to five of them; the env config
parsed with the rank's simulation device; the exit handler registered before the env is built (and close with no env);
a DirectRLEnv re-observed after the spread; reset() handing no log; int and bool metrics filled in on the device;
tensor metrics cast to float32; a ragged list or a huge int named as "not one number"; close dropping its exit handler;
a [1] metric handed on 0-d; a task that logs nothing; the runtime closed even when the env's close raises; no critic
warning for a task without a critic group; `-h` in the launcher flags an unknown flag; the caller's actions unchanged.

Equivalent: parse_env_cfg given the overrides as a tuple, not a list (the fake takes either; 3.0.0's default is ());
gym.make(task) for gym.make(name) (gymnasium resolves package:TaskId itself); shape[-1] for shape[0] or shape[1] of a
shape checked 1-D, or of groups already flattened to 2-D; reshape+clone for flatten(1) and a copied groups dict
(torch.cat copies anyway); a finite horizon not zeroing truncated (truncated & ~terminated is zero then); closing the
runtime with SystemExit(0) instead of a plain close (the launcher gets status 0 either way); final_obs picked by
done.any() instead of its presence (a done step without it has raised); reset()'s own env.reset()[0] dropped to the
whole tuple (that value was never used: reset() always observes again; it is no longer kept); max_episode_length
without int() (Isaac Lab's is an int).
Not worth a test: the shlex error's `from exc` (the traceback's cause line only); "exit {code or 1}" for a bare
SystemExit in the start-up message (3.0.0 raises SystemExit(1)). Not testable without a GPU: a tensor metric converted
without device=self.device (the fake simulates on the CPU, where the learner is too)."""

import re
import sys
import warnings

import gymnasium
import pytest
import torch

import envs.isaaclab
from envs.base import MissingSimulator
from envs.isaaclab import IsaacLabEnv, process_exit_code
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


@pytest.mark.parametrize("recorded, status", [(SystemExit(0), 0), (SystemExit("bad input"), 1), (SystemExit(), 0)],
                         ids=["zero", "message", "none"])
def test_a_recorded_system_exit_of_zero_or_a_message_gives_its_real_status(monkeypatch, recorded, status):
    """SystemExit(0) and SystemExit() (sys.exit() with no status) end a process with 0, SystemExit("message")
    (sys.exit's form that prints the message) with 1, as CPython does; Kit is handed that status.
    Mutant: `exc.code or 1` (0 became 1, a message was handed on as the status) or `else 0` for a non-int code; a
    code of None read as a failure (1; fixed since)."""
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
        assert torch.equal(obs["policy"][:, 2], lengths.float() / MAX_EPISODE_LENGTH)
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


def make_logging(fake, extra_log):
    """An adapter over the fake whose every reset also logs `extra_log` (closed by the caller)."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)
        env.extra_log = extra_log
        return env

    fake.entry_point = entry_point
    return IsaacLabEnv(TASK, 4, torch.device("cpu"), 0, critic_obs_groups=("policy", "critic"))


def test_integer_and_bool_metrics_are_filled_in_on_the_device_too(fake):
    """Isaac Lab's termination counts are Python ints (`.item()` of an integer tensor) and a flag may be a bool: like
    a float, each is filled in on the device, not copied from the host (aten::lift_fresh) at every step.
    Mutant: `isinstance(value, float)` instead of `numbers.Real` in _scalar."""
    env = make_logging(fake, {"Episode_Termination/base_contact": 3, "Metrics/flag": True})
    try:
        env.reset()
        env.unwrapped.episode_length_buf[:] = 0                 # nothing resets in the profiled step
        with torch.profiler.profile() as prof:
            _, _, _, _, extras = env.step(torch.zeros(4, 2))
        assert "aten::lift_fresh" not in {event.name for event in prof.events()}
        assert extras["log"]["Episode_Termination/base_contact"].item() == 3.0
        assert extras["log"]["Metrics/flag"].item() == 1.0
    finally:
        env.close()


def test_integer_and_double_tensor_metrics_are_handed_on_as_float32(fake):
    """Every logged value becomes a float32 0-d tensor, whatever the task's tensor dtype (an int64 count, a float64
    mean), as a logged Python number does.
    Mutant: torch.as_tensor without dtype=torch.float32 for tensors."""
    count, mean = torch.tensor(7), torch.tensor(0.25, dtype=torch.float64)
    env = make_logging(fake, {"Metrics/count": count, "Metrics/mean": mean})
    try:
        env.reset()
        _, _, _, _, extras = env.step(torch.zeros(4, 2))
        for key, value in (("Metrics/count", 7.0), ("Metrics/mean", 0.25)):
            logged = extras["log"][key]
            assert logged.dtype == torch.float32 and logged.shape == () and logged.item() == value
    finally:
        env.close()


@pytest.mark.parametrize("value, what", [([[1.0], [1.0, 2.0]], "list"), (10 ** 400, "int")], ids=["ragged", "huge-int"])
def test_a_logged_value_torch_or_float_cannot_convert_is_named(fake, value, what):
    """A ragged list (torch's ValueError) or an int past float range (float()'s OverflowError) is named like any value
    that is not one number, not torch's or Python's own error from inside the adapter.
    Mutant: `except (TypeError,)` only, in _scalar."""
    message = (f"--env.task {TASK}: extras['log']['Metrics/odd'] is {what}, not one number; make the task log one "
               f"value per name (e.g. the mean over its envs)")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make_logging(fake, {"Metrics/odd": value})


def test_close_drops_the_exit_handler(make, monkeypatch):
    """A closed adapter takes its exit handler back (atexit.unregister), so the process does not hold every closed env
    (and its simulation) until it ends.
    Mutant: the atexit.unregister in close left out."""
    handlers = []
    monkeypatch.setattr(envs.isaaclab.atexit, "register", handlers.append)
    monkeypatch.setattr(envs.isaaclab.atexit, "unregister", handlers.remove)
    env = make()
    assert handlers == [env.close]
    env.close()
    assert handlers == []


def test_a_one_element_tensor_metric_is_handed_on_as_a_0d_tensor(fake):
    """A metric logged as a one-element tensor ([1]: a per-env mean kept with keepdim) is one number: handed on as a
    0-d tensor like every other metric.
    Mutant: _scalar returning the converted tensor without reshape(())."""
    env = make_logging(fake, {"Metrics/kept_dim": torch.tensor([0.75])})
    try:
        env.reset()
        logged = env.step(torch.zeros(4, 2))[4]["log"]["Metrics/kept_dim"]
        assert logged.shape == () and logged.item() == 0.75
    finally:
        env.close()


def test_a_task_that_logs_nothing_has_no_metrics(fake):
    """A task whose resets leave extras without a "log" entry (nothing to log) builds and steps with no metrics,
    rather than failing on a missing key.
    Mutant: extras["log"] instead of extras.get("log", {}) (in _describe or in _log)."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)
        reset_idx = env._reset_idx

        def reset_without_log(ids):
            reset_idx(ids)
            del env.extras["log"]

        env._reset_idx = reset_without_log
        return env

    fake.entry_point = entry_point
    env = IsaacLabEnv(TASK, 2, torch.device("cpu"), 0, critic_obs_groups=("policy", "critic"))
    try:
        assert env.log_keys == ()
        env.reset()
        env.unwrapped.episode_length_buf[:] = MAX_EPISODE_LENGTH - 1     # both envs time out this step
        _, _, _, truncated, extras = env.step(torch.zeros(2, 2))
        assert truncated.all() and extras["log"] == {}
    finally:
        env.close()


def test_the_runtime_is_closed_with_the_status_even_when_closing_the_env_fails(fake):
    """An env whose own close raises still has its runtime closed, with the status given (Kit ends the process there
    with that status; left open, Kit's own exit handler would end it with another).
    Mutant: the try/finally around env.close() made sequential."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)

        def failing_close():
            raise RuntimeError("the scene could not be torn down")

        env.close = failing_close
        return env

    fake.entry_point = entry_point
    env = IsaacLabEnv(TASK, 2, torch.device("cpu"), 0, critic_obs_groups=("policy", "critic"))
    with pytest.raises(RuntimeError, match="could not be torn down"):
        env.close(3)
    assert not fake.runtime_open and fake.launches[0]["exit_code"] == 3


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


def test_a_help_flag_in_launcher_args_is_an_unknown_flag_not_a_help_page_and_exit(fake):
    """`-h` among --env.launcher-args must not print argparse's help and raise SystemExit from inside the env's build:
    the launcher parser has no help flag, so it is an unknown flag, named in one line.
    Mutant: LauncherParser built with argparse's default add_help=True."""
    add_launcher_args = sys.modules["isaaclab.app"].add_launcher_args
    with pytest.raises(ValueError, match=r"^--env.launcher-args: Isaac Lab's launcher does not know -h$"):
        envs.isaaclab.launcher_namespace(add_launcher_args, "-h", "cuda:3", False)


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
