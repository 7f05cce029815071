"""The Isaac Lab adapter against tests/fake_isaaclab.py, a fake `isaaclab`/`isaaclab_tasks` pair with the
API surface of the released isaaclab 3.0.0 (launcher flags, `launch_simulation`, `parse_env_cfg`, the G1
task's id). The fake simulates on the CPU: tests replace `envs.isaaclab.simulation_device` (the function
that refuses non-CUDA devices, tested on its own below) so that the adapter asks for "cuda:<rank>".
"""

import re
import sys
import warnings

import gymnasium
import pytest
import torch

import envs.isaaclab
from configs import preset, validate
from envs.base import MissingSimulator
from envs.isaaclab import IsaacLabEnv, simulation_device
from tests.fake_isaaclab import MAX_EPISODE_LENGTH, TASK, TERMINATE_ABOVE, install_for_test


@pytest.fixture
def fake(monkeypatch):
    record = install_for_test(monkeypatch)
    for name in ("last_exc", "last_value"):    # pytest records a failed test's exception there
        monkeypatch.delattr(sys, name, raising=False)
    return record


@pytest.fixture
def make(fake):
    built = []

    def build(num_envs=4, seed=0, **kwargs):
        kwargs.setdefault("critic_obs_groups", ("policy", "critic"))
        env = IsaacLabEnv(TASK, num_envs, torch.device("cpu"), seed, **kwargs)
        built.append(env)
        return env

    yield build
    for env in built:
        env.close()


def test_the_preset_task_is_the_one_isaac_lab_3_0_registers():
    assert preset("isaaclab").env.task == TASK == "Isaac-Velocity-Rough-G1"


def test_start_up_follows_the_3_0_launch_order(fake, make):
    env = make(num_envs=4, seed=7, task_overrides=("physics=ovphysx",), launcher_args="--viz none")
    (launch,) = fake.launches
    assert launch == {"device": "cuda:0", "distributed": False, "visualizer": ["none"], "physics": "ovphysx",
                      "seed": 7, "num_envs": 4, "compute_final_obs": True, "exit_code": None}
    assert env.obs_dims == {"policy": 3, "critic": 3 + 4}      # critic = policy group + flattened 2x2 history
    assert env.num_actions == 2 and env.max_episode_length == MAX_EPISODE_LENGTH
    assert env.log_keys == ("Metrics/constant", "Episode_Termination/time_out")
    env.close()
    assert fake.envs[0].closed and launch["exit_code"] == 0
    env.close()                                                # a second close (e.g. at exit) does nothing
    assert len(fake.launches) == 1 and launch["exit_code"] == 0


def test_close_hands_the_runtime_the_exit_status(make, fake, monkeypatch):
    make().close(3)
    assert fake.launches[-1]["exit_code"] == 3
    # From the atexit handler, after an uncaught exception: what the release's launch_simulation would report.
    monkeypatch.setattr(sys, "last_exc", RuntimeError("training failed"), raising=False)
    make().close()
    assert fake.launches[-1]["exit_code"] == 1
    monkeypatch.setattr(sys, "last_exc", KeyboardInterrupt(), raising=False)
    make().close()
    assert fake.launches[-1]["exit_code"] == 130
    monkeypatch.setattr(sys, "last_exc", SystemExit(2), raising=False)     # what train.cli records for bad input
    make().close()
    assert fake.launches[-1]["exit_code"] == 2


def test_final_obs_is_the_observation_before_the_reset(make):
    env = make(num_envs=6)
    obs, _ = env.reset()
    saw_time_out = saw_step_without_reset = False
    for _ in range(3 * MAX_EPISODE_LENGTH):
        previous = obs
        obs, reward, terminated, truncated, extras = env.step(torch.full((6, 2), 0.5))
        done = terminated | truncated
        final = extras["final_obs"]
        # Finished envs: the observation before the reset continues the previous one by one step.
        expected = previous["policy"][:, :2] + 0.05
        torch.testing.assert_close(final["policy"][:, :2], expected)
        torch.testing.assert_close(final["critic"][:, 3:5], expected)
        assert torch.equal(final["policy"][truncated, 2], torch.ones(int(truncated.sum())))   # at the time limit
        # ...while the returned observation already starts the next episode.
        assert torch.equal(obs["policy"][done], torch.zeros(int(done.sum()), 3))
        assert torch.equal(final["policy"][~done], obs["policy"][~done])
        assert torch.equal(final["critic"][~done], obs["critic"][~done])
        saw_time_out |= bool(truncated.any())
        saw_step_without_reset |= not bool(done.any())          # stale extras["final_obs"] must be ignored there
    assert saw_time_out and saw_step_without_reset


