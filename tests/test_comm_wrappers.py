"""dist/comm.py's wrappers: on 2 gloo ranks, what each returns and the ledger's count of what each rank moved; in one
process, the input given back and nothing counted; the ledger's snapshot, reset and lock; the group use_group sets
(4 ranks as two pairs) and the rank and world size of that group. At their edges, with torch.distributed's calls
replaced: a call that fails when posted or received is named as the call made and its purpose, with the backend's
first non-blank line and cause, a failed header receive counts nothing, the gather's buffer lands on the sent
tensor's device, and point-to-point calls run in the group their caller passes; dist.batches.naming() names the peer
and keeps the original error as its cause."""

import collections
import gc
import weakref

import pytest
import torch

from dist import comm
from dist.batches import naming
from dist.setup import shutdown
from tests.multirank import run_ranks


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


# After the rank blamed: "a peer rank" for a collective, "rank N" (N the peer) for a point-to-point message.
# The library's own setting first: sync/ and dist/ are copied out alone.
STALLED_BY = ("died or stalled past the process group's timeout (init_process_group(timeout=...); "
              "syncppo's train.py: --dist.timeout-s)")
STALLED = f"a peer rank {STALLED_BY}"


CLOSED_BY = "died (its connection closed)"


REFUSED = "the backend refused or failed it"


@pytest.mark.parametrize("kind", ["isend", "irecv"])
def test_an_isend_or_irecv_refused_when_posted_names_itself_not_its_blocking_twin(monkeypatch, kind):
    """A non-blocking send or receive can fail when it is posted, not only when waited on: the error names the call
    that was made (isend, irecv), as a failed wait() does, so the log points at the right line of sync/.
    Mutant: `_named("send", ...)` / `_named("recv", ...)` around the posting of isend / irecv."""
    monkeypatch.setattr(comm.torch_dist, kind, _Failing("Connection reset by peer"))
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 0)
    with pytest.raises(comm.CollectiveError) as caught:
        getattr(comm, kind)(torch.ones(2), "weight_sync", 1)
    assert str(caught.value) == (f"{kind} for 'weight_sync' failed on rank 0: rank 1 {CLOSED_BY} (Connection reset "
                                 f"by peer)")


def test_a_failed_header_receive_names_the_header_and_counts_nothing(monkeypatch):
    """recv_then_count learns its purpose from the header it receives: when the receive fails there is no purpose
    yet, so the error says "a message header", and nothing is counted (purpose_of never reads the unfilled tensor).
    Mutant: `_named("recv", "header")`; counting before the receive (under purpose_of of the zeros)."""
    monkeypatch.setattr(comm.torch_dist, "recv", _Failing("Timed out waiting 5000ms for recv operation to complete"))
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 3)
    monkeypatch.setattr(comm, "LEDGER", type(comm.LEDGER)(comm.LEDGER.default_factory))
    asked = []
    with pytest.raises(comm.CollectiveError) as caught:
        comm.recv_then_count(torch.zeros(1, dtype=torch.int64), lambda t: asked.append(t) or "kind0", src=0)
    assert str(caught.value) == ("recv for 'a message header' failed on rank 3: rank 0 " + STALLED_BY +
                                 " (Timed out waiting 5000ms for recv operation to complete)")
    assert asked == [] and comm.ledger_snapshot() == {}


def test_a_backend_failure_that_is_not_a_runtime_error_is_named_too(monkeypatch):
    """torch.distributed raises ValueError for arguments it refuses (a rank outside the group, say): it becomes the
    same CollectiveError as a RuntimeError from gloo, naming the call and its purpose, not a bare traceback.
    Mutant: `except RuntimeError` in `_named`."""
    def refused(*args, **kwargs):
        raise ValueError("Invalid destination rank: should be less than 2, but got 5")
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(comm.torch_dist, "broadcast", refused)
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 1)
    with pytest.raises(comm.CollectiveError) as caught:
        comm.broadcast(torch.ones(2), "params", src=5)
    assert str(caught.value) == ("broadcast for 'params' failed on rank 1: " + REFUSED +
                                 " (Invalid destination rank: should be less than 2, but got 5)")
    assert type(caught.value.__cause__) is ValueError


