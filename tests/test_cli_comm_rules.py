"""train.py's helpers and dist/comm.py at their edges: train.cli's status, line and teardown for each kind of
failure, first_on_node, team_checkpoint's layout; the ledger's counts, the group the wrappers run in and the words of
a failed collective."""

import collections
import json
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import train
from configs.config import Config
from dist import comm
from dist.errors import RunError, UsageError, tell_torchrun
from dist.stop import SecondInterrupt
from tests.multirank import run_ranks


# ---- train.py's helpers: cli's status, words and teardown; first_on_node ------------------------------------

@pytest.mark.parametrize("local_rank, first", [(None, True), ("0", True), (" 0 ", True), ("1", False), ("x", True),
                                               ("-1", True)])
def test_first_on_node_is_local_rank_0_or_an_unreadable_one(monkeypatch, local_rank, first):
    """Unset means one process (local rank 0); a value main() will refuse counts as first, so the refusal is said."""
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert train.first_on_node() is first


def _failing_cli(monkeypatch, capsys, failure, local_rank="0"):
    """train.cli around a main() that raises `failure`: (status, stderr, what was torn down and told to torchrun)."""
    events = []

    def main(cfg, typed):
        if failure is not None:
            raise failure
    monkeypatch.setattr(train, "main", main)
    monkeypatch.setattr(train, "shutdown", lambda: events.append("shutdown"))
    monkeypatch.setattr(train, "release_run_dirs", lambda: events.append("release"))
    monkeypatch.setattr(train, "tell_torchrun", lambda message, after_peer=False:
                        events.append(("torchrun", message, "after peer") if after_peer else ("torchrun", message)))
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(sys, "last_value", None, raising=False)
    monkeypatch.setattr(sys, "last_exc", None, raising=False)
    code = train.cli(Config())
    return code, capsys.readouterr().err, events


@pytest.mark.parametrize("failure, code, said", [
    (UsageError("--ppo.clip-param must be > 0"), 2, "error: --ppo.clip-param must be > 0"),
    (RunError("could not write x: No space left"), 1, "error: could not write x: No space left"),
    (comm.CollectiveError("all_reduce for 'metrics' failed on rank 1"), 1,
     "error: all_reduce for 'metrics' failed on rank 1"),
    (KeyboardInterrupt(), 130, "error: interrupted by Ctrl-C outside the training loop: nothing saved since the last "
                               "checkpoint"),
    (SecondInterrupt(), 130, "error: interrupted by a second Ctrl-C: nothing saved since the last checkpoint"),
], ids=["usage", "run", "collective", "ctrl-c", "second-ctrl-c"])
def test_cli_gives_each_failure_its_status_and_one_line_and_tears_down(monkeypatch, capsys, failure, code, said):
    """Status 2 for bad input, 1 for a run-time failure, 130 for Ctrl-C; one line on stderr, the same line for
    torchrun's error file (dated after the peer's failure when a collective failed), the process group and run
    directories released, the failure recorded as uncaught."""
    status, err, events = _failing_cli(monkeypatch, capsys, failure)
    assert (status, err) == (code, said + "\n")
    told = ("torchrun", said) + (("after peer",) if isinstance(failure, comm.CollectiveError) else ())
    assert events == [told, "shutdown", "release"]
    # Recorded as the status the process ends with (what Isaac Lab's exit handler hands Kit), the failure its context.
    assert isinstance(sys.last_value, SystemExit) and sys.last_value.code == code
    assert sys.last_value.__context__ is failure and sys.last_exc is sys.last_value


def test_cli_prints_an_unexpected_exception_s_traceback_and_its_first_line(monkeypatch, capsys):
    """A bug: its traceback, then 'unexpected <type> (traceback above): <first line of its message>', status 1."""
    status, err, events = _failing_cli(monkeypatch, capsys, ZeroDivisionError("float division by zero\nmore"))
    said = "error: unexpected ZeroDivisionError (traceback above): float division by zero"
    assert status == 1 and err.startswith("Traceback (most recent call last):")
    assert err.endswith("ZeroDivisionError: float division by zero\nmore\n" + said + "\n")
    assert events == [("torchrun", said), "shutdown", "release"]