def test_reset_spreads_episode_ends_deterministically(make):
    lengths = []
    for _ in range(2):
        env = make(num_envs=32, seed=3)
        env.reset()
        lengths.append(env.unwrapped.episode_length_buf.clone())
    assert torch.equal(lengths[0], lengths[1])
    assert lengths[0].min() >= 0 and lengths[0].max() < MAX_EPISODE_LENGTH
    assert len(lengths[0].unique()) > 1
    other = make(num_envs=32, seed=4)                        # another rank (another rank_seed): another spread
    other.reset()
    assert not torch.equal(other.unwrapped.episode_length_buf, lengths[0])


def test_the_first_observation_shows_the_spread_episode_lengths(make):
    """The first observation must be taken after the episode lengths are spread, as RSL-RL's runner fetches it
    again after setting episode_length_buf: a time-dependent term (the fake's progress column) read step 0."""
    env = make(num_envs=32, seed=5)
    obs, _ = env.reset()
    lengths = env.unwrapped.episode_length_buf
    assert len(lengths.unique()) > 1
    assert torch.equal(obs["policy"][:, 2], lengths.float() / MAX_EPISODE_LENGTH)
    assert torch.equal(obs["policy"][:, :2], torch.zeros(32, 2)) and env.unwrapped.full_resets == 1


def test_the_env_is_reset_once_before_training(make):
    """The adapter resets at build to read sizes and metric names; the runner's first reset() takes that reset.
    A second full reset ran every reset event and curriculum term twice (RSL-RL's wrapper resets once)."""
    env = make(num_envs=3)
    sim = env.unwrapped
    assert sim.full_resets == 1
    built = sim._observe()["policy"]
    obs, _ = env.reset()
    assert sim.full_resets == 1 and torch.equal(obs["policy"][:, :2], built[:, :2])
    env.step(torch.ones(3, 2))
    obs, _ = env.reset()                                      # a later reset() is a real one
    assert sim.full_resets == 2 and torch.equal(obs["policy"][:, :2], torch.zeros(3, 2))


def test_failure_at_the_time_limit_is_a_failure(make):
    env = make(num_envs=2)
    env.reset()
    sim = env.unwrapped
    sim.episode_length_buf[:] = MAX_EPISODE_LENGTH - 1
    sim.pos[:, 0] = TERMINATE_ABOVE - 0.05
    _, _, terminated, truncated, extras = env.step(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))
    assert terminated.tolist() == [True, False] and truncated.tolist() == [False, True]
    assert extras["final_obs"]["policy"][0, 0].item() == pytest.approx(TERMINATE_ABOVE + 0.05)


def test_finite_horizon_time_outs_are_terminal(fake, make):
    fake.finite_horizon = True
    env = make(num_envs=2)
    env.reset()
    env.unwrapped.episode_length_buf[:] = MAX_EPISODE_LENGTH - 1
    _, _, terminated, truncated, _ = env.step(torch.zeros(2, 2))
    assert terminated.all() and not truncated.any()


def test_actions_are_scaled_then_clipped(make):
    env = make(action_scale=2.0, action_clip=1.5)
    env.reset()
    env.step(torch.tensor([[0.5, -0.5], [1.0, -1.0], [0.7, 0.0], [-3.0, 3.0]]))
    assert torch.equal(env.unwrapped.received_actions[-1],
                       torch.tensor([[1.0, -1.0], [1.5, -1.5], [1.4, 0.0], [-1.5, 1.5]]))


def test_returned_rewards_and_flags_survive_the_next_step(make):
    env = make()
    env.reset()
    env.unwrapped.episode_length_buf[:] = torch.tensor([0, MAX_EPISODE_LENGTH - 1, 0, 0])
    env.unwrapped.pos[0, 0] = TERMINATE_ABOVE                # env 0 falls, env 1 times out, on this step only
    _, reward, terminated, truncated, _ = env.step(torch.ones(4, 2))
    assert terminated.tolist() == [True, False, False, False] and truncated.tolist() == [False, True, False, False]
    kept = reward.clone(), terminated.clone(), truncated.clone()
    env.step(-torch.ones(4, 2))                              # the fake overwrites its buffers in place
    assert all(torch.equal(a, b) for a, b in zip((reward, terminated, truncated), kept))


