"""What more than one bench does, in one place so it stays the same: checks on its command line (their wording),
how it waits for the answers of its own ranks, and how it stops what it started."""

import argparse
import contextlib
import ctypes
import functools
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional


def omp_threads(parser: argparse.ArgumentParser) -> int:
    """OMP_NUM_THREADS as a count (unset: 1), or argparse's one-line error: "", "abc" or "0" made libgomp warn and
    run a thread per core (torch: a ValueError or RuntimeError traceback)."""
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    if not (threads.isascii() and threads.isdigit() and int(threads) >= 1):
        parser.error(f"OMP_NUM_THREADS={threads!r} is not a positive number of threads; set it to one (or unset it: 1)")
    return int(threads)


def refuse_torchrun(parser: argparse.ArgumentParser) -> None:
    """argparse's one-line error when torchrun started this bench: every bench starts its own ranks or torchrun jobs.
    Under torchrun each copy ran the whole bench beside the others, and the ranks of bench_grad_sync and bench_sync
    (env:// rendezvous) waited for torchrun's agent store on a port nobody served: no output until their timeout."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        parser.error("run it with python, not torchrun: it starts its own ranks (or torchrun jobs) itself")


def refuse_repeats(parser: argparse.ArgumentParser, flag: str, values) -> None:
    """argparse's one-line error for a value listed twice (as parsed: 0 and 00 are one seed): each bench ran it once
    and dropped the other silently, or ran it twice into one folder, so a typo never showed."""
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:
        parser.error(f"{flag} names {twice} twice; list each once")


# ---- stopping: what a bench starts ends with it, whatever stops it -------------------------------------

GRACE_S = 30.0      # torchrun, SIGTERMed, stops its ranks and they finish their iteration and save
LIVE: set = set()   # processes run_child is waiting for, from any thread: stopped by stop_all on the way out
_STOPPING = threading.Event()
_LOCK = threading.Lock()    # a thread's run_child either registers its child before stop_all looks, or starts none


class Interrupted(KeyboardInterrupt):
    """SIGTERM as an exception, so that it unwinds through the same finally blocks as Ctrl-C (children stopped,
    folders removed) instead of ending the interpreter where it stands."""
    signum = signal.SIGTERM


def _on_sigterm(signum, frame):
    raise Interrupted


def stopped_main(name: str, main) -> None:
    """`main()`, with SIGTERM raised as Interrupted; a Ctrl-C or SIGTERM ends as one line and 128 + the signal's
    number (130, 143) once every child is stopped, not as a traceback."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        main()
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_IGN)    # a second Ctrl-C must not cut the stopping short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_all()
        print(f"{name}: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        sys.exit(128 + signum)


def rank_signals() -> None:
    """In a rank process the bench started with multiprocessing (fork or spawn): a terminal's Ctrl-C reaches the
    whole process group, and it is the bench's to act on (it stops the ranks), not a traceback per rank; SIGTERM
    ends the rank (a forked rank inherits the bench's handler), and so does the bench's death, SIGKILL included.
    Every bench's rank calls it first: the thread that started the ranks (the main thread, in bench_grad_sync.launch,
    bench_sync.main, bench_rollout.replay) waits for them until they end, as die_with_parent needs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)     # before asking for it: the bench's own handler would raise
    die_with_parent(multiprocessing.parent_process().pid, libc_prctl())


PR_SET_PDEATHSIG = 1    # <linux/prctl.h>


def libc_prctl():
    """libc's prctl, to look up in the parent before a fork (a child between fork and exec then only calls it);
    elsewhere than Linux, where there is none, a RuntimeError: the benches that start processes refuse to run
    there (they also read /proc), rather than leave their children running when SIGKILLed."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError("a bench that starts processes runs on Linux only: it needs prctl(PR_SET_PDEATHSIG) "
                           "so that its children end with it, and /proc to find them")
    return ctypes.CDLL(None).prctl


