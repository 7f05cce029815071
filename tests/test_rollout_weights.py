"""rollout_weights.py in one process: WeightServer's serving thread and request_weights, with the messages and the
sync/ updates replaced by queues (no ranks, no gloo), so each request's answer, and what the thread does on
closing and on failure, is seen message by message, in an order the test forces without sleeps."""

import atexit
import json
import os
import queue
import re
import threading

import pytest
import torch

import rollout_weights
from dist import comm
from dist.errors import RunError
from dist.plan import PlanRow
from rollout_weights import WeightServer, integrity_failure, request_weights
from sync import SyncIntegrityError, WeightSyncConfig
from sync.wire import LINK_LOST, RESYNC_HINT

GUARD_S = 10       # only a broken server makes a test wait this long for a message (then it fails)


class Link:
    """What crosses ranks between a learner and rollout rank 1: requests in (`ask`), and out, in order, the
    learner's replies and sync/ updates. `progress` is set when the serving thread either answers or starts
    waiting for a version to be published."""

    CollectiveError = comm.CollectiveError

    def __init__(self):
        self.requests, self.out, self.progress = queue.Queue(), queue.Queue(), threading.Event()

    def ask(self, have, need):
        self.progress.clear()
        self.requests.put((have, need))

    def recv(self, tensor, purpose, src, group=None):
        assert (purpose, src) == ("weight_request", 1)
        item = self.requests.get()
        if isinstance(item, BaseException):
            raise item
        return tensor.copy_(torch.tensor(item))

    def send(self, tensor, purpose, dst, group=None):
        self.out.put(("reply", purpose, dst, tensor.tolist()))
        self.progress.set()

    def take(self, n):
        return [self.out.get(timeout=GUARD_S) for _ in range(n)]


class Syncer:
    """sync/'s sender for one rollout rank: records what it was asked to send."""

    def __init__(self, link, dsts, fail=None):
        self.link, self.dsts, self.fail = link, dsts, fail

    def init_sender(self, state, _, version):
        self.link.out.put(("init", self.dsts, version))

    def sync(self, state, version):
        if self.fail is not None:
            raise self.fail
        self.link.out.put(("update", self.dsts, version, {k: v.clone() for k, v in state.items()}))

    def plan_rows(self):
        """A handshake and a per-iteration update whose size says which rollout rank it is for."""
        return [PlanRow("weight_sync", "handshake", "send", "setup", [40]),
                PlanRow("weight_sync", "update", "send", "iteration", [100 * self.dsts[0]])]


class Published(threading.Condition):
    """WeightServer's condition, setting `progress` when the serving thread waits on it."""

    def __init__(self, progress):
        super().__init__()
        self.progress = progress

    def wait(self, timeout=None):
        self.progress.set()
        return super().wait(timeout)


class Joining:
    """A serving thread whose join() first calls `on_join` (the rollout rank's last request arrives only once the
    learner waits for it, as when the learner reaches close() before its rollout ranks finish)."""

    def __init__(self, thread, on_join):
        self.thread, self.on_join = thread, on_join

    def join(self, timeout=None):
        self.on_join()
        self.thread.join(timeout)

    def is_alive(self):
        return self.thread.is_alive()


def weights(version):
    """The learner's model at `version`: [[v, -v]] (with no bias), so each version is told apart."""
    return {"weight": torch.tensor([[float(version), -float(version)]])}


def learner(monkeypatch, fail=None, timeout_s=1.0):
    link, model = Link(), torch.nn.Linear(2, 1, bias=False)
    monkeypatch.setattr(rollout_weights, "comm", link)
    monkeypatch.setattr(rollout_weights, "make_weight_syncer", lambda cfg, rank, dsts, group: Syncer(link, dsts, fail))
    server = WeightServer(WeightSyncConfig(type="bucket"), 0, [1], None, timeout_s)
    server.published = Published(link.progress)
    return link, model, server


def set_version(model, version):
    with torch.no_grad():
        model.weight.copy_(weights(version)["weight"])


def update(version):
    return ("update", [1], version, weights(version))


def reply(version):
    return ("reply", "weight_request", 1, [version])


def same(got, expected):
    """Messages compared element by element (torch.equal for the weights)."""
    assert len(got) == len(expected), (got, expected)
    for g, e in zip(got, expected):
        assert g[:3] == e[:3] and len(g) == len(e), (g, e)
        if g[0] == "update":
            assert g[3].keys() == e[3].keys() and all(torch.equal(g[3][k], e[3][k]) for k in e[3]), (g, e)
        else:
            assert g == e, (g, e)


