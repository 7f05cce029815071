"""Leftovers of the bench and Makefile audits: each refusal is one line before any run starts, and checks that more
than one bench makes live in one place (bench/_common.py)."""

import os
import subprocess
import sys

import pytest

import bench._common
from tests.test_bench_flags import Launched, launched_args, usage_error
from tests.test_tools import load_bench

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
