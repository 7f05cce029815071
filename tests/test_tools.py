"""The tools around the learner: policy export, the run logger, and the bench scripts' pure logic
and command lines. Benches are never run here: their functions are imported and fed hand-made inputs."""

import dataclasses
import importlib.util
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from configs import PRESETS
from configs.config import PolicyConfig
from ppo import export
from ppo.actor_critic import build_actor_critic
from ppo.logger import RunLogger
from tests.forked_python import run_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_bench(name: str, folder: str = "bench"):
    """The script `folder`/`name`.py as a fresh module (a bench's main() and helpers, without running it)."""
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", os.path.join(REPO, folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exit_code(main, monkeypatch, argv: list):
    """Run a bench's main() with `argv` until it exits (argparse: 0 after --help, 2 on a bad flag); its code."""
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code


@pytest.fixture(scope="module")
def bench_grad_sync():
    return load_bench("bench_grad_sync")


# ---- bench/bench_grad_sync.py -------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [["--iters", "0"], ["--batch", "0"], ["--world-size", "0"], ["--warmup", "-1"],
                                   ["--bucket-mb", "0"], ["--timeout", "0"]])
def test_bench_grad_sync_bad_numbers_are_one_line(bench_grad_sync, monkeypatch, capsys, flags):
    """Bad counts used to start the ranks, which died with tracebacks (or, for --world-size 0, silently ran 2)."""
    def must_not_launch(*args, **kwargs):
        raise AssertionError("ranks were started with a bad flag")

    monkeypatch.setattr(bench_grad_sync, "launch", must_not_launch)
    assert exit_code(bench_grad_sync.main, monkeypatch, ["bench_grad_sync.py", *flags]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"bench_grad_sync.py: error: {flags[0]} must be ")


# ---- bench/fault_drills.py ----------------------------------------------------------------------------

@pytest.mark.parametrize("flags, code", [(["--help"], 0), (["--bogus"], 2)])
def test_fault_drills_help_and_bad_flags_run_no_drill(monkeypatch, capsys, flags, code):
    """`--help` (or a typo) used to be ignored: it ran all seven torchrun drills (minutes, 170 MB left in /tmp)."""
    fault_drills = load_bench("fault_drills")

    def must_not_run(*args, **kwargs):
        raise AssertionError("a drill was started")

    monkeypatch.setattr(fault_drills, "drill", must_not_run)
    assert exit_code(fault_drills.main, monkeypatch, ["fault_drills.py", *flags]) == code
    out, err = capsys.readouterr()
    assert ("--keep" in out) if code == 0 else err.splitlines()[-1].endswith("unrecognized arguments: --bogus")


# ---- ppo/logger.py ------------------------------------------------------------------------------------

def tb_scalars(run_dir: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_logger_restart_before_first_checkpoint_does_not_repeat_steps(tmp_path):
    """A torchrun restart before any checkpoint continues in the same run directory from iteration 0: the
    first attempt's steps must be dropped, as they are after a restart from a checkpoint."""
    first = RunLogger(str(tmp_path), max_iterations=10, start_iteration=0, steps_per_iteration=4)
    for step in (1, 2, 3):
        first.log({"Train/mean_reward": float(step)}, step)
    first.close()
    second = RunLogger(str(tmp_path), max_iterations=10, start_iteration=0, steps_per_iteration=4)  # restarted
    for step in (1, 2):
        second.log({"Train/mean_reward": 10.0 + step}, step)
    second.close()
    assert tb_scalars(str(tmp_path), "Train/mean_reward") == [(1, 11.0), (2, 12.0)]


def test_logger_restart_from_checkpoint_keeps_steps_before_it(tmp_path):
    first = RunLogger(str(tmp_path), max_iterations=10, start_iteration=0, steps_per_iteration=4)
    for step in (1, 2, 3, 4):
        first.log({"Train/mean_reward": float(step)}, step)
    first.close()
    second = RunLogger(str(tmp_path), max_iterations=10, start_iteration=2, steps_per_iteration=4)  # model_2.pt
    for step in (3, 4):
        second.log({"Train/mean_reward": 10.0 + step}, step)
    second.close()
    assert tb_scalars(str(tmp_path), "Train/mean_reward") == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]


