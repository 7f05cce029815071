"""Rules of three small modules that the heavier tests only reach through training, pinned one by one:

- ppo/export.py: the ONNX graph's interface (input `obs`, output `actions`, a free batch dimension), where the
  files go when no --out is given (the checkpoint's folder, also from the command line), the refusal of an
  unwritable --out and of a checkpoint dict without a run config, the summary line and the note about the run's
  action scale/clip.
- ppo/logger.py: the console line (iteration count, formats, ETA) against a fake clock, `-` for non-finite
  metrics, every tag of a `log` call written at its step (read back with TensorBoard's EventAccumulator), a run
  directory that does not exist yet, and the wait past the newest earlier event file (fake clock, no sleeping).
- envs/__init__.py: `make_env` builds the env that --env.name names and hands it every setting of its EnvConfig
  (episode length, seeds, motion library size and sampling floor, action scale/clip, observation groups,
  launcher flags, task overrides), and refuses an unknown name.

Expected values are computed here by hand or with numpy, never by the code under test.
"""

import dataclasses
import math
import os
import sys
import textwrap
import threading

import gymnasium
import numpy as np
import pytest
import torch

import envs.isaaclab
from configs.config import EnvConfig, PolicyConfig
from dist.errors import RunError
from envs import CartPole, GymnasiumEnv, IsaacLabEnv, Tracking, make_env
from envs.motions import MotionLibrary
from ppo import export
from ppo import logger as logger_module
from ppo.actor_critic import build_actor_critic
from ppo.logger import RunLogger, leave_writer_oserrors, wait_past_earlier_event_files
from tests.fake_isaaclab import TASK, Record, fake_modules, spec
from tests.forked_python import run_python
from tests.test_tools import numpy_actions as numpy_actions_of_state

CPU = torch.device("cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- ppo/export.py ------------------------------------------------------------------------------------

def small_checkpoint(path, normalize_actor_obs: bool = True, env: dict | None = None) -> str:
    """A checkpoint with the entries export reads: actor 5 -> 8 -> 8 -> 3 (ELU), critic 6 -> 8 -> 1."""
    torch.manual_seed(0)
    cfg = PolicyConfig(actor_hidden=(8, 8), critic_hidden=(8,), normalize_actor_obs=normalize_actor_obs)
    model = build_actor_critic(cfg, {"policy": 5, "critic": 6}, 3)
    if normalize_actor_obs:
        model.actor_normalizer.mean.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0, 100.0]))
        model.actor_normalizer.std.copy_(torch.tensor([2.0, 0.5, 1.0, 1e-3, 10.0]))
    torch.save({"model": model.state_dict(), "config": {"policy": dataclasses.asdict(cfg), "env": env or {}}}, path)
    return str(path)


def numpy_actions(path: str, obs: np.ndarray) -> np.ndarray:
    """The mean action by hand in float64 (tests/test_tools.py), from the checkpoint at `path`."""
    state = torch.load(path, weights_only=True)["model"]
    return numpy_actions_of_state(state, obs, "actor_normalizer.mean" in state)


@pytest.fixture
def torchscript_only(monkeypatch):
    """Skip the ONNX file (seconds per export) in tests about other things than the ONNX graph."""
    monkeypatch.setattr(export, "onnx_missing", lambda: "not installed: onnx (left out by this test)")