def die_with_parent(parent: int, prctl) -> None:
    """In a child of `parent` (its pid, taken before the fork): ask the kernel for SIGTERM when the parent dies,
    however it dies (a SIGKILLed bench runs nothing to stop its children); SIGTERM, not SIGKILL, so that torchrun
    stops its own ranks (they get no such request: the kernel clears it in a fork's child). Ends the child at once
    if `parent` died before the request, which then never fires: the child is someone else's already.

    The kernel sends it when the *thread* that forked the child ends, not the process: each caller forks from a
    thread that waits for the child until it ends (run_child, rank_signals, tests/torchrun_job.Job say which).

    As Popen's preexec_fn it runs between fork and exec of a threaded bench, where Python's docs warn that a call
    may deadlock on a lock another thread held at the fork: it stays trivial on purpose (a libc function looked up
    in the parent, getppid, _exit: no lock taken). A wrapper process doing the same before exec would be safe by
    construction but would cost a Python start per child and turn a missing program into the wrapper's traceback;
    this one function also serves the multiprocessing ranks, which exec nothing."""
    if prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError("prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(1)     # not sys.exit: a forked rank's atexit handlers are the bench's (bench_sync's rmtree)


def dying_with_this_process():
    """A preexec_fn for Popen: its child dies with this process (die_with_parent), the lookup done here."""
    return functools.partial(die_with_parent, os.getpid(), libc_prctl())


def live_parents() -> dict[int, int]:
    """Every live (not zombie) process's parent, by pid, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`: torchrun's ranks, which outlive a torchrun killed hard."""
    parents = live_parents()
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def _running(proc) -> bool:
    return proc.poll() is None if isinstance(proc, subprocess.Popen) else proc.is_alive()


def _wait(proc, timeout) -> None:
    if isinstance(proc, subprocess.Popen):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    else:
        proc.join(timeout)


def stop_processes(procs, grace: float = GRACE_S) -> None:
    """SIGTERM, SIGKILL what is left after `grace`, and reap: subprocess.Popen and multiprocessing.Process alike,
    and what they started. SIGTERM first, as a scheduler does: torchrun then stops its ranks itself, where a
    SIGKILLed torchrun leaves them running until they notice."""
    live = [p for p in procs if _running(p)]
    family = {pid for p in live for pid in descendants(p.pid)}
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
    deadline = time.monotonic() + grace
    for p in live:
        _wait(p, max(0.0, deadline - time.monotonic()))
    for pid in [p.pid for p in live if _running(p)] + sorted(family):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for p in live:
        _wait(p, None)


MIN_PORTS = 1000    # free_port's least span to draw in: two runs drawing at once then seldom meet


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now, for the rendezvous (MASTER_PORT) of a bench's own ranks (and of the tests'
    ranks: tests/multirank.py imports it), drawn outside the kernel's ephemeral range: a port the kernel hands out
    (bind to port 0, an outgoing connection) can be taken by another process between this check and the rank that
    binds it, e.g. a `torchrun --standalone` started at the same time, which picks its ports that way. Drawn in
    10000 up to the range's low bound, or above its high bound where a range that starts low (1024) leaves too few
    below (every draw was port 10000 there); the kernel's choice only where the range leaves neither."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(word) for word in f.read().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    spans = [span for span in (range(10000, low), range(high + 1, 65536)) if len(span) >= MIN_PORTS]
    draw = random.SystemRandom()  # independent of any seed a caller sets
    for _ in range(100 if spans else 1):
        port = draw.choice(spans[0]) if spans else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port found" + (f" in {spans[0].start}-{spans[0].stop - 1}" if spans else ""))


def rank_answers(procs, queue, count: int, patience: Optional[float] = None) -> list:
    """The first `count` results the rank processes `procs` put in `queue` (a multiprocessing queue), in arrival
    order. Raises RuntimeError("rank exited with N") as soon as a rank exited non-zero: its partner fails or waits
    in a collective, so no answer is coming; `patience`: seconds to wait for each answer (None: no bound)."""
    answers, deadline = [], None if patience is None else time.monotonic() + patience
    while len(answers) < count:
        if not queue.empty():
            answers.append(queue.get())
            deadline = None if patience is None else time.monotonic() + patience
            continue
        failed = [p.exitcode for p in procs if p.exitcode]
        if failed:
            raise RuntimeError(f"rank exited with {failed[0]}")
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"rank answered nothing in {patience} s")
        time.sleep(0.2)
    return answers


def stop_all() -> None:
    """Stop every run_child child, whichever thread waits for it, and let no thread start another: a thread pool's
    threads wait for their jobs, and the pool for its threads (and its queued jobs) on the way out of its `with`."""
    with _LOCK:
        _STOPPING.set()
        procs = list(LIVE)
    stop_processes(procs)


def run_child(cmd: list[str], env: dict | None = None, **popen) -> int:
    """`cmd` to its end, its exit status; whatever ends the wait (Ctrl-C, SIGTERM, an error) stops it first, and
    a SIGKILLed bench's death SIGTERMs it (die_with_parent). Its TMPDIR is a folder removed after it: torchrun
    leaves its torchelastic_* log folders there even on a clean exit (torch 2.x never removes them).

    The calling thread waits for the child until it ends (the `finally` reaps it), as die_with_parent needs: callers
    in a thread pool's threads (bench_mujoco.run, bench_rollout.train in `learning`) stay in run_child meanwhile,
    and the main thread's callers (bench_train.two_rank_rate, bench_sync.ppo_checkpoints, bench_rollout.train)
    too; the pool outlives its jobs."""
    with tempfile.TemporaryDirectory(prefix="bench_child_") as tmp:
        with _LOCK:
            if _STOPPING.is_set():
                raise RuntimeError("the bench is stopping: no new child")
            proc = subprocess.Popen(cmd, env={**(os.environ if env is None else env), "TMPDIR": tmp},
                                    preexec_fn=dying_with_this_process(), **popen)
            LIVE.add(proc)
        try:
            return proc.wait()
        finally:
            stop_processes([proc])
            LIVE.discard(proc)
