"""StopRequests in this process: which signals interrupt at once, what a rank reports in its flags, and what the
handlers are once restored. Signals are raised in the test's own process (signal.raise_signal) or the handler is
called on a fake clock; no ranks are started."""

import functools
import itertools
import signal

import pytest

from dist.stop import STOP_KEYS, SecondInterrupt, StopRequests


@pytest.fixture
def handlers():
    """Put back the test process's own SIGINT and SIGTERM handlers, whatever the test left installed."""
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGINT, saved[0])
    signal.signal(signal.SIGTERM, saved[1])


def not_interrupted(send, signum):
    """`send(signum)`, failing the test if it interrupts (a KeyboardInterrupt escaping a test ends the whole session
    instead of failing that test)."""
    try:
        send(signum)
    except KeyboardInterrupt as exc:
        pytest.fail(f"{signal.Signals(signum).name} interrupted at once ({type(exc).__name__})")


def interrupted(send, signum):
    """`send(signum)`, which must raise SecondInterrupt."""
    with pytest.raises(KeyboardInterrupt) as raised:
        send(signum)
    assert type(raised.value) is SecondInterrupt


def clock(monkeypatch, *times):
    """dist.stop's monotonic clock reads `times`, one per signal."""
    readings = iter(times)
    monkeypatch.setattr("dist.stop.time.monotonic", lambda: next(readings))


def test_a_ctrl_c_more_than_a_second_after_the_first_interrupts_however_many_came_between(monkeypatch, handlers):
    """The window is one second from the FIRST Ctrl-C: a forwarded duplicate 0.75 s in must not restart it (else
    Ctrl-Cs 0.75 s apart would never interrupt), and 1.5 s after the first is a second request, not 2 s."""
    clock(monkeypatch, 100.0, 100.75, 101.5)
    stop = StopRequests(watch_launcher=False)
    on_signal = functools.partial(stop._on_signal, frame=None)
    not_interrupted(on_signal, signal.SIGINT)
    not_interrupted(on_signal, signal.SIGINT)     # 0.75 s after the first: torchrun's forwarded copy
    assert stop.signal_name == "SIGINT"
    interrupted(on_signal, signal.SIGINT)         # 1.5 s after the first, 0.75 s after the previous


def test_sigterms_alone_never_interrupt_and_the_first_signal_names_the_stop(monkeypatch, handlers):
    """Only a Ctrl-C opens the one-second window: repeated SIGTERMs (a scheduler asking again) finish the iteration,
    and a Ctrl-C 0.5 s after a SIGTERM is a first Ctrl-C. The stop keeps the name of the signal that came first."""
    clock(monkeypatch, 10.0, 12.0, 12.5)
    stop = StopRequests(watch_launcher=False)
    on_signal = functools.partial(stop._on_signal, frame=None)
    not_interrupted(on_signal, signal.SIGTERM)
    not_interrupted(on_signal, signal.SIGTERM)    # 2 s after the first SIGTERM
    not_interrupted(on_signal, signal.SIGINT)     # 2.5 s after the first SIGTERM, the first Ctrl-C
    assert stop.signal_name == "SIGTERM"


def test_signals_raised_in_this_process_reach_the_handlers(handlers):
    """Installing the handlers is what keeps a SIGTERM from killing the rank before its checkpoint and a Ctrl-C from
    interrupting the iteration; each handler is checked before its signal is raised, so a missing one fails the
    test instead of ending pytest."""
    stop = StopRequests(watch_launcher=False)
    assert signal.getsignal(signal.SIGTERM) == stop._on_signal
    not_interrupted(signal.raise_signal, signal.SIGTERM)
    assert stop.signal_name == "SIGTERM"
    stop = StopRequests(watch_launcher=False)
    assert signal.getsignal(signal.SIGINT) == stop._on_signal
    not_interrupted(signal.raise_signal, signal.SIGINT)
    assert stop.signal_name == "SIGINT"
    interrupted(signal.raise_signal, signal.SIGTERM)   # torchrun's SIGTERM after the first Ctrl-C: the second one


def test_restored_handlers_are_python_defaults(handlers):
    """After the loop (start-up and shutdown), Ctrl-C must be a plain KeyboardInterrupt, which train.cli reports as
    'outside the training loop' with status 130 (SIG_DFL would kill the process without a word), and SIGTERM must
    end the process (the run's own handler would only raise a flag nobody reads any more; SIG_IGN would leave a
    hung shutdown unkillable but by SIGKILL)."""
    StopRequests(watch_launcher=False)
    StopRequests.restore_default_handlers()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    with pytest.raises(KeyboardInterrupt) as raised:
        signal.raise_signal(signal.SIGINT)
    assert type(raised.value) is KeyboardInterrupt


def flags(stop):
    """local_flags as plain numbers: (stop_signal, launcher_gone) pairs of (sum, count)."""
    got = {k: (s.item(), c.item()) for k, (s, c) in stop.local_flags("cpu").items()}
    return got["Control/stop_signal"], got["Control/launcher_gone"]


