"""Benches leave nothing behind, whatever stops them: each is started on its smallest settings with TMPDIR in
tmp_path, signalled the way a terminal (SIGINT) or a scheduler (SIGTERM) does, and must exit with one line naming
the signal, every process it started gone (by pid) and nothing it made left in TMPDIR."""

import os
import signal
import subprocess
import sys
import time

import pytest

from bench._common import descendants
from tests.torchrun_job import alive

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def leftovers(tmp) -> list[str]:
    # torch._dynamo's import makes its compile cache, torchinductor_<user>, a folder shared by every run by design
    return sorted(name for name in os.listdir(tmp) if not name.startswith("torchinductor_"))


class Bench:
    """`python bench/<script> <flags>` with TMPDIR in tmp_path; `family` is every process seen below it."""

    def __init__(self, tmp_path, script: str, *flags: str, prelude: str | None = None):
        """`prelude`: code run first in the bench's process, which then runs the script as `__main__` (runpy)."""
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir()
        self.out = tmp_path / "out.txt"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(self.tmp)}
        path = os.path.join("bench", script)
        cmd = [sys.executable, path] if prelude is None else [
            sys.executable, "-c", f"{prelude}\nimport runpy, sys\nsys.argv = {[path]!r} + sys.argv[1:]\n"
                                  f"runpy.run_path({path!r}, run_name='__main__')"]
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen([*cmd, *flags], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.family: set[int] = set()

    def wait_for_family(self, count: int, then=lambda: True, timeout: float = 300.0) -> None:
        """Until `count` processes run below the bench at once and `then()` holds (generous: a loaded machine)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            below = descendants(self.proc.pid)
            self.family.update(below)
            if len(below) >= count and then():
                return
            assert self.proc.poll() is None, self.output()
            time.sleep(0.1)
        raise AssertionError(f"no {count} processes below the bench in {timeout} s:\n{self.output()}")

    def running(self, word: str) -> int:
        """How many processes below the bench have `word` in their command line."""
        count = 0
        for pid in descendants(self.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    count += word.encode() in f.read()
            except OSError:
                continue
        return count

    def all_ignore_sigint(self) -> bool:
        """Whether every process below the bench ignores SIGINT (its SigIgn mask in /proc)."""
        masks = []
        for pid in descendants(self.proc.pid):
            try:
                with open(f"/proc/{pid}/status") as f:
                    masks += [int(line.split()[1], 16) for line in f if line.startswith("SigIgn:")]
            except OSError:
                continue
        return bool(masks) and all(mask >> (signal.SIGINT - 1) & 1 for mask in masks)

    def stop(self, sig) -> int:
        self.family.update(descendants(self.proc.pid))
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(300)
        finally:
            for pid in [self.proc.pid, *self.family]:     # leave nothing behind, whatever the test found
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()

    def output(self) -> str:
        return self.out.read_text()

    def gone(self, timeout: float = 60.0) -> list[int]:
        """The family's pids still alive after `timeout` (a rank told to stop may take a moment)."""
        deadline = time.monotonic() + timeout
        while any(alive(pid) for pid in self.family) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [pid for pid in self.family if alive(pid)]


def assert_stopped(bench: Bench, code: int, sig, name: str) -> None:
    lines = bench.output().splitlines()
    assert code == 128 + sig, bench.output()
    assert lines[-1] == f"{name}: stopped by {signal.Signals(sig).name}", bench.output()
    assert "Traceback" not in bench.output(), bench.output()
    assert bench.gone() == []
    assert leftovers(bench.tmp) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_fault_drills_stopped_mid_drill_stops_its_job_and_removes_its_folders(tmp_path, sig):
    """SIGTERM killed fault_drills where it stood: the drill's torchrun job (its own session) trained on, and its
    drill-* folder stayed; Ctrl-C printed a traceback; every drill, finished or not, left torchrun's torchelastic_*
    folder in TMPDIR. Now the job is stopped, the drill's folder (torchrun's TMPDIR too) removed, one line, 128 + sig.

    Mutant: main() instead of stopped_main -> SIGTERM: exit -15 and drill-* left; SIGINT: a traceback.
    Mutant: no env={"TMPDIR": root} for the Job -> torchelastic_* left in TMPDIR.
    """
    bench = Bench(tmp_path, "fault_drills.py")
    bench.wait_for_family(3, lambda: any(n.startswith("torchelastic_") for n in os.listdir(bench.tmp))
                          or any(os.listdir(bench.tmp / n) for n in leftovers(bench.tmp)))
    assert_stopped(bench, bench.stop(sig), sig, "fault_drills")


@pytest.mark.slow
@pytest.mark.parametrize("sig, flags, phase", [
    (signal.SIGTERM, ["--quick", "--ppo"], "training"),
    (signal.SIGINT, ["--quick", "--ppo"], "training"),
    (signal.SIGTERM, ["--size", "10M", "--repeats", "100"], "ranks"),
    (signal.SIGINT, ["--size", "10M", "--repeats", "100"], "ranks"),
])
def test_bench_sync_stopped_stops_its_training_run_or_ranks_and_removes_its_folders(tmp_path, sig, flags, phase):
    """SIGTERM killed bench_sync where it stood: --ppo's bench_sync_* checkpoint folder stayed (its atexit never ran)
    and its ranks computed on; Ctrl-C printed a traceback (each rank's too). Now both stop the training run or the
    ranks, remove the folder and exit 128 + sig with one line.

    Mutant: main() instead of stopped_main -> SIGTERM: exit -15 (and bench_sync_* left); SIGINT: a traceback.
    Mutant: no rank_signals() in worker -> the ranks never ignore the terminal's Ctrl-C: the wait for them fails
    (AssertionError "no 2 processes below the bench").
    """
    bench = Bench(tmp_path, "bench_sync.py", *flags)
    if phase == "training":
        # past train.py's imports (a Ctrl-C there is train.py's own traceback): its run folder is made
        bench.wait_for_family(1, lambda: any(os.listdir(bench.tmp / n) for n in os.listdir(bench.tmp)
                                             if n.startswith("bench_sync_")))
    else:
        # both spawned ranks past their imports and rank_signals() (a Ctrl-C before it is Python's traceback): every
        # process below the bench ignores SIGINT (multiprocessing's resource tracker does too)
        bench.wait_for_family(2, lambda: bench.running("spawn_main") >= 2 and bench.all_ignore_sigint())
    if sig == signal.SIGINT:   # a terminal's Ctrl-C reaches the bench's whole process group
        family = descendants(bench.proc.pid)
        for pid in family:
            os.kill(pid, sig)
    assert_stopped(bench, bench.stop(sig), sig, "bench_sync")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_bench_grad_sync_stopped_stops_its_ranks(tmp_path, sig):
    """SIGTERM killed bench_grad_sync and left its forked ranks computing on, orphaned; Ctrl-C printed a traceback
    per rank and the bench's. Now both stop the ranks and exit 128 + sig with one line.

    Mutant: no try/finally stop_processes(procs) in launch -> the bench waits at exit for its endless ranks
    (multiprocessing joins them): TimeoutExpired in stop().
    Mutant: no rank_signals() in rank_main -> the ranks never ignore the terminal's Ctrl-C: the wait for them fails
    (AssertionError "no 2 processes below the bench").
    """
    bench = Bench(tmp_path, "bench_grad_sync.py", "--models", "10M", "--iters", "100000")   # ranks that never end
    # both forked ranks (the bench's command line) past rank_signals(): every process below the bench ignores SIGINT
    bench.wait_for_family(2, lambda: bench.running("bench_grad_sync.py") >= 2 and bench.all_ignore_sigint())
    if sig == signal.SIGINT:   # a terminal's Ctrl-C reaches the bench's whole process group
        for pid in descendants(bench.proc.pid):
            os.kill(pid, sig)
    assert_stopped(bench, bench.stop(sig), sig, "bench_grad_sync")


# bench_train's small setting in 4 iterations (3 warm-up), not 20: the table and the 2-rank row are the same code, in
# a fifth of the table's time. Set through stopped_main, which the script's `__main__` block calls with its main.
FEWER_ITERATIONS = """
import sys
sys.path.insert(0, ".")
import bench._common
stopped_main = bench._common.stopped_main
def fewer_iterations(name, main):
    main.__globals__["ITERATIONS"]["cpu"]["small"] = (4, 3)
    return stopped_main(name, main)
bench._common.stopped_main = fewer_iterations
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_bench_train_stopped_during_its_two_rank_row_stops_torchrun_and_its_folders(tmp_path, sig):
    """The 2-rank row's torchrun ran after train.main had put SIGTERM back to its default: SIGTERM then killed the
    bench where it stood, leaving torchrun and its ranks training and the bench's tmp* folder; Ctrl-C made
    subprocess.run SIGKILL torchrun (its ranks left to notice alone) and print a traceback; every row left torchrun's
    torchelastic_* folder in TMPDIR. Now torchrun is SIGTERMed (it stops its ranks), its TMPDIR is a folder removed
    after it, and the bench exits 128 + sig with one line.

    Mutant: the SIGTERM handler not put back after train.main -> SIGTERM: exit -15.
    Mutant: subprocess.run(check=True) for the row, not run_child -> torchelastic_* left in TMPDIR.
    """
    bench = Bench(tmp_path, "bench_train.py", "--settings", "small", "--num-envs", "64", prelude=FEWER_ITERATIONS)
    # torchrun and its 2 ranks (train.py in each command line), after the small table: counting processes alone was
    # met by torch's compile workers during the in-process rows, and the stop then came during train.main
    bench.wait_for_family(3, lambda: bench.running("train.py") >= 3)
    if sig == signal.SIGINT:   # a terminal's Ctrl-C reaches the bench's whole process group
        for pid in descendants(bench.proc.pid):
            os.kill(pid, sig)
    assert_stopped(bench, bench.stop(sig), sig, "bench_train")
    assert "| syncppo |" in bench.output()      # the small table was printed before the row started


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_bench_rollout_stopped_stops_its_torchrun_job_and_removes_its_run_folder(tmp_path, sig):
    """SIGTERM killed bench_rollout alone: its torchrun job trained on, orphaned, and its run_* folder under --out
    stayed; Ctrl-C printed a traceback and kept run_* as if a job had failed; every job left torchrun's torchelastic_*
    folder in TMPDIR. Now the job is SIGTERMed (torchrun stops its ranks), run_* and torchrun's TMPDIR are removed,
    and the bench exits 128 + sig with one line.

    Mutant: main() instead of stopped_main -> SIGTERM: exit -15, the job outlives the bench; SIGINT: a traceback.
    Mutant: no `except KeyboardInterrupt` in main (run_* kept as after a failure) -> out/ still holds run_*.
    """
    out = tmp_path / "out"
    bench = Bench(tmp_path, "bench_rollout.py", "--quick", "--out", str(out))
    bench.wait_for_family(3, lambda: bench.running("train.py") >= 3)   # torchrun and its 2 ranks
    if sig == signal.SIGINT:   # a terminal's Ctrl-C reaches the bench's whole process group
        for pid in descendants(bench.proc.pid):
            os.kill(pid, sig)
    assert_stopped(bench, bench.stop(sig), sig, "bench_rollout")
    assert os.listdir(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_bench_mujoco_stopped_stops_its_run(tmp_path, sig):
    """SIGTERM killed bench_mujoco alone: its torchrun run trained on for its hours, orphaned; Ctrl-C printed a
    traceback once the thread pool had waited for the run to stop; every 2-rank run left torchrun's torchelastic_*
    folder in TMPDIR. Now the run is SIGTERMed (it saves and stops), torchrun's TMPDIR removed, and the bench exits
    128 + sig with one line; the run's own directory under --root stays, as any interrupted run's does.

    Mutant: main() instead of stopped_main -> SIGTERM: exit -15, the run outlives the bench; SIGINT: a traceback.
    Mutant: no stop_all() before the pool's exit -> SIGTERM: the pool waits for the 1000-iteration run,
    TimeoutExpired in stop().
    """
    bench = Bench(tmp_path, "bench_mujoco.py", "--tasks", "Hopper-v4", "--seeds", "1", "--ranks", "2",
                  "--total-steps", "2048000", "--last-episodes", "1", "--root", str(tmp_path / "root"))
    bench.wait_for_family(3, lambda: bench.running("train.py") >= 3)   # torchrun and its 2 ranks
    if sig == signal.SIGINT:   # a terminal's Ctrl-C reaches the bench's whole process group
        for pid in descendants(bench.proc.pid):
            os.kill(pid, sig)
    assert_stopped(bench, bench.stop(sig), sig, "bench_mujoco")
    assert not (tmp_path / "root" / "results.jsonl").exists()