# ---- ppo/export.py ------------------------------------------------------------------------------------

def small_checkpoint(path, normalize_actor_obs: bool) -> str:
    """A checkpoint with the entries export reads: a model state_dict and the run config."""
    torch.manual_seed(0)
    cfg = PolicyConfig(actor_hidden=(8, 8), critic_hidden=(8,), normalize_actor_obs=normalize_actor_obs)
    model = build_actor_critic(cfg, {"policy": 5, "critic": 6}, 3)
    if normalize_actor_obs:
        norm = model.actor_normalizer
        norm.mean.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0, 100.0]))
        norm.std.copy_(torch.tensor([2.0, 0.5, 1.0, 1e-3, 10.0]))
    torch.save({"model": model.state_dict(), "config": {"policy": dataclasses.asdict(cfg), "env": {}}}, path)
    return str(path)


def numpy_actions(state: dict, obs: np.ndarray, normalized: bool) -> np.ndarray:
    """The mean action by hand: normalize (clip 10), then Linear / ELU / Linear / ELU / Linear in float64."""
    x = obs.astype(np.float64)
    if normalized:
        mean, std = state["actor_normalizer.mean"].double().numpy(), state["actor_normalizer.std"].double().numpy()
        x = np.clip((x - mean) / (std + 1e-8), -10.0, 10.0)
    for i in (0, 2, 4):
        x = x @ state[f"actor.{i}.weight"].double().numpy().T + state[f"actor.{i}.bias"].double().numpy()
        if i < 4:
            x = np.where(x > 0, x, np.expm1(np.minimum(x, 0)))
    return x


@pytest.mark.parametrize("normalized", [True, False])
def test_exported_policy_matches_a_hand_computation(tmp_path, normalized):
    path = small_checkpoint(tmp_path / "model_3.pt", normalized)
    written = export.export(path, str(tmp_path / "out"))
    scripted = torch.jit.load(written["torchscript"])
    obs = torch.randn(32, 5, generator=torch.Generator().manual_seed(1)) * torch.logspace(-1, 2, 32)[:, None]
    with torch.no_grad():
        actions = scripted(obs)
    assert actions.dtype == torch.float32 and actions.shape == (32, 3)
    expected = numpy_actions(torch.load(path, weights_only=True)["model"], obs.numpy(), normalized)
    np.testing.assert_allclose(actions.numpy(), expected, rtol=1e-4, atol=1e-5)
    program_actions = torch.export.load(written["torch.export"]).module()(obs)
    np.testing.assert_allclose(program_actions.numpy(), expected, rtol=1e-4, atol=1e-5)


def test_export_out_that_is_a_file_is_a_usage_error(tmp_path):
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    not_a_dir = tmp_path / "notes.txt"
    not_a_dir.write_text("hello")
    # The whole message: with a bare "--out" the permission check's "is not writable" (os.access on a file, no x
    # bit) passed as well, so an export that swallowed makedirs' error went unnoticed.
    said = f"--out {str(not_a_dir)!r} cannot be an output folder (File exists)"
    with pytest.raises(ValueError) as exc:
        export.export(path, str(not_a_dir))
    assert str(exc.value) == said
    result = run_python(["-m", "ppo.export", path, "--out", str(not_a_dir)], cwd=REPO, timeout=120)
    assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("damage", ["missing layer", "unknown policy field", "wrong shape"])
def test_export_of_a_checkpoint_that_does_not_fit_is_one_line(tmp_path, damage):
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    state = torch.load(path, weights_only=True)
    if damage == "missing layer":
        del state["model"]["actor.0.weight"]
    elif damage == "unknown policy field":
        state["config"]["policy"]["actor_width"] = 64
    else:
        state["model"]["actor.2.weight"] = torch.zeros(8, 9)
    torch.save(state, path)
    said = "its model has no 'actor.0.weight'" if damage == "missing layer" else "does not fit this version's actor"
    with pytest.raises(ValueError, match=said):
        export.export(path)
    result = run_python(["-m", "ppo.export", path], cwd=REPO, timeout=120)
    assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr


