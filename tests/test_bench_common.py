"""Checks that more than one bench makes, kept in one place (bench/_common.py): each bench reads OMP_NUM_THREADS
through the one function, and refuses a value listed twice, or being started by torchrun, in one line before any
run starts; a stopped child gets SIGTERM, then SIGKILL (with what it started) after the grace; elsewhere than Linux
no child starts."""

import builtins
import inspect
import io
import os
import select
import signal
import subprocess
import sys
import types

import pytest

import bench._common
import tests.multirank
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


def test_stopping_sends_sigterm_then_sigkill_after_the_grace_to_a_child_and_what_it_started():
    """docs/benchmarks.md: a stopped bench SIGTERMs its children (so torchrun stops its ranks), SIGKILL after 30 s.
    One child ends on SIGTERM; the other ignores it and started a process that ignores it too: both of those get
    SIGKILL once the grace is over (a short one here; the benches' default is the documented 30 s).

    Mutant: SIGKILL in place of terminate() -> the first child ends by SIGKILL, not SIGTERM. Mutant: no SIGKILL
    of the family -> the grandchild still runs (its end is awaited through a pidfd, not by sleeping)."""
    assert bench._common.GRACE_S == 30
    assert inspect.signature(bench._common.stop_processes).parameters["grace"].default == bench._common.GRACE_S
    polite = subprocess.Popen(["sleep", "60"])
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60 & echo $!; wait"], stdout=subprocess.PIPE,
                                text=True)
    grandchild = int(stubborn.stdout.readline())       # printed after the trap: TERM is ignored from here on
    pidfd = os.pidfd_open(grandchild)
    try:
        bench._common.stop_processes([polite, stubborn], grace=2.0)
        assert polite.returncode == -signal.SIGTERM
        assert stubborn.returncode == -signal.SIGKILL
        assert select.select([pidfd], [], [], 30)[0] == [pidfd], "the grandchild still runs"
    finally:
        os.close(pidfd)
        for proc in (polite, stubborn):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stubborn.stdout.close()
        if os.path.exists(f"/proc/{grandchild}"):
            os.kill(grandchild, signal.SIGKILL)


def test_elsewhere_than_linux_run_child_starts_nothing_and_a_rank_stops_at_once(monkeypatch):
    """docs/benchmarks.md: with no PR_SET_PDEATHSIG to ask for, a bench refuses to start a process (a RuntimeError)
    rather than leave it running: run_child raises before any Popen; a multiprocessing rank, already started,
    raises the same error in rank_signals before it does anything.

    Mutant: libc_prctl returns a no-op prctl elsewhere than Linux -> run_child calls Popen."""
    started = []
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(bench._common.subprocess, "Popen", lambda *a, **kw: started.append(a))
    with pytest.raises(RuntimeError, match="runs on Linux only"):
        bench._common.run_child(["true"])
    assert started == [] and bench._common.LIVE == set()
    monkeypatch.setattr(bench._common.multiprocessing, "parent_process", lambda: types.SimpleNamespace(pid=1))
    monkeypatch.setattr(bench._common.signal, "signal", lambda *args: None)     # this process's handlers stay
    monkeypatch.setattr(bench._common, "die_with_parent", lambda parent, prctl: started.append(prctl))
    with pytest.raises(RuntimeError, match="runs on Linux only"):
        bench._common.rank_signals()
    assert started == []


def test_rank_answers_are_taken_in_arrival_order_and_a_dead_rank_or_a_silent_wait_raises():
    """rank_answers, which bench_sync and bench_rollout's replay wait with: the answers in the order they came; a rank
    that exited non-zero before answering is named by its exit code at once (no answer is coming from its partner
    either); with a patience, a wait with no answer ends naming it.

    Mutant: no exit-code check -> the dead rank's wait runs out its patience instead of naming exit code 3."""
    class Queue(list):
        def empty(self):
            return not self

        def get(self):
            return self.pop(0)
    alive, dead = types.SimpleNamespace(exitcode=None), types.SimpleNamespace(exitcode=3)
    assert bench._common.rank_answers([alive, alive], Queue(["a", "b", "c"]), 2) == ["a", "b"]
    with pytest.raises(RuntimeError, match=r"^rank exited with 3$"):
        bench._common.rank_answers([alive, dead], Queue(["a"]), 2, patience=0.0)
    with pytest.raises(RuntimeError, match=r"^rank answered nothing in 0.0 s$"):
        bench._common.rank_answers([alive, alive], Queue(), 1, patience=0.0)


