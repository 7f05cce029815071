"""dist/comm.py's wrappers at their edges, without a process group (torch.distributed's calls replaced): a call
that fails when posted or received is named as the call made and its purpose, with the backend's first non-blank
line and cause, a failed header receive counts nothing, the gather's buffer lands on the sent tensor's device, and
point-to-point calls run in the group their caller passes; dist.batches.naming() names the peer and keeps the original
error as its cause."""

import pytest
import torch

from dist import comm
from dist.batches import naming
from tests.test_cli_comm_rules import STALLED, _Failing


CLOSED = "a peer rank died (its connection closed)"


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
    assert str(caught.value) == f"{kind} for 'weight_sync' failed on rank 0: {CLOSED} (Connection reset by peer)"


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
    assert str(caught.value) == ("recv for 'a message header' failed on rank 3: " + STALLED +
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
