"""Checks that more than one bench makes, kept in one place (bench/_common.py): each bench reads OMP_NUM_THREADS
through the one function, and refuses a value listed twice in one line naming the flag, before any run starts."""

import pytest

import bench._common
from tests.test_bench_flags import Launched, launched_args, usage_error
from tests.test_bench_mujoco_run_limits import _stopped_at_launch
from tests.test_tools import load_bench


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