def test_a_backend_message_that_starts_with_a_blank_line_is_read_from_its_first_words(monkeypatch):
    """The first line shown (and read for the cause) is the message's first non-blank one: a message that opens
    with a newline is still a timeout, and says which.
    Mutant: `str(exc).splitlines()[0]` without the `.strip()` (an empty first line: the cause is lost)."""
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(comm.torch_dist, "all_reduce", _Failing("\n  Timed out waiting 600000ms\n  at gloo/pair.cc"))
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 0)
    with pytest.raises(comm.CollectiveError) as caught:
        comm.all_reduce(torch.ones(2), "metrics")
    assert str(caught.value) == f"all_reduce for 'metrics' failed on rank 0: {STALLED} (Timed out waiting 600000ms)"


def test_the_gather_lands_on_the_device_and_dtype_of_what_was_sent(monkeypatch):
    """NCCL gathers into tensors on the GPU the rank sent from: the receiving buffer is made on the sent tensor's
    device with its dtype (here the meta device stands for a GPU: gloo runs on the host alone).
    Mutant: the buffer made without `device=tensor.device` (on the host)."""
    seen = []
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 1)
    monkeypatch.setattr(comm.torch_dist, "gather", lambda tensor, gather_list, dst, group: seen.append(gather_list))
    out = comm.gather(torch.empty(3, dtype=torch.int16, device="meta"), "checkpoint", dst=1)
    assert (out.device.type, out.dtype, tuple(out.shape)) == ("meta", torch.int16, (2, 3))
    assert [(t.device.type, tuple(t.shape)) for t in seen[0]] == [("meta", (3,)), ("meta", (3,))]


@pytest.mark.parametrize("name", ["send", "recv", "isend", "irecv", "recv_then_count"])
def test_point_to_point_messages_run_in_the_group_they_are_given_not_use_group_s(monkeypatch, name):
    """A rollout rank runs its collectives in the rollout ranks' group (use_group) but sends batches to a learner,
    which is not in it: a point-to-point call takes the group its caller passes (None: the world), whatever
    use_group set.
    Mutant: `group=_GROUP` in place of `group=group` in send, recv, isend, irecv or recv_then_count."""
    rollout_ranks, given, seen = object(), object(), []
    monkeypatch.setattr(comm, "_GROUP", rollout_ranks)
    monkeypatch.setattr(comm.torch_dist, name.split("_")[0], lambda tensor, **kwargs: seen.append(kwargs["group"]))
    call = getattr(comm, name)
    extra = (lambda t: "batches",) if name == "recv_then_count" else ("batches",)
    peer = {"dst": 1} if "send" in name else {"src": 1}
    call(torch.zeros(1), *extra, **peer)
    call(torch.zeros(1), *extra, **peer, group=given)
    assert seen[0] is None and seen[1] is given


def test_a_named_collective_error_keeps_the_original_as_its_cause():
    """The traceback of a failed message shows gloo's own error beneath the one that names the peer.

    Mutant: `raise error from None` in naming()."""
    original = comm.CollectiveError("recv for 'batches' failed on rank 0: timed out")
    with pytest.raises(comm.CollectiveError) as exc:
        with naming(3):
            raise original
    assert str(exc.value) == "rollout rank 3 died or stalled: recv for 'batches' failed on rank 0: timed out"
    assert exc.value.__cause__ is original and exc.value.peer == 3


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


def collective_tensors_outlive_their_calls(rank, world_size):
    """Weak references to what each collective was handed (and gave back), the caller's references dropped: which
    are alive after the calls, and after shutdown()."""
    inputs = [torch.ones(4), torch.ones(4), torch.ones(4), torch.ones(4), torch.ones(4)]
    comm.all_reduce(inputs[0], "metrics")
    comm.all_reduce(inputs[1], "gradients", async_op=True).wait()
    comm.broadcast(inputs[2], "params")
    comm.all_gather(inputs[3], "checksum")
    comm.gather(inputs[4], "episode_returns")
    refs = [weakref.ref(t) for t in inputs]
    del inputs
    gc.collect()
    alive = [r() is not None for r in refs]
    shutdown()
    gc.collect()
    return alive, [r() is not None for r in refs]


