"""`python SCRIPT ARGS...`, `python -m MODULE ARGS...` and `python -c CODE ARGS...` for tests, as processes forked
from a server that imported torch once, instead of fresh interpreters that each import it again.

Why: a fresh `python train.py ...` spends ~3 s of a 2-core machine importing torch before it reaches what a test
checks (a parse error, a usage error's one line, --help, a --dry-run's plan), and the suite runs ~35 of them.

Each command still gets a process of its own, and runs as `__main__` the way `python` runs it: its own
sys.argv, sys.path[0] (the script's directory; the working directory with -m; '' with -c), environment and
working directory; stdout and stderr are files (what C code writes counts too) and stdin is /dev/null; it ends as
an interpreter ends (an uncaught exception's traceback, SystemExit's status, atexit handlers, finalization), and
the caller gets that status. Nothing one command does reaches another. What a command inherits from the server:
PRELOAD (torch, torch._dynamo, tyro, TensorBoard's writer) already imported (if importing them prints anything,
which a fresh process would print on every command's stdout or stderr, every call fails) and its objects frozen out
of the cyclic GC (gc.freeze: never collected, not even at exit), Python's hash seed,
and two more frames (this file's) at the top of an uncaught exception's traceback. A command whose environment
differs from the server's in a variable read at start-up (PYTHON*, TORCH_*, OMP_*, ...) runs as a plain
subprocess instead. The process is the server's child, not the caller's: tests that signal a process or its group
start their own (tests/torchrun_job.py), and so do those that measure a fresh process's memory
(tests/test_host_memory.py).

    result = run_python(["train.py", "tracking", "--help"], env={**os.environ, "LOCAL_RANK": "1"})
    result.returncode, result.stdout, result.stderr      # as from subprocess.run(..., capture_output=True, text=True)
"""

import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Third-party modules only (torch._dynamo: what the first torch.optim optimizer imports, 1.5-2 s): a command that
# patches the project before importing it (a fake Isaac Lab, torch.cuda.is_available) must find it not imported yet.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "tyro", "torch.utils.tensorboard")
# Prefixes of the variables Python, the C libraries or PRELOAD read at start-up or import (torch's TORCHINDUCTOR_*
# and TORCHDYNAMO_* are read where those are imported, in the command's process; torch itself sets the first).
AT_START_UP = ("PYTHON", "TORCH_", "PYTORCH", "OMP_", "MKL_", "CUDA_", "NVIDIA_", "LD_", "MALLOC_", "GLIBC_")


def run_python(args: list[str], cwd: str = REPO, env: dict | None = None,
               timeout: float = 120.0) -> subprocess.CompletedProcess:
    """What `subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)` returns (or raises on a time-out), for args `SCRIPT ...`, `-m MODULE ...` or `-c CODE ...`."""
    cmd = [sys.executable, *args]
    env = dict(os.environ if env is None else env)
    plain = args[0].startswith("-") and args[0] not in ("-m", "-c")      # interpreter options: not served
    with _LOCK:
        server = None if plain else _server()
        if server is None or _start_up(env) != server.start_up:
            return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            try:
                server.send({"args": list(args), "env": env, "cwd": os.path.abspath(cwd), "stdout": out,
                             "stderr": err})
                started = server.receive(60)
                assert started is not None, "the server of tests/forked_python.py did not fork within 60 s"
                reply = server.receive(timeout)
                if reply is None:
                    os.kill(started["pid"], signal.SIGKILL)
                    server.receive(60)
                    raise subprocess.TimeoutExpired(cmd, timeout, _read(out), _read(err))
            except BaseException:            # an exchange left half done (time-out, Ctrl-C): the next call starts anew
                _SERVER.remove(server)
                server.close()
                raise
            return subprocess.CompletedProcess(cmd, reply["status"], _read(out), _read(err))


def _read(path: str) -> str:
    with open(path) as f:                  # text as subprocess's text=True decodes it (locale, universal newlines)
        return f.read()


def _start_up(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(AT_START_UP)}


class _Server:
    def __init__(self):
        self.start_up = _start_up(os.environ)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log)
        self.buffer = b""
        ready = self.receive(300)
        if ready != {"ready": True}:
            self.close()
            raise AssertionError(f"the server of tests/forked_python.py did not start: {ready}")

    def send(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict | None:
        """The server's next reply; None after `timeout` seconds without one."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self.log.seek(0)
                raise AssertionError(f"the server of tests/forked_python.py ended (status {self.proc.wait()}):\n"
                                     f"{self.log.read().decode(errors='replace')[-3000:]}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()          # the server ends at the end of its requests
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_LOCK = threading.Lock()
_SERVER: list = []


def _server() -> _Server:
    """One per test session, started at the first call; a server that ended (a crash) is replaced."""
    if _SERVER and _SERVER[0].proc.poll() is not None:
        _SERVER.pop().close()
    if not _SERVER:
        import atexit
        _SERVER.append(_Server())
        atexit.register(_SERVER[0].close)
    return _SERVER[0]


# ---- the server: imports PRELOAD, then forks one child per request; only a child returns from serve() --------

def serve() -> dict:
    requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    log = os.dup(2)                          # the caller's log of this server
    with tempfile.TemporaryFile() as printed:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(printed.fileno(), 1)
        os.dup2(printed.fileno(), 2)
        try:
            for name in PRELOAD:
                __import__(name)
        except BaseException as exc:  # noqa: BLE001 - said to the caller, which fails the test
            ready = {"error": f"importing {name}: {type(exc).__name__}: {exc}"}
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            printed.seek(0)
            text = printed.read().decode(errors="replace")
            ready = {"error": f"importing {PRELOAD} printed:\n{text}"} if text else {"ready": True}
        os.dup2(null, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
    # What PRELOAD built, out of the cyclic GC's sight: a command's collections (its interpreter's exit runs some)
    # would touch, and so copy, every page of it, ~0.6 s a command on 2 cores (gc.freeze's own use case).
    gc.collect()
    gc.freeze()
    replies.write(json.dumps(ready) + "\n")
    replies.flush()
    if "error" in ready:
        sys.exit(1)
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            return request
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()
    sys.exit(0)                              # the caller closed its end


def become(request: dict) -> None:
    """In the forked child: run the command as `python` runs it, in a new `__main__` module that stays the process's
    until it ends (as a script's does), up to the interpreter's own exit."""
    import builtins
    import importlib.machinery
    import runpy
    import types
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    args = request["args"]
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    if args[0] == "-m":
        sys.argv, sys.path[0] = ["-m", *args[2:]], os.getcwd()
        runpy._run_module_as_main(args[1])             # what `python -m` calls; argv[0] becomes the module's file
    elif args[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *args[2:]], ""
        main.__loader__ = importlib.machinery.BuiltinImporter
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv, sys.path[0] = list(args), os.path.dirname(os.path.realpath(args[0]))
        main.__file__, main.__cached__ = args[0], None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", args[0])
        with open(args[0], "rb") as f:
            source = f.read()
        exec(compile(source, args[0], "exec"), main.__dict__)


if __name__ == "__main__":
    become(serve())