@pytest.mark.parametrize("failure, said", [
    (AssertionError(), "error: unexpected AssertionError (traceback above)"),
    (KeyError(""), "error: unexpected KeyError (traceback above): ''"),
    (RuntimeError("\n  gloo detail\nmore"), "error: unexpected RuntimeError (traceback above): gloo detail"),
])
def test_an_unexpected_exception_s_line_is_its_first_words_or_its_type_alone(monkeypatch, capsys, failure, said):
    """A bare `assert` has no message: the line ends at its type, not ': ' (was 'AssertionError (traceback above): ');
    a message whose first line is blank shows its first words (was ': ' and nothing).
    Mutant: str(exc).splitlines()[0] for the first line -> the blank-first-line case shows nothing."""
    status, err, events = _failing_cli(monkeypatch, capsys, failure)
    assert status == 1 and err.endswith("\n" + said + "\n")
    assert events == [("torchrun", said), "shutdown", "release"]


def test_cli_says_an_allocation_the_device_cannot_serve_as_out_of_memory_naming_the_sizes(monkeypatch, capsys):
    """torch's CPU allocator raises a plain RuntimeError (here a real one, 2**62 bytes); it is not a bug but sizes
    too large (validation's memory estimate is a lower bound, so a size it passes can still fail here): status 1,
    the traceback, and a line naming the flags."""
    with pytest.raises(RuntimeError) as allocation:
        torch.empty(2**62, dtype=torch.uint8)
    status, err, _ = _failing_cli(monkeypatch, capsys, allocation.value)
    first = str(allocation.value).splitlines()[0]
    assert status == 1 and err.startswith("Traceback (most recent call last):")
    assert err.endswith(f"error: out of memory (traceback above: where): {first}; this run's sizes need more memory "
                        "than the device has: lower --env.num-envs, --ppo.num-steps, --policy.actor-hidden/"
                        "critic-hidden or the env's own sizes (tracking: --env.num-motions)\n")
    assert train.out_of_memory(MemoryError()) and not train.out_of_memory(RuntimeError("can't allocate a name"))


def test_a_size_past_what_a_storage_can_count_is_out_of_memory_too(monkeypatch, capsys):
    """--env.num-envs 2**62 passes validation; the first buffer's size then overflows before any allocator sees it
    (a plain RuntimeError with other words): that is sizes too large as well, not a bug."""
    with pytest.raises(RuntimeError) as overflow:
        torch.empty(2**62, 4)
    status, err, _ = _failing_cli(monkeypatch, capsys, overflow.value)
    assert status == 1 and "error: out of memory (traceback above: where): Storage size calculation overflowed" in err
    assert "lower --env.num-envs" in err.splitlines()[-1]


def test_a_cuda_allocation_failure_is_out_of_memory_without_torch_s_device_generic_class(monkeypatch):
    """torch.OutOfMemoryError (device-generic, torch.cuda's class under a second name) came after torch 2.4, which
    requirements allow (2.4 or 2.5: accounts differ): where it is missing, checking for it raised AttributeError while
    a failure was being reported."""
    monkeypatch.delattr(torch, "OutOfMemoryError")
    assert train.out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not train.out_of_memory(RuntimeError("a bug"))


@pytest.mark.parametrize("failure, local_rank, said", [
    (UsageError("--seed bad"), "0", True), (UsageError("--seed bad"), "1", False),
    (UsageError("--env.task bad", say_here=True), "1", True),
    (UsageError("--env.task bad", say_here=False), "0", False),
    (RunError("disk full"), "1", True)])
def test_cli_says_a_usage_error_once_per_node_unless_it_names_who_says_it(monkeypatch, capsys, failure, local_rank,
                                                                         said):
    """Every rank meets the same bad flag: local rank 0 says it; an error only some ranks meet says `say_here`; a
    run-time failure is said by every rank that meets it. torchrun's error file gets it either way."""
    status, err, events = _failing_cli(monkeypatch, capsys, failure, local_rank)
    assert bool(err) is said and events[0] == ("torchrun", f"error: {failure}")


def test_cli_returns_0_after_a_run_and_tears_nothing_down_itself(monkeypatch, capsys):
    """main() shuts its own process group down; cli adds nothing after a run that ended well."""
    assert _failing_cli(monkeypatch, capsys, None) == (0, "", [])