@pytest.mark.slow
def test_collective_tensors_stay_referenced_until_the_process_groups_are_destroyed():
    """Before torch 2.8 a gloo worker that frees a collective's last tensor reference needs the GIL, which
    destroy_process_group holds while it joins that worker: a deadlock (3 of 150 two-rank exits on torch 2.5.1).
    Mutant: comm.RECENT never appended to -> the tensors are gone right after the calls."""
    for after_calls, after_shutdown in run_ranks(collective_tensors_outlive_their_calls, 2):
        assert after_calls == [True] * 5 and after_shutdown == [False] * 5


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


@pytest.mark.parametrize("call, kind, who", [
    (lambda: comm.all_reduce(torch.ones(2), "metrics"), "all_reduce", "a peer rank"),
    (lambda: comm.broadcast(torch.ones(2), "metrics"), "broadcast", "a peer rank"),
    (lambda: comm.all_gather(torch.ones(2), "metrics"), "all_gather", "a peer rank"),
    (lambda: comm.gather(torch.ones(2), "metrics", dst=1), "gather", "a peer rank"),
    (lambda: comm.send(torch.ones(2), "metrics", dst=0), "send", "rank 0"),
    (lambda: comm.recv(torch.ones(2), "metrics", src=2), "recv", "rank 2"),
    (lambda: comm.isend(torch.ones(2), "metrics", dst=3).wait(), "isend", "rank 3"),
    (lambda: comm.irecv(torch.ones(2), "metrics", src=0).wait(), "irecv", "rank 0"),
    (lambda: comm.all_reduce(torch.ones(2), "metrics", async_op=True).wait(), "all_reduce", "a peer rank"),
], ids=["all_reduce", "broadcast", "all_gather", "gather", "send", "recv", "isend-wait", "irecv-wait", "async-wait"])
@pytest.mark.parametrize("message, said, why", [
    ("Connection closed by peer [127.0.0.1]:1234\n  at gloo/pair.cc:598", "Connection closed by peer [127.0.0.1]:1234",
     "{who} died (its connection closed)"),
    ("Connection reset by peer", "Connection reset by peer", "{who} died (its connection closed)"),
    ("Timed out waiting 10000ms for recv operation to complete", "Timed out waiting 10000ms for recv operation to "
     "complete", "{who} " + STALLED_BY),
    ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600000 ms",
     "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600000 ms",
     "{who} " + STALLED_BY),
    # Not a peer's failure: NCCL handed a host tensor (torch's words), or a message that says nothing
    ("No backend type associated with device type cpu", "No backend type associated with device type cpu",
     "the backend refused or failed it"),
    ("  \n", "RuntimeError", "the backend refused or failed it")])
def test_a_failed_call_or_wait_is_a_collective_error_naming_the_call_purpose_rank_and_cause(
        monkeypatch, call, kind, who, message, said, why):
    """Whatever the backend raised becomes one CollectiveError: the call, its purpose, this rank, the flag that sets
    the timeout, and the first line of the backend's message (its type when the message is blank). A point-to-point
    message names the rank it was sent to or received from as the one that died or stalled ("a peer rank died" did
    not say which); a collective says "a peer rank", gloo's first line giving the address.

    Mutant: `_named(kind, purpose)` without the peer in send, recv, isend, irecv or their waits (`_Work(..., dst)`)."""
    failing = _Failing(message)
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    for name in ("all_reduce", "broadcast", "all_gather", "gather", "send", "recv"):
        monkeypatch.setattr(comm.torch_dist, name, failing)
    for name in ("isend", "irecv"):
        monkeypatch.setattr(comm.torch_dist, name, lambda *args, **kwargs: failing)
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 1)
    with pytest.raises(comm.CollectiveError) as caught:
        call()
    assert str(caught.value) == f"{kind} for 'metrics' failed on rank 1: {why.format(who=who)} ({said})"
    # the message keeps the backend's first line; its whole message (gloo's source line) stays the cause
    assert type(caught.value.__cause__) is RuntimeError and str(caught.value.__cause__) == message


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