def test_a_reset_without_final_obs_is_an_error_not_a_silent_bootstrap(make):
    """An env that resets without extras['final_obs'] (compute_final_obs off again in the task's code) would have its
    time-outs bootstrapped from the next episode's first observation: that step is refused; steps without a reset
    need no final_obs."""
    env = make(num_envs=2)
    env.reset()
    env.unwrapped.cfg.compute_final_obs = False
    env.unwrapped.episode_length_buf[:] = 0
    env.step(torch.zeros(2, 2))
    env.unwrapped.episode_length_buf[1] = MAX_EPISODE_LENGTH - 1
    with pytest.raises(RuntimeError, match=r"reset envs without extras\['final_obs'\]"):
        env.step(torch.zeros(2, 2))


def test_episode_log_becomes_scalar_tensors_and_late_keys_warn(make):
    env = make()
    env.reset()
    env.unwrapped.extra_log = {"Curriculum/late": 1.0}
    env.unwrapped.episode_length_buf[:] = MAX_EPISODE_LENGTH - 1         # every env resets this step
    with pytest.warns(UserWarning, match="Curriculum/late"):
        _, _, _, _, extras = env.step(torch.zeros(4, 2))
    assert set(extras["log"]) == {"Metrics/constant", "Episode_Termination/time_out"}
    assert extras["log"]["Metrics/constant"].dtype == torch.float32 and extras["log"]["Metrics/constant"].shape == ()
    assert extras["log"]["Episode_Termination/time_out"].item() == 4.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # warned once, not every step
        env.step(torch.zeros(4, 2))


def test_a_number_the_task_logs_reaches_the_device_without_a_copy_from_the_host(make):
    """Isaac Lab logs some metrics as Python numbers (`.item()`: termination counts, command metrics) and keeps them in
    extras["log"] between resets, so the adapter converts them at every step. torch.as_tensor(number, device=cuda) is a
    blocking host-to-device copy (aten::lift_fresh), a device sync per such metric and step on a GPU; the number is
    filled in on the device instead, with the same float32 value."""
    env = make()
    env.reset()
    env.unwrapped.episode_length_buf[:] = 0                  # no env ends in the profiled step (nothing resets)
    with torch.profiler.profile() as prof:
        _, _, _, _, extras = env.step(torch.zeros(4, 2))     # extras["log"]: the build's reset's, a number among them
    assert "aten::lift_fresh" not in {e.name for e in prof.events()}
    value = extras["log"]["Metrics/constant"]
    assert value.dtype == torch.float32 and value.shape == () and value.device == env.device and value.item() == 0.5
    for number in (0.1, 3, True, 1e39, float("nan")):        # rounded to float32 as torch.as_tensor rounds it
        filled, expected = env._scalar("Metrics/constant", number), torch.as_tensor(number, dtype=torch.float32)
        assert torch.equal(filled.view(torch.int32), expected.view(torch.int32))    # bit for bit (NaN too)


def test_observation_group_errors_name_the_flag(make):
    with pytest.raises(ValueError, match=r"--env.critic-obs-groups: this task has no observation group 'privileged'; "
                                         r"it has \['critic', 'policy'\]"):
        make(critic_obs_groups=("privileged",))