@pytest.mark.filterwarnings("ignore:overflow encountered in expm1:RuntimeWarning")
def test_onnx_graph_reads_obs_writes_actions_for_any_batch(tmp_path):
    """A deployment feeds `obs` and fetches `actions` by name, with its own batch size (not the export's 1)."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    path = small_checkpoint(tmp_path / "model_3.pt")
    written = export.export(path, str(tmp_path / "out"))
    graph = onnx.load(written["onnx"])
    assert [i.name for i in graph.graph.input] == ["obs"] and [o.name for o in graph.graph.output] == ["actions"]
    (batch, obs_dim) = graph.graph.input[0].type.tensor_type.shape.dim
    assert batch.dim_param and not batch.HasField("dim_value") and obs_dim.dim_value == 5
    (batch_out, actions_dim) = graph.graph.output[0].type.tensor_type.shape.dim
    assert batch_out.dim_param and actions_dim.dim_value == 3
    obs = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32) * 30.0
    (actions,) = ReferenceEvaluator(graph).run(["actions"], {"obs": obs})
    assert actions.shape == (7, 3) and actions.dtype == np.float32
    np.testing.assert_allclose(actions, numpy_actions(path, obs), rtol=1e-4, atol=1e-5)


def test_without_out_the_files_go_next_to_the_checkpoint(tmp_path, monkeypatch, torchscript_only):
    """Not into the working directory: also from the command line, whose --out defaults to the same folder."""
    run_dir, elsewhere = tmp_path / "runs" / "cartpole" / "2026", tmp_path / "elsewhere"
    run_dir.mkdir(parents=True)
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = small_checkpoint(run_dir / "model_3.pt")
    written = export.export(path)
    assert written["torchscript"] == str(run_dir / "model_3.policy.pt")
    assert os.listdir(elsewhere) == []
    os.remove(written["torchscript"])
    monkeypatch.setattr(sys, "argv", ["ppo.export", path])
    export.main()
    assert os.path.isfile(run_dir / "model_3.policy.pt") and os.listdir(elsewhere) == []


def test_an_unwritable_out_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    # The tests run as root, for whom every folder is writable: the write probe is refused here instead.
    from dist import log_root as write_check       # dist.log_root.write_refusal, export's probe
    path = small_checkpoint(tmp_path / "model_3.pt")
    out = tmp_path / "read-only"
    out.mkdir()
    real_mkdtemp = write_check.tempfile.mkdtemp

    def mkdtemp(prefix, dir):
        if os.path.samefile(dir, out):
            raise PermissionError(13, "Permission denied")
        return real_mkdtemp(prefix=prefix, dir=dir)
    monkeypatch.setattr(write_check.tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(ValueError, match=r"--out .*read-only.* is not writable"):
        export.export(path, str(out))
    assert os.listdir(out) == []


@pytest.mark.parametrize("state", [{"model": {}}, {"config": {}}, [1, 2]])
def test_a_checkpoint_without_model_or_config_is_a_one_line_error(tmp_path, state):
    path = tmp_path / "model_1.pt"
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"is not a train.py checkpoint \(it needs 'model' and 'config' entries\)"):
        export.export(str(path), str(tmp_path / "out"))


@pytest.mark.parametrize("normalized, words", [(True, "with"), (False, "no")])
def test_summary_line_names_sizes_and_the_normalizer(tmp_path, capsys, torchscript_only, normalized, words):
    path = small_checkpoint(tmp_path / "model_3.pt", normalized)
    export.export(path, str(tmp_path / "out"))
    out = capsys.readouterr().out
    assert f"[export] {path}: obs dim 5 -> 3 actions ({words} observation normalizer)\n" in out


@pytest.mark.parametrize("env, note", [
    ({}, None),
    ({"action_scale": 1.0, "action_clip": None}, None),
    ({"action_scale": 0.5}, "scaled them by 0.5"),                               # was "... clipped them to None"
    ({"action_scale": 1.0, "action_clip": 2.0}, "clipped them to [-2.0, 2.0]"),
    ({"action_scale": 0.25, "action_clip": 3.0}, "scaled them by 0.25, then clipped them to [-3.0, 3.0]"),
    ({"name": "gymnasium", "action_scale": 2.0}, "scaled them by 2.0, then clipped them to the action space's bounds"),
    ({"name": "gymnasium"}, "clipped them to the action space's bounds"),      # always: envs/gymnasium.py
])
def test_export_notes_what_the_run_did_to_actions_before_the_simulator(tmp_path, capsys, torchscript_only, env,
                                                                       note):
    path = small_checkpoint(tmp_path / "model_3.pt", env=env)
    export.export(path, str(tmp_path / "out"))
    out = capsys.readouterr().out
    if note is None:
        assert "note:" not in out
    else:
        assert (f"[export] note: before the simulator, the run {note}; the exported policy outputs actions without "
                f"that") in out


# ---- ppo/logger.py ------------------------------------------------------------------------------------

class FakeClock:
    """Stands in for the `time` module of ppo/logger.py: `time()` reads `now`, `sleep(s)` advances it."""

    def __init__(self, now: float):
        self.now, self.sleeps = now, []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += 0.25


def tb_scalars(run_dir: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_console_line_counts_formats_and_eta_by_hand(tmp_path, monkeypatch, capsys):
    clock = FakeClock(1000.0)
    monkeypatch.setattr(logger_module, "time", clock)
    logger = RunLogger(str(tmp_path), max_iterations=10, start_iteration=2, steps_per_iteration=4)  # from model_2.pt
    clock.now = 1120.0
    # Iteration index 5 is the 6th of 10 and the 4th of this process: 120 s / 4 x 4 left = 120 s = 2.0 min.
    logger.print_line(5, {"Perf/total_fps": 1234.4, "Train/mean_reward": 3.5, "Train/mean_episode_length": 20.0,
                          "Policy/kl": 0.0123, "Loss/learning_rate": 3e-4})
    logger.close()
    assert capsys.readouterr().out == ("it     6/10       1234 steps/s  reward     3.50  ep_len   20.0  "
                                       "kl 0.0123  lr 3.0e-04  ETA   2.0 min\n")


def test_console_line_prints_a_dash_for_a_non_finite_metric(tmp_path, capsys):
    logger = RunLogger(str(tmp_path), 10, 0, 4)
    logger.print_line(0, {"Perf/total_fps": 1.0, "Policy/kl": 0.0, "Loss/learning_rate": 1e-3,
                          "Train/mean_reward": float("nan"), "Train/mean_episode_length": float("inf")})
    logger.close()
    line = capsys.readouterr().out
    assert "reward        -  ep_len      -" in line and "nan" not in line and "inf" not in line


def test_every_tag_of_a_log_call_is_written_at_its_step_in_a_new_run_directory(tmp_path):
    run_dir = str(tmp_path / "cartpole" / "2026-01-01_12-00-00")        # does not exist yet: a fresh run
    logger = RunLogger(run_dir, max_iterations=5, start_iteration=0, steps_per_iteration=4)
    logger.log({"Train/mean_reward": 1.5, "Policy/kl": 0.25, "Loss/learning_rate": 0.125}, step=1)
    logger.log({"Train/mean_reward": 2.5, "Policy/kl": 0.5, "Loss/learning_rate": 0.0625}, step=2)
    logger.close()
    assert tb_scalars(run_dir, "Train/mean_reward") == [(1, 1.5), (2, 2.5)]
    assert tb_scalars(run_dir, "Policy/kl") == [(1, 0.25), (2, 0.5)]
    assert tb_scalars(run_dir, "Loss/learning_rate") == [(1, 0.125), (2, 0.0625)]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")    # the writer thread is silent
@pytest.mark.parametrize("when", ["start", "log"])
def test_a_full_disk_under_tensorboard_is_a_one_line_error_naming_the_run_directory(tmp_path, monkeypatch, when):
    """TensorBoard writes from a thread of its own; the OSError it meets (a --log.root disk that filled up, at the
    start or mid-run) is re-raised by the next write or flush, and cli() reported it as a bug: `error: unexpected
    OSError (traceback above): [Errno 28] No space left on device`, with no path."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    def disk_full(self, data):
        raise OSError(28, "No space left on device")
    run_dir = str(tmp_path / "run")
    threads_before = set(threading.enumerate())
    if when == "log":
        logger = RunLogger(run_dir, max_iterations=5, start_iteration=0, steps_per_iteration=4)
    monkeypatch.setattr(RecordWriter, "write", disk_full)
    with pytest.raises(RunError, match=f"could not write TensorBoard events in {run_dir}: No space left on device; "):
        if when == "start":
            RunLogger(run_dir, max_iterations=5, start_iteration=0, steps_per_iteration=4)
        else:
            logger.log({"Policy/kl": 0.25}, step=1)
    # Joined here: a traceback of the writer thread would be this test's (an error, above), not a later test's.
    for thread in set(threading.enumerate()) - threads_before:
        thread.join(timeout=30)


