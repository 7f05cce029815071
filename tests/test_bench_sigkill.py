"""A bench SIGKILLed (the OOM killer, `kill -9`, a scheduler's hard stop) runs nothing more, so its own stopping
(tests/test_bench_cleanup.py) never happens: its children must end without it, told by the kernel
(bench/_common.die_with_parent). Each way a bench starts processes is tried once, on the cheapest settings of
tests/test_bench_cleanup.py: torchrun through run_child (bench_mujoco), forked ranks (bench_grad_sync) and spawned
ranks (bench_sync). The bench is SIGKILLed once its children run, and every process seen below it must then end: a
bounded wait (torchrun, SIGTERMed, stops its ranks, which finish their iteration and save), not a timed assertion.
The temporary folders it made stay: nothing runs to remove them (docs/benchmarks.md).

Not here: fault_drills' torchrun (tests/torchrun_job.Job) ended within 7 s even without its request: the bench's death
closes the pipe its output goes to, and a rank's next line fails (BrokenPipeError); the request is for a job that
prints nothing meanwhile (a stalled rank)."""

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from bench._common import descendants
from tests.test_bench_cleanup import REPO, Bench
from tests.torchrun_job import alive


def command_line(pid: int) -> str:
    """`pid`'s command line, for a message ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def left_after_sigkill(bench: Bench) -> list[str]:
    """SIGKILL the bench; its family's processes still alive after a generous wait, as "pid command line"."""
    try:
        bench.family.update(descendants(bench.proc.pid))      # orphans are no longer below it once it is gone
        bench.proc.kill()
        bench.proc.wait()
        return [f"{pid} {command_line(pid)}" for pid in sorted(bench.gone(timeout=120.0))]
    finally:
        for pid in bench.family:        # a failing case must not leave orphans computing on a shared machine
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):     # it ended meanwhile
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("script, flags, ready", [
    ("bench_mujoco.py", ["--tasks", "Hopper-v4", "--seeds", "1", "--ranks", "2", "--total-steps", "2048000",
                         "--last-episodes", "1"],
     lambda bench: bench.running("train.py") >= 3),                  # torchrun and its 2 ranks
    ("bench_grad_sync.py", ["--models", "10M", "--iters", "100000"],
     lambda bench: bench.running("bench_grad_sync") >= 2 and bench.all_ignore_sigint()),   # past rank_signals()
    ("bench_sync.py", ["--size", "10M", "--repeats", "100000"],      # ranks that outlive the wait, as 100 did not
     lambda bench: bench.running("spawn_main") >= 2 and bench.all_ignore_sigint()),        # past rank_signals()
], ids=["torchrun", "forked-ranks", "spawned-ranks"])
def test_bench_sigkilled_leaves_no_process_running(tmp_path, script, flags, ready):
    """SIGKILL ran nothing of the bench: bench_mujoco's torchrun run trained on for its hours, orphaned, and forked
    or spawned ranks computed on. Now every child asked the kernel for SIGTERM at its parent's death (prctl
    PR_SET_PDEATHSIG): torchrun stops its ranks, a rank ends.

    Mutant: no preexec_fn in run_child -> torchrun: torchrun and its 2 ranks left running.
    Mutant: SIGKILL, not SIGTERM, asked for in die_with_parent -> torchrun: its 2 ranks left running (torchrun
    never stops them).
    Mutant: no die_with_parent in rank_signals -> forked-ranks and spawned-ranks: both ranks left running.
    """
    if script == "bench_mujoco.py":
        flags = [*flags, "--root", str(tmp_path / "root")]
    bench = Bench(tmp_path, script, *flags)
    bench.wait_for_family(2, lambda: ready(bench))
    assert left_after_sigkill(bench) == []


def test_a_child_whose_parent_died_before_its_request_ends_at_once():
    """A parent that died between the fork and the child's request sends no signal (the child is init's already):
    die_with_parent then ends the child itself, here told of a parent that is not its own (pid -1).

    Mutant: no getppid check in die_with_parent -> the child goes on: "went on", exit 0.
    """
    code = "from bench._common import die_with_parent, libc_prctl; die_with_parent(-1, libc_prctl()); print('went on')"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (1, "", "")