def test_a_critic_group_no_input_uses_is_warned_of(make):
    """The task has a `critic` group; with the default --env.critic-obs-groups (policy) the critic would silently
    go without it (RSL-RL would feed it): a warning names the flag that uses it. Used, or in no task, no warning."""
    with pytest.warns(UserWarning, match=r"privileged observation group 'critic' that no input uses: the critic sees "
                                         r"\['policy'\]; --env.critic-obs-groups policy critic gives it both"):
        make(critic_obs_groups=("policy",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make(critic_obs_groups=("critic",)).obs_dims["critic"] == 2 * 2
        make(actor_obs_groups=("policy", "critic"), critic_obs_groups=("policy",))


def test_kit_physics_without_isaac_sim_is_one_line_naming_the_way_out(fake, capsys):
    """3.0.0's launch_simulation logs its own hint and raises SystemExit(1) when a task needs Kit and Isaac Sim is
    missing: that left the runner's one-line error and exit status 2 behind."""
    fake.kit_installed = False
    with pytest.raises(MissingSimulator, match=r"^--env.task Isaac-Velocity-Rough-G1: Isaac Lab could not start the "
                       r"Isaac Sim \(Kit\) runtime .* exit 1\); .*--env.task-overrides physics=newton_mjwarp\)$"):
        IsaacLabEnv(TASK, 4, torch.device("cpu"), 0, task_overrides=("physics=isaacsim_physx",))
    assert "Isaac Sim is not installed" in capsys.readouterr().err
    IsaacLabEnv(TASK, 4, torch.device("cpu"), 0).close()     # the kitless default starts without Isaac Sim


def test_a_parse_env_cfg_without_overrides_runs_the_defaults_and_refuses_overrides_in_one_line(fake, monkeypatch):
    """An isaaclab_tasks whose parse_env_cfg has the older signature (task, device, num_envs, use_fabric): the task's
    defaults still build; --env.task-overrides is one line naming the signature, not a TypeError traceback."""
    utils = sys.modules["isaaclab_tasks.utils"]
    newer = utils.parse_env_cfg
    monkeypatch.setattr(utils, "parse_env_cfg", lambda task_name, device="cuda:0", num_envs=None, use_fabric=None:
                        newer(task_name, device, num_envs, use_fabric, overrides=()))
    IsaacLabEnv(TASK, 4, torch.device("cpu"), 0).close()
    with pytest.raises(MissingSimulator, match=r"^--env.task-overrides: this isaaclab_tasks' parse_env_cfg takes no "
                                               r"overrides \(signature \(task_name, device='cuda:0', num_envs=None, "
                                               r"use_fabric=None\)\); leave the flag out"):
        IsaacLabEnv(TASK, 4, torch.device("cpu"), 0, task_overrides=("physics=isaacsim_physx",))


def test_no_task_overrides_keep_the_scripts_own_argv_out_of_the_task_config(make, fake, monkeypatch):
    """Isaac Lab 3.0's Hydra resolution reads sys.argv[1:] when handed overrides=None; train.py's own flags there
    would be taken for Hydra overrides. Without --env.task-overrides the adapter hands an empty list: defaults.
    Mutant: `overrides` passed to parse_env_cfg only when --env.task-overrides is given."""
    monkeypatch.setattr(sys, "argv", ["train.py", "isaaclab", "--env.task", TASK, "--env.launcher-args=--viz none"])
    make()
    assert fake.launches[-1]["physics"] == "newton_mjwarp"


def test_unknown_task_suggests_registered_ones(fake):
    # Isaac Lab 3.0 dropped the -v0 suffix of its task ids.
    with pytest.raises(ValueError, match="unknown --env.task 'Isaac-Velocity-Rough-G1-v0'.*did you mean: "
                                         "Isaac-Velocity-Rough-G1"):
        IsaacLabEnv("Isaac-Velocity-Rough-G1-v0", 4, torch.device("cpu"), 0)


def test_a_task_of_an_extension_project_is_written_package_colon_task_id(fake, tmp_path, monkeypatch):
    """Research tasks live in Isaac Lab extension projects whose package registers them when imported: `--env.task
    package:TaskId` (gymnasium's form) imports it, then parses and builds TaskId. Unimported, the task is unknown and
    the error names that form; a package that is not there is named."""
    (tmp_path / "ext_tasks_for_test.py").write_text(
        f"import dataclasses, gymnasium\ngymnasium.registry['Ext-Point'] = "
        f"dataclasses.replace(gymnasium.registry[{TASK!r}], id='Ext-Point')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="^unknown --env.task 'Ext-Point' for Isaac Lab; a task of an extension "
                                         "project is written package:TaskId"):
        IsaacLabEnv("Ext-Point", 4, torch.device("cpu"), 0)
    with pytest.raises(MissingSimulator, match="cannot import no_such_ext_package"):
        IsaacLabEnv("no_such_ext_package:Ext-Point", 4, torch.device("cpu"), 0)
    try:
        env = IsaacLabEnv("ext_tasks_for_test:Ext-Point", 4, torch.device("cpu"), 0, critic_obs_groups=("critic",))
        assert env.num_envs == 4 and env.obs_dims == {"policy": 3, "critic": 4}
        env.close()
    finally:
        gymnasium.registry.pop("Ext-Point", None)
        sys.modules.pop("ext_tasks_for_test", None)


def test_launcher_args_cannot_move_the_device_or_carry_unknown_flags(fake):
    add_launcher_args = sys.modules["isaaclab.app"].add_launcher_args
    namespace = envs.isaaclab.launcher_namespace(add_launcher_args, "--viz kit --kit_args=--no-window", "cuda:3", True)
    assert namespace.visualizer == ["kit"] and namespace.kit_args == "--no-window"
    assert namespace.device == "cuda:3" and namespace.distributed
    with pytest.raises(ValueError, match="must not set --device"):
        envs.isaaclab.launcher_namespace(add_launcher_args, "--device=cuda:1", "cuda:3", False)
    with pytest.raises(ValueError, match="does not know --headles"):
        envs.isaaclab.launcher_namespace(add_launcher_args, "--headles", "cuda:3", False)
    # A bad value or an unclosed quote: one line naming the flag. argparse printed its usage and raised SystemExit
    # from inside the env's build, past the runner's error handling; shlex said only "No closing quotation".
    for args, message in (("--livestream 5", "argument --livestream: invalid choice: 5 (choose from 0, 1, 2)"),
                          ("--viz", "argument --visualizer/--viz: expected one argument"),
                          ("--kit_args='--no-window", "cannot split \"--kit_args='--no-window\" into flags (No closing "
                                                      "quotation); close its quotes")):
        with pytest.raises(ValueError, match=f"^{re.escape('--env.launcher-args: ' + message)}$"):
            envs.isaaclab.launcher_namespace(add_launcher_args, args, "cuda:3", False)
    # 3.0.0's launcher has no --physics: the task's own physics presets are chosen through parse_env_cfg.
    with pytest.raises(ValueError, match="no --physics flag.*--env.task-overrides physics="):
        envs.isaaclab.launcher_namespace(add_launcher_args, "--physics newton_mjwarp", "cuda:3", False)


def test_simulation_device_refuses_the_cpu():
    with pytest.raises(ValueError, match="isaaclab simulates on GPUs.*device is cpu"):
        simulation_device(torch.device("cpu"))
    assert simulation_device(torch.device("cuda:3")) == "cuda:3"


def test_missing_isaaclab_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "isaaclab", None)             # what an absent package looks like to import
    monkeypatch.setitem(sys.modules, "isaaclab_tasks", None)
    with pytest.raises(ImportError, match="make setup-isaaclab"):
        envs.isaaclab.import_isaaclab()
    with pytest.raises(ValueError, match="needs the isaaclab package.*make setup-isaaclab"):
        validate(preset("isaaclab"))


def test_validate_refuses_cpu_and_a_missing_task(fake):
    cfg = preset("isaaclab")
    cfg.dist.device = "cpu"
    with pytest.raises(ValueError, match="--dist.device cpu"):
        validate(cfg)
    cfg = preset("isaaclab")
    cfg.env.task = ""
    with pytest.raises(ValueError, match="needs --env.task"):
        validate(cfg)


def test_isaaclab_reset_spreads_over_the_whole_limit_and_refuses_env_state(make):
    """reset spreads episode_length over [0, max_episode_length) (all of it, as RSL-RL does), and the adapter
    refuses checkpointed env state by name instead of silently dropping it."""
    env = make(num_envs=256, seed=1)
    env.reset()
    lengths = env.unwrapped.episode_length_buf
    assert lengths.min() == 0 and lengths.max() == MAX_EPISODE_LENGTH - 1
    with pytest.raises(ValueError, match="Isaac Lab adapter has no checkpointed state"):
        env.load_state_dict({"curriculum": 1})
    env.load_state_dict({})


def test_a_metric_a_later_reset_does_not_log_is_left_out_of_that_step(make):
    """A task may log a name at its first reset and not at a later one (a term that logs only when it applies):
    the step hands back the names it has, the others are simply missing (no KeyError)."""
    env = make()
    env.reset()
    env.unwrapped.episode_length_buf[:] = 0                             # no env resets this step
    env.unwrapped.extras["log"] = {"Metrics/constant": 0.25}            # the last reset logged one name only
    _, _, terminated, truncated, extras = env.step(torch.zeros(4, 2))
    assert not (terminated | truncated).any()
    assert extras["log"] == {"Metrics/constant": torch.tensor(0.25)}