def test_torchrun_names_the_rank_that_failed_first_not_the_one_that_saw_it_die(tmp_path, monkeypatch):
    """torchrun's root cause is the failure with the smallest whole-second timestamp, a tie going to the rank it
    recorded first: a rollout rank that only saw its learner die was named in 5 of 8 learner failures. Its error,
    a failed collective, is now dated a second later (torch's own ChildFailedError picks the root cause here)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    monkeypatch.setattr(time, "time", lambda: 1_000_000.7)       # both in one second
    failures = {}
    for rank, message, after_peer in ((1, "error: learner rank 0 died or stalled", True),   # recorded first
                                      (0, "error: could not write x: No space left", False)):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error_{rank}.json"))
        tell_torchrun(message, after_peer=after_peer)
        failures[rank] = ProcessFailure(local_rank=rank, pid=rank + 1, exitcode=1,
                                        error_file=str(tmp_path / f"error_{rank}.json"))
    rank, first = ChildFailedError("train.py", failures).get_first_failure()
    assert (rank, first.message, first.timestamp) == (0, "error: could not write x: No space left", 1_000_000)
    assert failures[1].timestamp == 1_000_001
    # by default (any other failure) the error is dated when it happened
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error_2.json"))
    tell_torchrun("error: could not write y")
    assert json.loads((tmp_path / "error_2.json").read_text()) == {"message": "error: could not write y",
                                                                   "timestamp": 1_000_000}


# ---- dist/comm.py ----------------------------------------------------------------------------------------------

def two_rank_traffic(rank, world_size):
    """Every wrapper once on 2 gloo ranks; what each returned and this rank's ledger."""
    comm.reset_ledger()
    x = torch.tensor([float(rank), 10.0 - rank])                                 # rank 0: [0, 10]; rank 1: [1, 9]
    out = {"sum": comm.all_reduce(x.clone(), "metrics"),
           "broadcast": comm.broadcast(torch.tensor([rank + 5]), "params", src=1),
           "gathered": comm.all_gather(torch.tensor([rank, 2 * rank], dtype=torch.int32), "checksum"),
           "to_rank1": comm.gather(torch.tensor([rank, 3 * rank + 1], dtype=torch.uint8), "episode_returns", dst=1)}
    work = comm.all_reduce(torch.ones(3, dtype=torch.float64), "gradients", async_op=True)
    work.wait()
    if rank == 0:
        comm.send(torch.tensor([7.0, 8.0, 9.0]), "batches", dst=1)
        comm.send(torch.tensor([3]), "control", dst=1)                              # a header naming kind 3
        received = torch.zeros(2, dtype=torch.int32)
        comm.irecv(received, "weight_sync", src=1).wait()
    else:
        received = comm.recv(torch.zeros(3), "batches", src=0)
        out["header"] = comm.recv_then_count(torch.zeros(1, dtype=torch.int64), lambda t: f"kind{int(t[0])}", src=0)
        comm.isend(torch.tensor([4, 2], dtype=torch.int32), "weight_sync", dst=0).wait()
    out["received"] = received
    return out, comm.ledger_snapshot()


@pytest.mark.slow
def test_the_wrappers_on_two_ranks_reduce_broadcast_gather_and_count_what_each_rank_moved():
    """The element-wise sum of [0, 10] and [1, 9]; a broadcast from rank 1; the all-gather stacked in rank order
    on both ranks, the gather to rank 1 there alone;
    the ledger counts each call and its payload bytes under its purpose: the sender what it sent, the receiver what it
    received, a header under the purpose it names once received."""
    results = run_ranks(two_rank_traffic, 2)
    for rank, (out, _) in enumerate(results):
        assert out["sum"].tolist() == [1.0, 19.0] and out["broadcast"].tolist() == [6], rank
        assert out["gathered"].tolist() == [[0, 0], [1, 2]], rank
    assert results[0][0]["to_rank1"] is None and results[1][0]["to_rank1"].tolist() == [[0, 1], [1, 4]]
    (out0, ledger0), (out1, ledger1) = results
    assert out1["received"].tolist() == [7.0, 8.0, 9.0] and out1["header"].tolist() == [3]
    assert out0["received"].tolist() == [4, 2]
    collectives = {"metrics": (1, 8), "params": (1, 8), "checksum": (1, 8), "gradients": (1, 24),
                   "episode_returns": (1, 2)}
    assert ledger0 == {**collectives, "batches": (1, 12), "control": (1, 8), "weight_sync": (1, 8)}
    assert ledger1 == {**collectives, "batches": (1, 12), "kind3": (1, 8), "weight_sync": (1, 8)}


