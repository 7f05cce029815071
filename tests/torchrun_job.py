"""Start `torchrun ... train.py` as a child job and poke it the way a cluster would (signals, kill -9).

Used by tests/test_faults.py and bench/fault_drills.py. The job runs in its own session so a test can
signal the launcher and its workers separately; `workers()` lists torchrun's worker processes.
"""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from bench._common import dying_with_this_process, live_parents

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    return sorted(child for child, parent in live_parents().items() if parent == pid)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Job:
    """`prelude` (with `python` only): code run before train.py in the same process, to patch what train.py
    imports (inject a fault, record what happens at exit); train.py then runs as `__main__`, as it does alone."""

    def __init__(self, args: list[str], nproc: int = 2, max_restarts: int = 0, python: bool = False,
                 env: dict | None = None, prelude: str | None = None):
        assert prelude is None or python, "a prelude runs in the process of `python train.py` only"
        cmd = ([sys.executable, "train.py"] if python else
               [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                "--monitor-interval=0.2", "train.py"])
        if prelude is not None:
            cmd = [sys.executable, "-c", f"{prelude}\nimport runpy\nrunpy.run_path('train.py', run_name='__main__')"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.started = time.monotonic()
        # SIGTERMed when the thread creating the Job ends, the process SIGKILLed included (fault_drills, a test):
        # fault_drills.drill and the tests create it in the main thread, which waits for it (finish, kill_all).
        self.proc = subprocess.Popen(cmd + args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True,
                                     preexec_fn=dying_with_this_process())
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._seen = 0

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match:
        """The next output line (after those already matched) that matches `pattern`."""
        deadline = time.monotonic() + timeout
        while True:
            while self._seen < len(self.lines):
                line = self.lines[self._seen]
                self._seen += 1
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None and self._seen >= len(self.lines):
                raise AssertionError(f"job exited before printing {pattern!r}:\n" + "\n".join(self.lines[-40:]))
            if time.monotonic() > deadline:
                raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n" + "\n".join(self.lines[-40:]))
            time.sleep(0.05)

    def workers(self) -> list[int]:
        return children(self.proc.pid)

    def signal(self, sig=signal.SIGINT) -> None:
        os.kill(self.proc.pid, sig)

    def finish(self, timeout: float = 120.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill_all()

    def kill_all(self) -> None:
        """Leave nothing behind, whatever happened."""
        for pid in [*self.workers(), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def output(self) -> str:
        return "\n".join(self.lines)
