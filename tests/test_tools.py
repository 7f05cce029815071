"""The tools around the learner: policy export, the run logger, and the bench scripts' pure logic
and command lines. Benches are never run here: their functions are imported and fed hand-made inputs."""

import dataclasses
import importlib.util
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from configs.config import PolicyConfig
from ppo import export
from ppo.actor_critic import build_actor_critic
from ppo.logger import RunLogger
from tests.forked_python import run_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(REPO, "bench", f"{name}.py"))
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
def bench_train():
    return load_bench("bench_train")


@pytest.fixture(scope="module")
def bench_grad_sync():
    return load_bench("bench_grad_sync")


# ---- bench/bench_train.py -----------------------------------------------------------------------------

def test_bench_train_median_of_an_even_number_of_rounds(bench_train):
    # `--quick` large has 2 timed rounds, the full large setting 4: the median of two ratios is their mean,
    # not the larger one.
    assert bench_train.median([0.8, 1.0]) == pytest.approx(0.9)
    assert bench_train.median([4.0, 1.0, 3.0, 2.0]) == pytest.approx(2.5)
    assert bench_train.median([3.0, 1.0, 2.0]) == 2.0
    rng = np.random.default_rng(0)
    for n in range(1, 12):
        xs = rng.random(n).tolist()
        assert bench_train.median(xs) == pytest.approx(float(np.median(xs)))


def test_bench_train_interleaves_with_train_main(bench_train, monkeypatch, tmp_path):
    # run_interleaved replaces train.RunLogger with a subclass that times each iteration: it must take every
    # argument train.main logs with (the episode returns too; it raised TypeError at the first iteration). RSL-RL
    # is replaced by a runner that finishes at once, so syncppo runs its iterations alone.
    from configs import preset

    class NoRunner:
        logger = type("Logger", (), {"log": staticmethod(lambda **kw: None)})()
        alg = type("PPO", (), {"compute_returns": staticmethod(lambda obs: None)})()

        def learn(self, iterations):
            pass

    monkeypatch.setattr(bench_train, "rsl_rl_runner", lambda cfg, log_dir, device: NoRunner())
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 16, 8, 2
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16,)
    cfg.log.episode_returns = True
    rows = bench_train.run_interleaved(cfg, str(tmp_path), [(1, 1, 1)], torch.device("cpu"))
    assert len(rows["syncppo"]) == 2 and rows["rsl-rl"] == [] and rows["limit"] == []
    assert bench_train.train.RunLogger is RunLogger     # put back


class FakeDevice:
    """A device whose work takes time: each sync advances a fake clock by `drain` s and is logged with the learner
    whose thread called it (syncppo runs in the main thread); `work(s)` advances the clock."""

    def __init__(self, drain: float = 0.25):
        self.now, self.drain, self.events = 100.0, drain, []

    def perf_counter(self) -> float:
        return self.now

    def work(self, seconds: float) -> None:
        self.now += seconds

    def synchronize(self, device) -> None:
        self.now += self.drain
        self.events.append(("sync", "syncppo" if threading.current_thread() is threading.main_thread() else "rsl-rl"))


def test_bench_train_clocks_wait_for_the_device_and_no_learner_leaves_work_queued(bench_train, monkeypatch, tmp_path,
                                                                                   capsys):
    # RSL-RL's clocks are host clocks over queued work: the rollout's last kernels drain inside its learning clock
    # (at compute_returns), its update's at its logging call. Faked: RSL-RL logs collect 1 s, learn 2 s; each sync
    # drains 0.25 s; compute_returns (GAE, last value) takes 0.5 s. Collection gets the rollout's drain and
    # compute_returns (1 s); the update keeps the rest of its clock (1 s) plus the drain at logging.
    from configs import preset
    fake = FakeDevice()
    monkeypatch.setattr(bench_train, "_synchronize", fake.synchronize)
    monkeypatch.setattr(bench_train, "time", fake)

    class RecordingBaton(bench_train.Baton):
        def pass_on(self, name, finished=False):
            if not finished:
                fake.events.append(("pass", name))
            super().pass_on(name, finished)
    monkeypatch.setattr(bench_train, "Baton", RecordingBaton)

    class FakeRunner:
        def __init__(self):
            self.logger = type("Logger", (), {"log": staticmethod(lambda **kw: None)})()
            self.alg = type("PPO", (), {"compute_returns": staticmethod(lambda obs: fake.work(0.5))})()

        def learn(self, iterations):
            for _ in range(iterations):
                self.alg.compute_returns(None)
                self.logger.log(collect_time=1.0, learn_time=2.0)

    monkeypatch.setattr(bench_train, "rsl_rl_runner", lambda cfg, log_dir, device: FakeRunner())
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 16, 8, 2
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16,)
    rows = bench_train.run_interleaved(cfg, str(tmp_path), [(1, 1, 1)], torch.device("cpu"))
    assert rows["rsl-rl"] == [pytest.approx((2.0, 1.25, 1.0))] * 2
    assert len(rows["syncppo"]) == 2 and len(rows["limit"]) == 2
    passes = [i for i, event in enumerate(fake.events) if event[0] == "pass"]
    assert [fake.events[i][1] for i in passes] == ["syncppo", "rsl-rl"] * 2
    for i in passes:      # each learner drains the device just before the other's clock can start
        assert fake.events[i - 1] == ("sync", fake.events[i][1]), fake.events
    err = capsys.readouterr().err      # each round on stderr as it ends (what a killed run leaves)
    assert "[bench_train] rsl-rl iteration 2: collection 2.0000 s, update 1.2500 s, matmul limit" in err
    assert "[bench_train] syncppo iteration 2: collection" in err


