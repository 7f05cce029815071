"""Leftovers of the bench and Makefile audits: each refusal is one line before any run starts, and checks that more
than one bench makes live in one place (bench/_common.py)."""

import json
import os
import subprocess
import sys
import types

import pytest

import bench._common
from tests.test_bench_flags import Launched, launched_args, usage_error
from tests.test_tools import exit_code, load_bench

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- bench/_common.py ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["bench_train", "bench_grad_sync"])
def test_both_benches_check_omp_num_threads_through_the_one_function(monkeypatch, name):
    """bench_train and bench_grad_sync each carried their own copy of the OMP_NUM_THREADS check (a fix to one would
    miss the other): both now call bench._common.omp_threads, before anything else reads the variable.

    Mutant: the three-line check copied back into either bench -> the patched function is never called (no Launched).
    """
    def called(parser):
        raise Launched(parser.prog)
    monkeypatch.setattr(bench._common, "omp_threads", called)
    module = load_bench(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "abc")
    assert launched_args(module.main, monkeypatch, [f"{name}.py", "--quick"]) == f"{name}.py"


def _stopped_at_launch(monkeypatch, name: str, *launches: str):
    """bench `name` whose functions `launches` (where ranks, learners or jobs would start) raise Launched(last arg)."""
    module = load_bench(name)
    for launch in launches:
        monkeypatch.setattr(module, launch, lambda *a, **k: (_ for _ in ()).throw(Launched(a[-1])))
    return module


@pytest.mark.parametrize("name, launches, flags, twice", [
    ("bench_grad_sync", ["launch"], ["--quick", "--models", "20k", "20k"], "--models names 20k twice"),
    ("bench_train", ["run_interleaved"], ["--quick", "--settings", "small", "small"], "--settings names small twice"),
    ("bench_rollout", ["throughput", "weight_sync", "learning"], ["--quick", "--parts", "sync", "throughput", "sync"],
     "--parts names sync twice"),
])
def test_a_value_listed_twice_is_one_line_naming_the_flag(monkeypatch, capsys, tmp_path, name, launches, flags,
                                                          twice):
    """`--models 20k 20k`, `--settings small small` and `--parts sync sync` ran each once and dropped the repeat
    silently (a typo for another value never showed); bench_mujoco already refused its repeats in these words.

    Mutant: no refuse_repeats call in that bench -> it goes on to its launch (Launched, not exit 2).
    """
    module = _stopped_at_launch(monkeypatch, name, *launches)
    out = ["--out", str(tmp_path)] if name == "bench_rollout" else []
    line = usage_error(module.main, monkeypatch, capsys, [f"{name}.py", *flags, *out])
    assert line == f"{name}.py: error: {twice}; list each once"


# ---- bench/bench_mujoco.py ----------------------------------------------------------------------------

@pytest.fixture
def bench_mujoco(monkeypatch):
    """bench_mujoco that stops where a run's train.py would start (Launched), on a machine of 2 cores."""
    module = _stopped_at_launch(monkeypatch, "bench_mujoco", "run")
    monkeypatch.setattr(module.os, "cpu_count", lambda: 2)
    return module


@pytest.mark.parametrize("flags, most", [(["--jobs", "100", "--ranks", "1"], 100),
                                         (["--jobs", "1", "--ranks", "32"], 32),
                                         (["--jobs", "3", "--ranks", "1", "4"], 12)])