def test_in_one_process_the_collectives_return_their_input_and_count_nothing():
    """World size 1: all_reduce and broadcast give the tensor back (None as an async all_reduce's work), all_gather and
    gather a stack of one; nothing crossed ranks, so nothing is counted."""
    comm.reset_ledger()
    x = torch.tensor([1.5, -2.0])
    assert comm.all_reduce(x, "metrics") is x and comm.all_reduce(x, "gradients", async_op=True) is None
    assert comm.broadcast(x, "params") is x
    gathered = comm.all_gather(x, "checksum")
    assert gathered.shape == (1, 2) and torch.equal(gathered[0], x)
    gathered = comm.gather(x, "checkpoint")
    assert gathered.shape == (1, 2) and torch.equal(gathered[0], x)
    assert comm.ledger_snapshot() == {}


def test_a_ledger_snapshot_is_a_copy_and_reset_empties_the_ledger():
    """Counting after a snapshot does not change it; negative counts take calls back; reset_ledger clears all."""
    comm.reset_ledger()
    comm.ledger_add("metrics", 2, 64)
    before = comm.ledger_snapshot()
    comm.ledger_add("metrics", 3, 16)
    comm.ledger_add("metrics", -1, -8)
    assert before == {"metrics": (2, 64)} and comm.ledger_snapshot() == {"metrics": (4, 72)}
    comm.reset_ledger()
    assert comm.ledger_snapshot() == {}


def test_the_ledger_is_changed_and_read_only_with_its_lock_held(monkeypatch):
    """Weight-serving threads count into the ledger while the main thread reads it (comm.LEDGER's comment): a read
    racing a new purpose's insertion fails with "dictionary changed size during iteration". No test can time that
    race, so the rule is checked where it is kept: the lock is held at every access of the ledger."""
    held = []

    class Watched(collections.defaultdict):
        def __getitem__(self, key):
            held.append(("count", comm._COUNTING.locked()))
            return super().__getitem__(key)

        def items(self):
            held.append(("read", comm._COUNTING.locked()))
            return super().items()

    monkeypatch.setattr(comm, "LEDGER", Watched(lambda: [0, 0]))
    comm.ledger_add("metrics", 1, 8)
    assert comm.ledger_snapshot() == {"metrics": (1, 8)}
    assert held == [("count", True), ("read", True)]


class _Failing:
    """A backend call that fails (or a work handle whose wait does) with `message`."""

    def __init__(self, message: str):
        self.message = message

    def __call__(self, *args, async_op: bool = False, **kwargs):
        if async_op:        # an async all_reduce fails when waited on
            return self
        raise RuntimeError(self.message)

    def wait(self):
        raise RuntimeError(self.message)


STALLED = ("a peer rank died or stalled past the process group's timeout (init_process_group's timeout=; "
           "train.py: --dist.timeout-s)")   # the library's own setting first: sync/ and dist/ are copied out alone


@pytest.mark.parametrize("call, kind", [
    (lambda: comm.all_reduce(torch.ones(2), "metrics"), "all_reduce"),
    (lambda: comm.broadcast(torch.ones(2), "metrics"), "broadcast"),
    (lambda: comm.all_gather(torch.ones(2), "metrics"), "all_gather"),
    (lambda: comm.gather(torch.ones(2), "metrics", dst=1), "gather"),
    (lambda: comm.send(torch.ones(2), "metrics", dst=0), "send"),
    (lambda: comm.recv(torch.ones(2), "metrics", src=0), "recv"),
    (lambda: comm.isend(torch.ones(2), "metrics", dst=0).wait(), "isend"),
    (lambda: comm.irecv(torch.ones(2), "metrics", src=0).wait(), "irecv"),
    (lambda: comm.all_reduce(torch.ones(2), "metrics", async_op=True).wait(), "all_reduce"),
], ids=["all_reduce", "broadcast", "all_gather", "gather", "send", "recv", "isend-wait", "irecv-wait", "async-wait"])
@pytest.mark.parametrize("message, said, why", [
    ("Connection closed by peer [127.0.0.1]:1234\n  at gloo/pair.cc:598", "Connection closed by peer [127.0.0.1]:1234",
     "a peer rank died (its connection closed)"),
    ("Connection reset by peer", "Connection reset by peer", "a peer rank died (its connection closed)"),
    ("Timed out waiting 10000ms for recv operation to complete", "Timed out waiting 10000ms for recv operation to "
     "complete", STALLED),
    ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600000 ms",
     "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600000 ms",
     STALLED),
    # Not a peer's failure: NCCL handed a host tensor (torch's words), or a message that says nothing
    ("No backend type associated with device type cpu", "No backend type associated with device type cpu",
     "the backend refused or failed it"),
    ("  \n", "RuntimeError", "the backend refused or failed it")])