def test_only_the_writer_thread_s_oserror_is_left_to_the_next_write():
    """Any other thread's failure, and any other error of the writer thread, still reaches the hook it wraps."""
    seen, writer = [], type("_AsyncWriterThread", (threading.Thread,), {})()
    calls = [(OSError(28, "full"), writer), (ValueError("bug"), writer), (OSError(5, "io"), threading.Thread())]
    for error, thread in calls:
        leave_writer_oserrors(seen.append)(threading.ExceptHookArgs((type(error), error, None, thread)))
    assert [args.exc_value for args in seen] == [calls[1][0], calls[2][0]]


def test_a_non_finite_scalar_is_written_as_is_and_said_once_per_tag(tmp_path, capsys):
    """A NaN in an env's log value (one rank's sum poisons the all-reduced mean) used to reach TensorBoard silently,
    where the curve just stops drawing: now one warning per tag, and the value is still written."""
    run_dir = str(tmp_path / "run")
    logger = RunLogger(run_dir, max_iterations=5, start_iteration=0, steps_per_iteration=4)
    logger.log({"Episode/torque": float("nan"), "Policy/kl": 0.25}, step=1)
    logger.log({"Episode/torque": float("nan"), "Policy/kl": float("inf")}, step=2)
    logger.log({"Episode/torque": 1.5, "Policy/kl": 0.5}, step=3)
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in out] == ["[syncppo] warning: Episode/torque is nan at iteration 1",
                                                     "[syncppo] warning: Policy/kl is inf at iteration 2"]
    torque = tb_scalars(run_dir, "Episode/torque")
    assert [step for step, _ in torque] == [1, 2, 3] and math.isnan(torque[0][1]) and torque[2][1] == 1.5