def test_bench_mujoco_refuses_more_ranks_at_once_than_4_per_core(bench_mujoco, monkeypatch, capsys, tmp_path, flags,
                                                                  most):
    """`--jobs 100` or `--ranks 32` on 2 cores started real torchrun jobs (hours of oversubscribed runs).

    Mutant: no bound on --jobs x max(--ranks) -> the bench reaches its first run (Launched, not exit 2).
    """
    top = max(int(v) for v in flags[flags.index("--ranks") + 1:])
    line = usage_error(bench_mujoco.main, monkeypatch, capsys,
                       ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", "Hopper-v4", *flags])
    assert line == (f"bench_mujoco.py: error: --jobs {flags[1]} x --ranks {top} is {most} ranks at a time, more than "
                    f"this machine can host: at most 4 per CPU core (2 cores, so 8 ranks)")


@pytest.mark.parametrize("flags", [["--jobs", "8", "--ranks", "1"], ["--jobs", "4", "--ranks", "1", "2"]])
def test_bench_mujoco_takes_4_ranks_per_core_or_any_count_where_cores_are_unknown(bench_mujoco, monkeypatch, tmp_path,
                                                                                   flags):
    """8 ranks at once on 2 cores start; so do 100 where the core count cannot be read (os.cpu_count() is None).

    Mutant: the bound exclusive (>=), or applied with no core count (None taken as 1) -> exit 2, not Launched.
    """
    argv = ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", "Hopper-v4", "--seeds", "1", *flags]
    assert launched_args(bench_mujoco.main, monkeypatch, argv).jobs == int(flags[1])
    monkeypatch.setattr(bench_mujoco.os, "cpu_count", lambda: None)
    assert launched_args(bench_mujoco.main, monkeypatch, argv + ["--jobs", "100"]).jobs == 100


def test_bench_mujoco_table_only_starts_no_run_so_takes_any_jobs(bench_mujoco, monkeypatch, tmp_path):
    """--table-only starts no run: a --jobs left in a command line it is added to is not a reason to refuse.

    Mutant: the bound applied under --table-only -> exit 2 instead of the empty table's message.
    """
    code = exit_code(bench_mujoco.main, monkeypatch, ["bench_mujoco.py", "--root", str(tmp_path), "--jobs", "100",
                                                      "--table-only"])
    assert code == f"bench_mujoco: no finished runs in {tmp_path / 'results.jsonl'}"


def _recorded(tmp_path, typed: int, steps: int) -> None:
    """results.jsonl with one finished Hopper-v4 1-rank run of seed 1, asked for as --total-steps `typed`."""
    record = {"key": f"Hopper-v4/ranks1/seed1/steps{typed}", "task": "Hopper-v4", "ranks": 1, "seed": 1,
              "steps": steps, "last_episodes_return": 1.0, "last_iterations_return": 1.0}
    (tmp_path / "results.jsonl").write_text(json.dumps(record) + "\n")


def test_bench_mujoco_refuses_a_total_steps_that_rounds_onto_recorded_runs(bench_mujoco, monkeypatch, capsys,
                                                                             tmp_path):
    """--total-steps 5000 after runs of --total-steps 4096 (both 2 iterations, 4,096 steps) ran seed 1 again under
    another key, and the table put both in one row ("seeds 1, 1").

    Mutant: no check_rounding call -> the seed-1 run starts again (Launched, not exit 2).
    """
    _recorded(tmp_path, 4096, 4096)
    line = usage_error(bench_mujoco.main, monkeypatch, capsys,
                       ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", "Hopper-v4", "--seeds", "1", "2",
                        "--ranks", "1", "--last-iterations", "1", "--total-steps", "5000"])
    assert line == (f"bench_mujoco.py: error: --total-steps 5000 rounds to 4,096 steps, as --total-steps 4096 of the "
                    f"runs recorded in {tmp_path / 'results.jsonl'} does: one table row would hold both; pass "
                    f"--total-steps 4096 (or another --root)")


@pytest.mark.parametrize("flags", [["--total-steps", "4096"], ["--total-steps", "6144"],
                                   ["--total-steps", "5000", "--ranks", "2"]])
def test_bench_mujoco_total_steps_of_their_own_row_still_run(bench_mujoco, monkeypatch, tmp_path, flags):
    """The same --total-steps adds seeds to the recorded runs; another step count, or other ranks, is another row.

    Mutant: the check refuses whatever differs from the recorded --total-steps (steps or ranks not compared).
    """
    _recorded(tmp_path, 4096, 4096)
    argv = ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", "Hopper-v4", "--seeds", "1", "2",
            "--last-iterations", "1", *flags]
    assert launched_args(bench_mujoco.main, monkeypatch, argv if "--ranks" in flags else argv + ["--ranks", "1"])


# ---- bench/bench_grad_sync.py -------------------------------------------------------------------------

def _rank_out_of_memory(rank, world, port, args, queue):
    raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes\nmore")


def test_bench_grad_sync_rank_out_of_memory_is_one_line_naming_batch(capfd):
    """A rank's allocation it cannot get (a huge --batch) printed each rank's traceback, then "a rank failed".

    Mutant: launch starts `target` itself, not through rank_main -> each rank's traceback and "a rank failed".
    """
    module = load_bench("bench_grad_sync")
    with pytest.raises(SystemExit) as info:
        module.launch(types.SimpleNamespace(device="cpu", world=2), _rank_out_of_memory)
    assert info.value.code == ("bench_grad_sync: out of memory: DefaultCPUAllocator: can't allocate memory: you tried "
                               "to allocate 8 bytes; lower --batch")
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.slow
def test_bench_grad_sync_huge_batch_is_one_line():
    """`bench_grad_sync.py --batch 100000000000` end to end (2 gloo ranks): exit 1 with one line on stderr.

    Mutant: rank_main re-raises every exception -> two allocator tracebacks before the summary line.
    """
    result = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_grad_sync.py"), "--quick", "--models",
                             "20k", "--batch", "100000000000"], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1 and result.stdout == "", result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("bench_grad_sync: out of memory: ") and result.stderr.endswith("; lower --batch\n")