def test_each_request_gets_the_newest_version_at_least_its_need_as_one_update_of_a_copy(monkeypatch):
    """A run from iteration 0: sync/'s handshake as version -1; the first request (need 0) gets version 0; a request
    for a version not yet published waits for it; a rollout rank that missed versions 2 and 3 gets 3 (the newest,
    not its need 2), with the weights as published, not as the learner's next update has them meanwhile; one that
    holds the newest gets the version alone; need -1 ends the thread."""
    link, model, server = learner(monkeypatch)
    set_version(model, 0)
    server.start(model, 0)
    same(link.take(1), [("init", [1], -1)])
    link.ask(-1, 0)
    same(link.take(2), [reply(0), update(0)])
    link.ask(0, 1)
    assert link.progress.wait(GUARD_S)           # the thread waits for version 1, or (wrongly) answered already
    set_version(model, 1)
    server.publish(model, 1)
    same(link.take(2), [reply(1), update(1)])
    for version in (2, 3):
        set_version(model, version)
        server.publish(model, version)
    set_version(model, 4)                        # the learner's next update, not published
    link.ask(1, 2)
    same(link.take(2), [reply(3), update(3)])
    link.ask(3, 3)
    server.threads = [Joining(server.threads[0], lambda: link.ask(3, -1))]   # done, once close() waits for it
    server.close()
    assert not server.threads[0].is_alive()
    same(list(link.out.queue), [reply(3)])       # no update: it holds version 3 already


def test_closing_ends_a_thread_waiting_for_a_version_without_an_answer(monkeypatch):
    """At exit after a learner failure (abandon), a serving thread waiting for a version that will never be
    published must stop at once, answering nothing (an answer would hand the rollout rank weights older than its
    staleness bound allows). Else the exit waits --dist.timeout-s + 5 s per thread."""
    link, model, server = learner(monkeypatch, timeout_s=0.1)
    try:
        server.start(model, 0)
        same(link.take(1), [("init", [1], -1)])
        link.ask(-1, 5)
        assert link.progress.wait(GUARD_S)
        server.abandon()
        assert not server.threads[0].is_alive()
        assert list(link.out.queue) == []
    finally:
        atexit.unregister(server.abandon)


@pytest.mark.parametrize("groups_up", [True, False])
def test_a_failed_message_is_the_learners_error_unless_it_already_failed(monkeypatch, capsys, groups_up):
    """A serving thread whose message fails (its rollout rank died) says nothing and leaves the error to the main
    thread, whose one line reports it: the next publish raises it, as does close; the process is not ended from the
    thread. Once the learner has torn its groups down (it failed first), the thread's failure is a consequence:
    nothing is said or kept."""
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: groups_up)
    link, model, server = learner(monkeypatch)
    try:
        server.start(model, 0)
        link.requests.put(comm.CollectiveError("recv for 'weight_request' failed on rank 0: injected"))
        server.threads[0].join(GUARD_S)
        assert not server.threads[0].is_alive() and exits == []
        said = "rollout rank 1 died or stalled: recv for 'weight_request' failed on rank 0: injected"
        assert capsys.readouterr().err == ""
        if groups_up:
            with pytest.raises(comm.CollectiveError, match=f"^{re.escape(said)}$"):
                server.publish(model, 1)
            with pytest.raises(comm.CollectiveError, match=f"^{re.escape(said)}$"):
                server.close()
        else:
            server.publish(model, 1)
            server.close()
    finally:
        atexit.unregister(server.abandon)


def test_a_bug_in_the_serving_thread_ends_the_process_and_tells_torchrun(monkeypatch, capsys, tmp_path):
    """Anything but a failed message is a bug that nothing else would end before --dist.timeout-s: the thread prints
    its traceback and one line, writes the line where torchrun's failure summary reads it, and ends the process with
    status 1 (os._exit, recorded here instead)."""
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)      # the learner's groups are up
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    link, model, server = learner(monkeypatch, fail=ZeroDivisionError("injected"))
    try:
        server.start(model, 0)
        link.ask(-1, 0)
        server.threads[0].join(GUARD_S)
        line = "error: serving weights to rank 1 failed: unexpected ZeroDivisionError: injected"
        assert exits == [1]
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and err.endswith(f"ZeroDivisionError: injected\n{line}\n"), err
        assert json.load(open(tmp_path / "error.json"))["message"] == line
    finally:
        atexit.unregister(server.abandon)


def test_the_learners_plan_receives_requests_and_sends_versions_for_each_rollout_rank(monkeypatch):
    """The start-up plan is the run's account of what crosses ranks. A learner with rollout ranks 1 and 2: per
    iteration one request in (have, need: 2 int64, 16 bytes) and one version out (8 bytes) per rollout rank; at
    the end two requests in (the final weights, then done) and one version out per rollout rank. Each rollout rank
    has its own sync/ sender, whose rows are followed by one more of its per-iteration updates, at the end (the
    final weights)."""
    link = Link()
    monkeypatch.setattr(rollout_weights, "make_weight_syncer", lambda cfg, rank, dsts, group: Syncer(link, dsts))
    server = WeightServer(WeightSyncConfig(type="bucket"), 0, [1, 2], None, 1.0)
    assert {dst: syncer.dsts for dst, syncer in server.syncers.items()} == {1: [1], 2: [2]}
    rows = [(r.purpose, r.collective, r.cadence, r.call_bytes) for r in server.plan_rows()]
    assert rows == [("weight_request", "recv", "iteration", [16, 16]), ("weight_request", "send", "iteration", [8, 8]),
                    ("weight_request", "recv", "setup", [16, 16, 16, 16]), ("weight_request", "send", "setup", [8, 8]),
                    ("weight_sync", "send", "setup", [40]), ("weight_sync", "send", "iteration", [100]),
                    ("weight_sync", "send", "setup", [100]),
                    ("weight_sync", "send", "setup", [40]), ("weight_sync", "send", "iteration", [200]),
                    ("weight_sync", "send", "setup", [200])]
    assert [r.rule for r in server.plan_rows() if r.purpose == "weight_sync"] == \
        ["handshake", "update", "final weights"] * 2