def test_skipped_update_steps_are_said_once_and_counted_on_every_console_line(tmp_path, capsys):
    """An env whose rewards were 1e30 (finite, so accepted) made every gradient norm inf: each step was skipped and
    the run trained nothing, with nothing on the console. Now one warning at the first skip, `skipped k/n` after."""
    logger = RunLogger(str(tmp_path / "run"), max_iterations=5, start_iteration=0, steps_per_iteration=20)
    line = {"Perf/total_fps": 1.0, "Policy/kl": 0.0, "Loss/learning_rate": 1e-3}
    for step, skipped in ((1, 0.0), (2, 3.0), (3, 20.0)):
        logger.log({"Train/nonfinite_skipped_steps": skipped}, step)
        logger.print_line(step - 1, {**line, "Train/nonfinite_skipped_steps": skipped})
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in out if "warning" in line] == [
        "[syncppo] warning: 3 of 20 update steps at iteration 2 had a non-finite gradient norm and were skipped"]
    printed = [line.split(" min", 1)[1] for line in out if line.startswith("it ")]     # what follows the ETA
    assert printed == ["", "  skipped 3/20", "  skipped 20/20"]


def test_an_iteration_is_on_disk_when_log_returns_even_if_the_process_then_ends_abruptly(tmp_path):
    """A process that ends without closing the writer (os._exit after a weight-serving thread's bug, kill -9) keeps
    every logged iteration and its episode returns: the writer flushed only every 2 minutes, so it lost them."""
    script = tmp_path / "log_then_exit.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {REPO!r})
        from ppo.logger import RunLogger
        logger = RunLogger({str(tmp_path / "run")!r}, max_iterations=5, start_iteration=0, steps_per_iteration=4)
        logger.log({{"Train/mean_reward": 1.5}}, 1, [3.0, -1.25])
        logger.log({{"Train/mean_reward": 2.5}}, 2)
        os._exit(1)
    """))
    assert run_python([str(script)]).returncode == 1                # a process of its own: tests/forked_python.py
    assert tb_scalars(str(tmp_path / "run"), "Train/mean_reward") == [(1, 1.5), (2, 2.5)]
    assert tb_scalars(str(tmp_path / "run"), "Episode/return") == [(1, 3.0), (1, -1.25)]


T = 1_700_000_000


def test_wait_lasts_until_the_second_after_the_newest_event_file(tmp_path, monkeypatch):
    for name in (f"events.out.tfevents.{T - 5}.host.1.0",          # older attempt
                 f"events.out.tfevents.{T + 1}.host.2.0",          # newest: made in the second T + 1
                 "events.out.tfevents.corrupt",                    # no creation second: not an event file name
                 f"notevents.out.tfevents.{T + 9}.host.3.0",       # not an event file
                 f"model_{T + 9}.pt"):
        (tmp_path / name).write_bytes(b"")
    clock = FakeClock(T + 0.5)
    monkeypatch.setattr(logger_module, "time", clock)
    wait_past_earlier_event_files(str(tmp_path))
    assert clock.now == T + 2.0 and all(0 < s <= 0.1 for s in clock.sleeps)     # the first instant past T + 1


def test_no_wait_when_every_event_file_is_older_or_there_is_no_directory(tmp_path, monkeypatch):
    (tmp_path / f"events.out.tfevents.{T - 1}.host.1.0").write_bytes(b"")
    clock = FakeClock(T + 0.5)
    monkeypatch.setattr(logger_module, "time", clock)
    wait_past_earlier_event_files(str(tmp_path))
    wait_past_earlier_event_files(str(tmp_path / "missing"))
    assert clock.sleeps == [] and clock.now == T + 0.5


# ---- envs/__init__.py ---------------------------------------------------------------------------------

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


@pytest.mark.parametrize("name", ["mujoco", "", "Cartpole"])
def test_make_env_refuses_an_unknown_name(name):
    with pytest.raises(ValueError, match=rf"unknown --env.name '{name}'; choose cartpole, tracking, gymnasium or "
                                         rf"isaaclab"):
        make_env(EnvConfig(name=name, num_envs=2), CPU, seed=0, base_seed=0)