@pytest.mark.parametrize("name, launches, flags", [
    ("bench_grad_sync", ["launch"], ["--quick"]),
    ("bench_sync", ["free_port"], ["--quick"]),
    ("bench_train", ["bench"], ["--quick", "--settings", "small"]),
    ("bench_rollout", ["throughput", "weight_sync", "learning"], ["--quick"]),
    ("bench_mujoco", ["run"], ["--tasks", "Hopper-v4", "--seeds", "1", "--ranks", "1"]),
    ("fault_drills", ["drill"], []),
])
def test_a_bench_started_by_torchrun_is_one_line_before_it_starts_anything(monkeypatch, capsys, tmp_path, name,
                                                                          launches, flags):
    """`torchrun --nproc-per-node 2 bench/bench_grad_sync.py --quick` printed nothing for minutes: each copy's ranks
    waited for torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) on the bench's own port; bench_train died in
    RSL-RL's multi-GPU check, and the job-starting benches ran twice side by side. Every bench starts its own ranks
    or jobs: under torchrun (TORCHELASTIC_RUN_ID set) it is now argparse's one line, exit 2.

    Mutant: no refuse_torchrun(parser) call in that bench's main -> it goes on to its launch (Launched, not exit 2).
    """
    module = _stopped_at_launch(monkeypatch, name, *launches)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    out = {"bench_rollout": ["--out", str(tmp_path)], "bench_mujoco": ["--root", str(tmp_path)]}.get(name, [])
    line = usage_error(module.main, monkeypatch, capsys, [f"{name}.py", *flags, *out])
    assert line == (f"{name}.py: error: run it with python, not torchrun: it starts its own ranks (or torchrun jobs) "
                    "itself")


def test_free_port_draws_below_the_ephemeral_range_read_from_proc(monkeypatch):
    """bench._common.free_port bound port 0: a port from the kernel's ephemeral range, which a `torchrun
    --standalone` starting meanwhile could take before the bench's ranks bound it. It now draws in 10000 up to the
    range's low bound, read from /proc (here 20000 in a stand-in file, then the machine's own), a port nothing holds;
    tests/multirank.py uses this one copy.

    Mutant: free_port binds port 0 again -> a port at or above the ephemeral low bound.
    Mutant: the /proc read dropped (always 32768) -> ports of 20000-32767 drawn under the stand-in's 20000.
    Mutant: tests/multirank.py keeps its own copy of free_port -> not bench._common's function."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        machine_low = int(f.read().split()[0])
    ports = [bench._common.free_port() for _ in range(20)]
    assert all(10000 <= port < machine_low for port in ports)

    def stand_in(path, *a, **k):
        return io.StringIO("20000\t60999\n") if path == "/proc/sys/net/ipv4/ip_local_port_range" else \
            builtins.open(path, *a, **k)
    monkeypatch.setattr(bench._common, "open", stand_in, raising=False)
    ports = [bench._common.free_port() for _ in range(50)]
    assert all(10000 <= port < 20000 for port in ports)
    assert tests.multirank.free_port is bench._common.free_port


@pytest.mark.parametrize("proc_range, low, high", [("1024\t60999\n", 61000, 65535), ("1024\t65535\n", 1, 65535)],
                         ids=["above-the-range", "the-kernel-s"])
def test_free_port_draws_apart_where_the_ephemeral_range_starts_low(monkeypatch, proc_range, low, high):
    """A range from 1024 (some distributions and containers set it) left free_port only port 10000 to draw: every
    bench and test rank group rendezvoused on it, so two at once collided and a port 10000 held (another run, a
    TIME_WAIT) failed all 100 draws. Now it draws above the range, or takes the kernel's port where the range
    covers every port above 1023; the ports differ from draw to draw and are free.

    Mutant: free_port draws `randrange(10000, max(ephemeral_low, 10001))` again (every draw 10000)."""
    def stand_in(path, *a, **k):
        return io.StringIO(proc_range) if path == "/proc/sys/net/ipv4/ip_local_port_range" else \
            builtins.open(path, *a, **k)
    monkeypatch.setattr(bench._common, "open", stand_in, raising=False)
    ports = [bench._common.free_port() for _ in range(20)]
    assert all(low <= port <= high for port in ports) and len(set(ports)) > 1, ports