def test_export_names_the_tensor_that_does_not_fit_on_one_line(tmp_path):
    # the message ended at load_state_dict's header line, "Error(s) in loading state_dict for ActorCritic:"
    path = small_checkpoint(tmp_path / "model_3.pt", False)
    state = torch.load(path, weights_only=True)
    state["model"]["actor.2.weight"] = torch.zeros(8, 9)
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"ActorCritic: size mismatch for actor\.2\.weight: .*Size\(\[8, 9\]\)") \
            as info:
        export.export(path)
    assert "\n" not in str(info.value)


# ---- Makefile -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("output, status, nproc", [
    ("No devices were found", 6, 2),                                  # the tools installed, no GPU
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9, 2),
    ("GPU 0: NVIDIA H200 (UUID: GPU-1)", 0, 1),
    ("GPU 0: NVIDIA H200 (UUID: GPU-1)\nGPU 1: NVIDIA H200 (UUID: GPU-2)", 0, 2),
])
def test_make_train_counts_gpus_not_lines_of_nvidia_smi(tmp_path, output, status, nproc):
    assert f"--nproc-per-node {nproc} train.py" in _make_train_dry(tmp_path, output, status)


def _make_train_dry(tmp_path, output, status, **environ) -> str:
    """`make -n train`'s output with a fake nvidia-smi that prints `output` and exits `status`."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"{output}\"\nexit {status}\n")
    fake.chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if k not in ("NPROC", "CUDA_VISIBLE_DEVICES")}, **environ,
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    result = subprocess.run(["make", "-n", "train"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return result.stdout + result.stderr


@pytest.mark.parametrize("visible, nproc", [("0", 1), ("1,0", 2), ("", 2), ("-1", 2), ("GPU-1", 1), ("1,-1,0", 1)])
def test_make_train_starts_a_rank_per_gpu_cuda_visible_devices_leaves_visible(tmp_path, visible, nproc):
    """Two GPUs, CUDA_VISIBLE_DEVICES=0: one rank (it started 2, and dist.setup refused more ranks than visible
    GPUs); none visible ("" or -1): the 2 CPU ranks (it started one gloo rank per hidden GPU)."""
    two = "GPU 0: NVIDIA H200 (UUID: GPU-1)\nGPU 1: NVIDIA H200 (UUID: GPU-2)"
    assert f"--nproc-per-node {nproc} train.py" in _make_train_dry(tmp_path, two, 0, CUDA_VISIBLE_DEVICES=visible)


def test_make_train_reads_cuda_visible_devices_given_to_make_too(tmp_path):
    """Before make 4.4 `$(shell)` does not see a variable set on make's command line: `make train
    CUDA_VISIBLE_DEVICES=1` started a rank per GPU (2) while torchrun's ranks saw one."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf 'GPU 0: a\\nGPU 1: b\\n'\n")
    fake.chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if k not in ("NPROC", "CUDA_VISIBLE_DEVICES")},
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    result = subprocess.run(["make", "-n", "train", "CUDA_VISIBLE_DEVICES=1"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60)
    assert "--nproc-per-node 1 train.py" in result.stdout, result.stdout + result.stderr


def test_make_setup_isaaclab_quotes_a_venv_path_with_a_space():
    """make's abspath splits on spaces: the activate line read `. '/opt/my /repo/venv'/bin/activate`."""
    result = subprocess.run(["make", "-n", "setup-isaaclab", "ISAACLAB_VENV=/opt/my venv"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert ". '/opt/my venv'/bin/activate && " in result.stdout, result.stdout + result.stderr
    result = subprocess.run(["make", "-n", "setup-isaaclab"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert f". '{REPO}/.venv-isaaclab'/bin/activate && " in result.stdout, result.stdout + result.stderr


def test_make_passes_args_to_the_shell_as_typed(tmp_path):
    """A `$` in ARGS reaches the shell (make read `$HOME` as its variable `$H` then `OME`: the run went elsewhere)."""
    result = subprocess.run(["make", "-n", "train", "ARGS=--log.root /tmp/$HOME/x", "NPROC=1"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert "--log.root /tmp/$HOME/x" in result.stdout, result.stdout + result.stderr


def test_make_train_with_the_isaaclab_preset_runs_in_its_environment(tmp_path):
    """`make train PRESET=isaaclab` ran .venv's torchrun, where Isaac Lab is never installed (make setup-isaaclab puts
    it in its own environment): it now runs that environment's torchrun, and says so when there is none yet."""
    venv = tmp_path / "isaac env"
    result = subprocess.run(["make", "train", "PRESET=isaaclab", f"ISAACLAB_VENV={venv}", "NPROC=1"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr.splitlines()[0]) == (2, f"error: PRESET=isaaclab runs in {venv}/bin/"
                                                                     "torchrun; it is not there: make setup-isaaclab "
                                                                     "first (docs/simulators.md)")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "torchrun").write_text("#!/bin/sh\necho \"isaac torchrun $*\"\n")
    (venv / "bin" / "torchrun").chmod(0o755)
    result = subprocess.run(["make", "train", "PRESET=isaaclab", f"ISAACLAB_VENV={venv}", "NPROC=1",
                             "VENV=/nonexistent", "ARGS=--env.task T"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert "isaac torchrun --standalone --nproc-per-node 1 train.py isaaclab --env.task T" in result.stdout, \
        result.stdout + result.stderr


def test_make_dash_j_still_checks_before_building(tmp_path):
    """With -j the venv's prerequisites ran beside the checks: a mistyped PRESET started building .venv first."""
    result = subprocess.run(["make", "-j2", "train", "PRESET=nope", f"VENV={tmp_path / 'fresh'}", "PY=false"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "venv" not in result.stdout and not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("setting, said", [
    # The list read off PRESETS (the Makefile's is compared with it below): a new preset edits no test here.
    ("PRESET=nope", f"error: PRESET=nope is not a preset; use one of: {' '.join(PRESETS)}"),
    ("PRESET=", f"error: PRESET= is not a preset; use one of: {' '.join(PRESETS)}"),
    ("PRESET=tracking; echo INJECTED", "error: PRESET=tracking; echo INJECTED is not a preset; use one of: "),
    ("NPROC=0", "error: NPROC=0 must be a positive number of ranks"),      # torchrun: a bare AssertionError
    ("NPROC=abc", "error: NPROC=abc must be a positive number of ranks"),  # torchrun: a ValueError traceback
    ("NPROC=it's", "error: NPROC=it's must be a positive number of ranks"),
    ("PRESET=cartpole tracking", "error: PRESET=cartpole tracking is not a preset"),   # each a preset: it launched
])
def test_make_train_refuses_a_preset_or_rank_count_before_building_or_launching_anything(setting, said):
    """`PRESET='tracking; echo INJECTED' ARGS=--help` ran a whole training run, then the echo."""
    result = subprocess.run(["make", "train", setting, "ARGS=--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and result.stderr.startswith(said), result.stdout + result.stderr
    assert "INJECTED\n" not in result.stdout and "torchrun" not in result.stdout


def test_the_makefile_s_presets_are_train_py_s():
    text = open(os.path.join(REPO, "Makefile")).read()
    assert text.split("\nPRESETS := ", 1)[1].split("\n", 1)[0].split() == list(PRESETS)


@pytest.mark.parametrize("port", ["abc", "0", "65536", "99999", "-1", "1; echo INJECTED"])
def test_make_tensorboard_refuses_a_port_that_is_not_one(port):
    result = subprocess.run(["make", "tensorboard", f"PORT={port}"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stderr.splitlines()[0]) == (2, f"error: PORT={port} must be a port number from "
                                                                     f"1 to 65535")
    assert "INJECTED" not in result.stdout



@pytest.mark.parametrize("setting, said", [("PORT=abc", "error: PORT=abc must be a port number"),
                                           ("LOGDIR=/nonexistent/runs", "error: LOGDIR=/nonexistent/runs is not a folder")])
def test_make_tensorboard_refuses_its_settings_before_building_the_venv(tmp_path, setting, said):
    """The checks ran in the recipe, after .venv was built: on a fresh clone a mistyped PORT installed torch first."""
    result = subprocess.run(["make", "tensorboard", setting, f"VENV={tmp_path / 'fresh'}", "PY=false"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith(said), result.stdout + result.stderr
    assert "venv" not in result.stdout and not (tmp_path / "fresh").exists()


def test_make_bench_passes_args_to_every_bench():
    """`make bench ARGS=--quick` ran the throughput bench at full length (only the sub-makes got ARGS)."""
    result = subprocess.run(["make", "-n", "bench", "ARGS=--quick"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert "bench/bench_train.py --quick" in result.stdout, result.stdout + result.stderr

# ---- bench/bench_rollout.py ---------------------------------------------------------------------------

def test_bench_rollout_out_that_is_a_file_is_a_usage_error(tmp_path, monkeypatch, capsys):
    bench_rollout = load_bench("bench_rollout")
    for part in ("throughput", "weight_sync", "learning"):
        monkeypatch.setattr(bench_rollout, part, lambda *a: (_ for _ in ()).throw(AssertionError("a part ran")))
    not_a_dir = tmp_path / "notes.txt"
    not_a_dir.write_text("hello")
    monkeypatch.setattr(sys, "argv", ["bench_rollout.py", "--quick", "--out", str(not_a_dir)])
    with pytest.raises(SystemExit) as exit_info:
        bench_rollout.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"bench_rollout.py: error: --out {str(not_a_dir)!r} ")


def test_make_tensorboard_without_its_folder_says_so(tmp_path):
    """A fresh clone's `make tensorboard` (no runs/ yet) served an empty board without a word."""
    result = subprocess.run(["make", "tensorboard", f"LOGDIR={tmp_path / 'none'}"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert (result.returncode, result.stderr.splitlines()[0]) == (
        2, f"error: LOGDIR={tmp_path / 'none'} is not a folder: train first (make train) or set LOGDIR to a run's "
           f"--log.root")


def test_bench_rollout_out_where_nothing_can_be_made_is_a_usage_error(monkeypatch, capsys):
    """/proc exists, so makedirs passes even for root; the scratch folder inside it was a traceback."""
    bench_rollout = load_bench("bench_rollout")
    monkeypatch.setattr(sys, "argv", ["bench_rollout.py", "--quick", "--out", "/proc"])
    with pytest.raises(SystemExit) as exit_info:
        bench_rollout.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("bench_rollout.py: error: --out '/proc' cannot hold "
                                                               "run directories (")


def test_a_restart_in_the_same_second_writes_an_event_file_that_sorts_last(tmp_path):
    """TensorBoard reads event files in name order (creation second, host, pid): a restart's file must come after
    the attempt before, or that attempt's steps, read last, purge the restart's."""
    # A second ahead of the clock, so the new file can sort after it only by waiting (with the current second,
    # a clock that ticks over between the two lines would pass the test without the wait).
    earlier = tmp_path / f"events.out.tfevents.{int(time.time()) + 1}.zzzz-host.99999.0"   # last within its second
    earlier.write_bytes(b"")
    RunLogger(str(tmp_path), 10, 3, 4).writer.close()
    names = sorted(os.listdir(tmp_path))
    assert names[0] == earlier.name and len(names) == 2


def test_closing_the_logger_ends_the_writer_s_thread(tmp_path):
    """Every log() flushes, so what close() adds is the end of TensorBoard's writer thread and event file; a close()
    that only flushed left both open for the life of the process (a thread per RunLogger when one process runs
    train.main again: tests, a notebook, a sweep)."""
    import threading

    from ppo.logger import RunLogger
    before = set(threading.enumerate())
    logger = RunLogger(str(tmp_path / "run"), max_iterations=5, start_iteration=0, steps_per_iteration=4)
    logger.log({"Policy/kl": 0.25}, step=1)
    assert set(threading.enumerate()) - before                # the writer's own thread, while open
    logger.close()
    assert not set(threading.enumerate()) - before