def test_a_failed_call_or_wait_is_a_collective_error_naming_the_call_purpose_rank_and_cause(
        monkeypatch, call, kind, message, said, why):
    """Whatever the backend raised becomes one CollectiveError: the call, its purpose, this rank, the flag that sets
    the timeout, and the first line of the backend's message (its type when the message is blank)."""
    failing = _Failing(message)
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    for name in ("all_reduce", "broadcast", "all_gather", "gather", "send", "recv"):
        monkeypatch.setattr(comm.torch_dist, name, failing)
    for name in ("isend", "irecv"):
        monkeypatch.setattr(comm.torch_dist, name, lambda *args, **kwargs: failing)
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 1)
    with pytest.raises(comm.CollectiveError) as caught:
        call()
    assert str(caught.value) == f"{kind} for 'metrics' failed on rank 1: {why} ({said})"
    # the message keeps the backend's first line; its whole message (gloo's source line) stays the cause
    assert type(caught.value.__cause__) is RuntimeError and str(caught.value.__cause__) == message


def test_team_checkpoint_records_learners_then_rollout_ranks(monkeypatch):
    """The layout of a checkpoint of 1 learner + 2 rollout ranks is [1, 2], in that order (load_checkpoint checks its
    first entry against the learners' RNG list); the rollout ranks' RNGs and the first one's env state come from the
    gathered blobs, flattened on the host."""
    seen = []

    def states(gathered, spec):
        seen.append((gathered.device.type, tuple(gathered.shape), spec))
        return [{"torch": 1}, {"torch": 2}], {"steps": 3}
    monkeypatch.setattr(train, "unpack_team_states", states)
    roles = SimpleNamespace(num_learners=1, num_rollouts=2)
    entries = train.team_checkpoint(torch.zeros(2, 5, dtype=torch.uint8), {"state_bytes": 5}, roles)
    assert entries == {"env": {"steps": 3}, "rollout_rng": [{"torch": 1}, {"torch": 2}], "layout": [1, 2]}
    assert seen == [("cpu", (10,), {"state_bytes": 5})]


def pairs_in_their_own_groups(rank, world_size):
    """Ranks {0, 1} and {2, 3} each in their own group (as learners are, apart from rollout ranks): every wrapper
    runs in the group use_group set, and world_size() is that group's size."""
    groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    comm.use_group(groups[rank // 2])
    try:
        comm.reset_ledger()
        summed = comm.all_reduce(torch.tensor([10.0 ** rank]), "metrics")
        first = comm.broadcast(torch.tensor([rank]), "params", src=2 * (rank // 2))
        gathered = comm.all_gather(torch.tensor([rank]), "checksum")
        to_first = comm.gather(torch.tensor([rank]), "checkpoint", dst=2 * (rank // 2))
        return comm.world_size(), summed, first, gathered, to_first
    finally:
        comm.use_group(None)


@pytest.mark.slow
def test_collectives_run_in_the_group_use_group_set():
    """4 ranks as two pairs: sums, broadcasts and gathers stay within each pair (1 + 10, 100 + 1000); a gather to
    each pair's first rank brings the pair's two values there alone."""
    results = run_ranks(pairs_in_their_own_groups, 4)
    for rank, (size, summed, first, gathered, to_first) in enumerate(results):
        pair = 2 * (rank // 2)
        assert size == 2, rank
        assert summed.tolist() == [10.0 ** pair + 10.0 ** (pair + 1)], rank
        assert first.tolist() == [pair] and gathered.flatten().tolist() == [pair, pair + 1], rank
        assert (to_first.flatten().tolist() if rank == pair else to_first) == \
            ([pair, pair + 1] if rank == pair else None)


def test_rank_and_world_size_are_those_of_the_group_in_use(monkeypatch):
    """dist.stats places each rank's maxima at slot comm.rank() of a tensor of comm.world_size() slots: in a learners'
    group of 2 inside a world of 4, global rank 3 is the group's rank 1 (slot 3 would be out of range)."""
    learners = object()
    monkeypatch.setattr(comm, "_GROUP", None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1 if group is learners else 3)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2 if group is learners else 4)
    assert (comm.rank(), comm.world_size()) == (3, 4)
    comm.use_group(learners)
    assert (comm.rank(), comm.world_size()) == (1, 2)