def test_the_flags_say_this_rank_was_signalled_or_reparented(monkeypatch, handlers):
    """(sum, count) per flag, count 1 (reduce_metrics drops a key with a zero count): the summed sum is how many
    ranks raised the flag. Only a watched launcher can be gone: the parent changing (re-parented to an init
    process, pid 1, when torchrun died) is what says so."""
    parent = itertools.chain([4242, 4242], itertools.repeat(1))          # at start, first check, then re-parented
    monkeypatch.setattr("dist.stop.os.getppid", lambda: next(parent))
    watched = StopRequests(watch_launcher=True)
    assert flags(watched) == ((0.0, 1.0), (0.0, 1.0))
    assert flags(watched) == ((0.0, 1.0), (1.0, 1.0))
    not_interrupted(functools.partial(watched._on_signal, frame=None), signal.SIGTERM)
    assert flags(watched) == ((1.0, 1.0), (1.0, 1.0))
    unwatched = StopRequests(watch_launcher=False)                          # not under torchrun
    assert flags(unwatched) == ((0.0, 1.0), (0.0, 1.0))
    not_interrupted(functools.partial(unwatched._on_signal, frame=None), signal.SIGINT)
    assert flags(unwatched) == ((1.0, 1.0), (0.0, 1.0))
    # train.py unpacks the reduced flags as `stop_signal, launcher_gone` in STOP_KEYS order
    assert STOP_KEYS == ("Control/stop_signal", "Control/launcher_gone")


def test_train_py_exits_with_its_status_whatever_ctrl_c_meets_in_the_teardown(tmp_path):
    """Once the run returned its status, Python's finalization sets SIGINT back to SIG_DFL (a handler of its own is
    undone, SIG_IGN kept), so a Ctrl-C there ended a finished run with status 130 and no word. At exit train.py's
    SIGINT is ignored: checked from an exit handler of the process, and by sending SIGINT there."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    probe = ("import atexit, os, runpy, signal, sys\n"
             "def at_exit():\n"
             "    print('SIGINT at exit:', signal.getsignal(signal.SIGINT) is signal.SIG_IGN, file=sys.stderr)\n"
             "    os.kill(os.getpid(), signal.SIGINT)\n"
             "atexit.register(at_exit)\n"
             f"sys.argv = ['train.py', 'cartpole', '--dry-run', '--log.root', {str(tmp_path)!r}]\n"
             "runpy.run_path('train.py', run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=repo, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "SIGINT at exit: True" in result.stderr, result.stderr[-2000:]
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_ctrl_c_exactly_one_second_after_the_first_is_still_the_forwarded_copy(monkeypatch, handlers):
    """The module docstring: a second Ctrl-C is a SIGINT MORE than a second after the first. At exactly 1.0 s it is
    still within the window (a `>=` interrupted the iteration there); just past it, it interrupts."""
    clock(monkeypatch, 50.0, 51.0, 51.0625)           # exact in binary: no rounding decides the comparison
    stop = StopRequests(watch_launcher=False)
    on_signal = functools.partial(stop._on_signal, frame=None)
    not_interrupted(on_signal, signal.SIGINT)
    not_interrupted(on_signal, signal.SIGINT)        # 1.0 s after the first
    interrupted(on_signal, signal.SIGINT)            # 1.0625 s after the first


def test_an_unwatched_run_never_reports_its_launcher_gone_even_when_its_parent_changes(monkeypatch, handlers):
    """Without torchrun (watch_launcher False) the parent is no launcher: a plain `python train.py` whose shell exits
    (re-parented to pid 1) must keep training, not stop every rank as orphans. Recording the parent regardless made
    such a run report launcher_gone once its parent changed."""
    parent = itertools.chain([4242], itertools.repeat(1))      # at construction, then re-parented
    monkeypatch.setattr("dist.stop.os.getppid", lambda: next(parent))
    stop = StopRequests(watch_launcher=False)
    assert not stop.launcher_gone()
    assert flags(stop) == ((0.0, 1.0), (0.0, 1.0))


def test_a_rank_whose_own_launcher_lives_blames_another_nodes_launcher(monkeypatch, handlers):
    """On two `torchrun --nnodes 2` nodes, node 1's torchrun SIGKILLed (its machine or agent died) leaves node 1's rank
    re-parented; its flag rides the metrics all-reduce and node 0's rank stops too. Node 0's rank said `the launcher
    (torchrun) is gone`, its own, which was alive: the operator looked on the wrong node. The message is read after
    the all-reduce, so a rank re-parented by then says its own launcher, and one that is not names another node's.
    Mutant: gone_message always says "the launcher (torchrun) is gone" (ignores launcher_gone())."""
    parent = iter([4242, 4242])                                               # at start, then still torchrun
    monkeypatch.setattr("dist.stop.os.getppid", lambda: next(parent))
    alive_here = StopRequests(watch_launcher=True)
    assert alive_here.gone_message(7) == ("another node's launcher (torchrun) is gone (this node's is alive: that "
                                          "node's machine or agent died): stopped after iteration 7 without saving; "
                                          "the last periodic checkpoint is kept")
    parent = iter([4242, 1])                                                  # at start, then re-parented
    orphan = StopRequests(watch_launcher=True)
    assert orphan.gone_message(7) == ("the launcher (torchrun) is gone: stopped after iteration 7 without saving; "
                                      "the last periodic checkpoint is kept")