# ---- Makefile -----------------------------------------------------------------------------------------

def _fake_venv(tmp_path):
    """A VENV whose bin/python and bin/pip only note their arguments (in calls.txt), with .runtime up to date."""
    venv, calls = tmp_path / "venv", tmp_path / "calls.txt"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "pip"):
        (venv / "bin" / tool).write_text(f'#!/bin/sh\necho {tool} "$@" >> {calls}\n')
        (venv / "bin" / tool).chmod(0o755)
    (venv / ".runtime").touch()
    return venv, calls


def test_make_bench_mujoco_installs_mujoco_once(tmp_path):
    """Every `make bench-mujoco` ran `pip install gymnasium[mujoco] mujoco` (seconds online, an error offline) before
    the bench, even to be told ARGS was wrong; now a stamp (VENV/.mujoco) makes it once.

    Mutant: bench-mujoco's install without the stamp (pip as a recipe of setup-mujoco) -> pip called twice.
    """
    venv, calls = _fake_venv(tmp_path)
    for _ in range(2):
        result = subprocess.run(["make", "bench-mujoco", f"VENV={venv}", "ARGS=--jobs 0"], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    lines = calls.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["pip", "python", "python"], lines
    assert lines[1:] == ["python bench/bench_mujoco.py --jobs 0"] * 2 and (venv / ".mujoco").exists()


def _make_train(tmp_path, *settings: str) -> subprocess.CompletedProcess:
    """`make train settings...` where a passing check goes on to build a venv that cannot be built (PY=false)."""
    return subprocess.run(["make", "train", "NPROC=2", *settings, "ARGS=--help", f"VENV={tmp_path / 'fresh'}",
                           "PY=false"], cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("threads", ["abc", "", "0", "-1", "2,1"])
def test_make_train_refuses_omp_num_threads_that_is_not_a_count(tmp_path, threads):
    """`make train OMP_NUM_THREADS=abc` (exported to every rank) made libgomp warn and run a thread per core in each.

    Mutant: no OMP_NUM_THREADS case in train-settings -> make goes on to build the venv (PY=false: exit 2, no line).
    """
    result = _make_train(tmp_path, f"OMP_NUM_THREADS={threads}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[0] == (f"error: OMP_NUM_THREADS={threads} must be a positive number of threads "
                                             f"(or unset: 1)")
    assert "venv" not in result.stdout and not (tmp_path / "fresh").exists()


def test_make_train_takes_a_thread_count(tmp_path):
    """OMP_NUM_THREADS=2 passes the check (on to building the venv, here with a Python that fails).

    Mutant: the check refuses every value -> no venv step.
    """
    result = _make_train(tmp_path, "OMP_NUM_THREADS=2")
    assert "error: OMP" not in result.stderr and "venv" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("setting", ["NPROC=2 ", "OMP_NUM_THREADS=1 ", "PRESET=cartpole "])
def test_make_train_takes_a_value_with_spaces_around_it(tmp_path, setting):
    """NPROC="2 " was refused as `error: NPROC=2  must be ...` (the space invisible) while PRESET="cartpole " was taken
    ($(filter) drops spaces); torchrun gets NPROC unquoted and libgomp reads "1 " as 1, so all now pass the checks.

    Mutant: train-settings checks $(NPROC) (or $(OMP_NUM_THREADS)) without $(strip) -> refused, no venv step.
    """
    result = _make_train(tmp_path, setting)
    assert "error:" not in result.stderr and "venv" in result.stdout, result.stdout + result.stderr


def test_make_train_still_refuses_a_space_inside_nproc(tmp_path):
    """Only the spaces around a value go: "2 x" is still not a count, and the refusal shows it as make holds it.

    Mutant: the NPROC case drops every space (or takes the first word) -> "2 x" passes.
    """
    result = _make_train(tmp_path, "NPROC=2 x ")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[0] == "error: NPROC=2 x must be a positive number of ranks"
