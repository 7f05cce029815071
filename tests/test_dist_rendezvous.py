"""dist/setup.py's rendezvous without a process group (threading.Timer and init_process_group replaced): the notice
of what it waits for, due after 10 s from a daemon timer started before the join and cancelled after it, and a
failed rendezvous as one RunError quoting torch's message on one line, its timeout as --dist.timeout-s takes it and
torch's error as its cause."""

import threading
from types import SimpleNamespace

import pytest
import torch.distributed as torch_dist

import dist.setup
from dist.errors import RunError


class Timer:
    """threading.Timer that only records: (interval, function, args, kwargs), daemon, and start/cancel in `log`."""

    def __init__(self, log, interval, function, args, kwargs):
        self.log, self.daemon = log, False
        log.append(("Timer", interval, function, args, kwargs))

    def start(self):
        self.log.append(("start", self.daemon))

    def cancel(self):
        self.log.append(("cancel",))


@pytest.fixture
def rendezvous(monkeypatch):
    """Rank 1 of 2 at 10.1.2.3:29400 (no agent store, no real group): a namespace whose `log` Timer and
    init_process_group append to, and whose `error`, when set, init_process_group raises."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(name, value)
    state = SimpleNamespace(log=[], error=None)

    def init_process_group(**kwargs):
        state.log.append(("init_process_group",))
        if state.error is not None:
            raise state.error
    monkeypatch.setattr(threading, "Timer", lambda *args, **kwargs: Timer(state.log, *args, **kwargs))
    monkeypatch.setattr(torch_dist, "init_process_group", init_process_group)
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: False)
    return state


def test_the_rendezvous_notice_is_due_after_10_s_started_before_the_join_and_cancelled_after_it(rendezvous):
    """A rendezvous says what it waits for once it has taken 10 s, from a daemon timer (it never holds the process)
    started before init_process_group and cancelled once that returns: a quick one says nothing.
    Mutant: WAIT_NOTICE_S 0 or 600, or divided by 1000; the timer not a daemon, not started or not cancelled; the
    message counting this rank among the others or the timeout without :g; print without flush=True."""
    info = dist.setup.init_distributed("gloo", "cpu")
    assert (info.rank, info.world_size, info.backend) == (1, 2, "gloo")
    assert rendezvous.log == [
        ("Timer", 10.0, print, ["[syncppo] rank 1: waiting for the other 1 rank(s) at 10.1.2.3:29400 (for up to "
                                "--dist.timeout-s 600)"], {"flush": True}),
        ("start", True), ("init_process_group",), ("cancel",)]


def test_a_rendezvous_that_fails_is_a_run_error_with_torch_s_message_on_one_line(rendezvous):
    """A store timeout (DistError) over several lines ending in ".": the RunError quotes it on one line without its
    final period, gives the timeout as --dist.timeout-s takes it (12.5, 600 without ".0"), keeps torch's error as its
    cause, and the notice is cancelled all the same.
    Mutant: str(error) for one_line(error); no rstrip("."); {timeout_s} without :g; `from None`."""
    rendezvous.error = torch_dist.DistError("Timed out after 601 seconds waiting for clients.\n  2/1 clients joined.")
    for timeout_s, shown in ((12.5, "12.5"), (600.0, "600")):
        rendezvous.log.clear()
        with pytest.raises(RunError) as exc:
            dist.setup.init_distributed("gloo", "cpu", timeout_s)
        assert str(exc.value) == (
            f"the 2 ranks did not all meet at 10.1.2.3:29400 within --dist.timeout-s {shown} (Timed out after 601 "
            "seconds waiting for clients. 2/1 clients joined); start every rank (torchrun --nnodes/--nproc-per-node), "
            "check that rank 0's host and port are reachable, or raise --dist.timeout-s; a rank that refused its "
            "input (another node's one line) never joins")
        assert exc.value.__cause__ is rendezvous.error
        assert rendezvous.log[-2:] == [("init_process_group",), ("cancel",)]