class Learner:
    """The learner as request_weights sees it: records what is sent, answers `served`."""

    def __init__(self, served=None):
        self.served, self.sent = served, []

    def send(self, tensor, purpose, dst, group=None):
        self.sent.append((purpose, dst, tensor.tolist()))

    def recv(self, tensor, purpose, src, group=None):
        assert (purpose, src) == ("weight_request", 0) and self.served is not None, "nothing is sent back"
        return tensor.fill_(self.served)


class Receiver:
    """sync/'s receiver: applies `applied` (a version, or an error to raise)."""

    def __init__(self, applied):
        self.applied, self.calls = applied, 0

    def apply(self, copy):
        self.calls += 1
        if isinstance(self.applied, BaseException):
            raise self.applied
        return self.applied


def ask(monkeypatch, served, applied, have, need):
    """request_weights from rollout rank 1 to learner 0: what it returns, sent, and how often it applied."""
    learner0, receiver = Learner(served), Receiver(applied)
    monkeypatch.setattr(rollout_weights, "comm", learner0)
    version = request_weights(receiver, None, 0, None, have, need)
    return version, learner0.sent, receiver.calls


def test_a_request_returns_the_version_the_copy_holds(monkeypatch):
    """(have, need) goes up in that order; an update is applied only when the served version is newer; done
    (need -1) waits for nothing and leaves the copy's version as it was."""
    assert ask(monkeypatch, 5, 5, 3, 4) == (5, [("weight_request", 0, [3, 4])], 1)
    assert ask(monkeypatch, 3, 99, 3, 3) == (3, [("weight_request", 0, [3, 3])], 0)
    assert ask(monkeypatch, None, 99, 7, -1) == (7, [("weight_request", 0, [7, -1])], 0)


def test_weights_of_another_version_than_announced_are_refused(monkeypatch):
    """The reply and the update must agree: weights of version 4 announced as 5 would be trained on as 5."""
    with pytest.raises(RunError, match=r"^the learner announced weights version 5 but sent version 4$"):
        ask(monkeypatch, 5, 4, 3, 5)
    # newer than announced is refused too: the batch would carry version 5 for weights of version 6
    with pytest.raises(RunError, match=r"^the learner announced weights version 5 but sent version 6$"):
        ask(monkeypatch, 5, 6, 3, 5)


def test_check_of_one_rollout_rank_raises_only_its_own_thread_failure(monkeypatch):
    """check(dst) is the cause of dst's stall only when dst's serving thread failed: another rank's failure (a healthy
    rank timing out behind the stalled one) is not raised for dst; check() raises the first failure."""
    monkeypatch.setattr(rollout_weights, "make_weight_syncer", lambda cfg, rank, dsts, group: None)
    server = WeightServer(WeightSyncConfig(type="bucket"), 0, [1, 2, 3], None, 1.0)
    first, second = comm.CollectiveError("rank 2 stalled"), comm.CollectiveError("rank 3 timed out")
    server.failures = {2: first, 3: second}
    server.check(1)                                   # rank 1's thread did not fail: nothing to raise
    for dst, failure in ((2, first), (3, second), (None, first)):
        with pytest.raises(comm.CollectiveError) as raised:
            server.check(dst)
        assert raised.value is failure, dst


@pytest.mark.parametrize("hint", [RESYNC_HINT, LINK_LOST], ids=["resync", "link-lost"])
def test_weights_failing_their_integrity_check_end_with_one_line_without_syncs_hint(monkeypatch, hint):
    """sync/'s advice (resync(), or new syncers on a fresh group) is for callers that keep going: the rollout rank's
    line names the version announced and the learner, and says how to continue instead."""
    with pytest.raises(RunError) as raised:
        ask(monkeypatch, 5, SyncIntegrityError(f"weight sync: frame refused; {hint}"), 3, 4)
    assert str(raised.value).startswith("the weights (version 5) from learner rank 0 failed their integrity check: "
                                        "weight sync: frame refused. A run-time failure, not a setting: ")
    assert str(raised.value).endswith("--resume auto") and "resync()" not in str(raised.value)
    assert isinstance(raised.value.__cause__, SyncIntegrityError)
    assert str(integrity_failure(SyncIntegrityError(f"x; {hint}"), "what")).startswith("what failed their "
                                                                                      "integrity check: x. ")