def test_bench_train_gpu_matmul_limit_queues_the_gemms_between_two_syncs(bench_train, monkeypatch):
    # A sync around each shape timed a host round trip per GEMM, about as long as a small GEMM on a GPU.
    fake = FakeDevice()
    monkeypatch.setattr(bench_train, "_synchronize", fake.synchronize)
    monkeypatch.setattr(bench_train, "time", fake)
    cpu_randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *shape, device=None: cpu_randn(*shape))   # no CUDA here

    def mm(a, b):
        fake.events.append(("mm", a.shape[0]))
        fake.work(0.01 * a.shape[0])
    monkeypatch.setattr(torch, "mm", mm)
    seconds = bench_train.matmul_limit_seconds([(2, 3, 4), (5, 6, 7)], torch.device("cuda"))
    assert seconds == pytest.approx(0.07 + 0.25)     # both GEMMs and one drain; no sync between them
    names = [e[0] if e[0] == "sync" else e[1] for e in fake.events]
    assert names == [2, 5] + ["sync", 2, 5, "sync"] * 3


def test_bench_train_table_labels_the_gpu_limit_and_notes_rsl_rl_s_own_split(bench_train, monkeypatch, capsys):
    from configs import preset
    cfg = preset("tracking")
    rows = {"syncppo": [(9.0, 9.0)] + [(1.0, 1.0)] * 3, "rsl-rl": [(9.0, 9.0, 9.0)] + [(2.0, 1.25, 1.0)] * 3,
            "limit": [0.5] * 4}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    for device, label in (("cpu", False), ("cuda", True)):
        bench_train.report("large", cfg, rows, 1, [(1, 1, 1)], torch.device(device))
        bench_train.report_notes(rows, 1)
        out = capsys.readouterr().out
        assert ("GEMMs' share of the update, not a roofline" in out) is label
        assert "3 interleaved rounds after 1 warm-up" in out
        assert "| syncppo | 6,144 | 1.000 | 1.000 |" in out and "| 1.62x | 0.80x |" in out   # warm-up left out
        assert "syncppo's update 0.44x of it" in out          # 1 / (1.25 + 1)
        assert all(line in out for line in bench_train.DIFFERENCES)


def test_bench_train_without_rsl_rl_is_one_line(bench_train, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rsl_rl", None)      # import rsl_rl raises ImportError
    assert exit_code(bench_train.main, monkeypatch, ["bench_train.py", "--quick"]) == 2
    assert "RSL-RL is not installed: make bench installs it" in capsys.readouterr().err


def test_bench_train_gemm_shapes_by_hand(bench_train):
    # actor 3 -> 4 -> 2, critic 5 -> 4 -> 1, minibatch 7: forward (B, in, out), weight grad (out, B, in),
    # input grad (B, out, in) except for the first layer.
    shapes = bench_train.gemm_shapes({"policy": 3, "critic": 5}, (4,), 2, 7)
    assert shapes == [(7, 3, 4), (4, 7, 3),
                      (7, 4, 2), (2, 7, 4), (7, 2, 4),
                      (7, 5, 4), (4, 7, 5),
                      (7, 4, 1), (1, 7, 4), (7, 1, 4)]


def test_bench_train_zero_num_envs_is_a_usage_error(bench_train, monkeypatch, capsys):
    """`--num-envs 0` used to fall back to the setting's 512 envs silently (0 is falsy) and run the bench."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("the bench ran with a bad --num-envs")

    monkeypatch.setattr(bench_train, "run_interleaved", must_not_run)
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--quick", "--settings", "small", "--num-envs", "0"])
    with pytest.raises(SystemExit) as exit_info:
        bench_train.main()
    assert exit_info.value.code == 2
    # argparse's usage line lists every flag: only the error line says which one is wrong
    assert capsys.readouterr().err.splitlines()[-1] == "bench_train.py: error: --num-envs must be positive, got 0"


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
    with pytest.raises(ValueError, match="does not fit this version's actor-critic"):
        export.export(path)
    result = run_python(["-m", "ppo.export", path], cwd=REPO, timeout=120)
    assert result.returncode == 2 and "does not fit" in result.stderr and "Traceback" not in result.stderr


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
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"{output}\"\nexit {status}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    env.pop("NPROC", None)
    result = subprocess.run(["make", "-n", "train"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert f"--nproc-per-node {nproc} train.py" in result.stdout, result.stdout + result.stderr


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
