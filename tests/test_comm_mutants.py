"""dist/comm.py's ledger and dist/plan.py's arithmetic, in one process and in milliseconds: torch.distributed's calls
replaced by recorders and comm.world_size by 2 (a world of two as one rank sees it), so each wrapper's count of calls
and bytes is checked without gloo. Expected values are written out by hand: bytes = element size x number of
elements of this rank's tensor, one call per wrapper call, under the purpose the caller gave."""

import collections

import pytest
import torch

from dist import comm
from dist.plan import PlanRow, expected_ledger, format_plan


class _Done:
    """A work handle that completes at once."""

    def wait(self):
        return True


@pytest.fixture
def two_ranks(monkeypatch):
    """comm as rank 0 of a world of two, with a fresh ledger; torch.distributed's calls recorded, not run: returns
    the list of (call name, args, kwargs) the wrappers made. A receive writes 3 into the tensor it was given (the
    header a sender would have sent)."""
    calls = []
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(comm, "LEDGER", collections.defaultdict(lambda: [0, 0]))
    monkeypatch.setattr(comm, "RECENT", collections.deque(maxlen=16))
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda group=None: 0)

    def recorder(name):
        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            if name == "recv":
                args[0].fill_(3)
            return _Done() if kwargs.get("async_op") or name in ("isend", "irecv") else None
        return call
    for name in ("all_reduce", "broadcast", "all_gather", "gather", "send", "recv", "isend", "irecv"):
        monkeypatch.setattr(comm.torch_dist, name, recorder(name))
    return calls


def test_each_wrapper_counts_one_call_of_its_tensor_s_bytes_under_the_caller_s_purpose(two_ranks):
    """Every wrapper, on tensors of several dtypes: one call each and numel x element size bytes (float64 (2, 3): 48;
    float16 (5,): 10; int16 (4,): 8; uint8 (7,): 7, not x 2 ranks for the all-gather; int32 (3,): 12; float32 (2, 2):
    16 and (3,): 12; int64 (1,): 8; bfloat16 (6,): 12), summed per purpose: gradients 2 calls 58 bytes, batches 2 / 28,
    weight_sync 2 / 20. The ledger is read after each call, so a call counted twice or not at all shows.
    Mutant: `_count` dropped from any wrapper; `tensor.numel()` without `* tensor.element_size()`; all_gather counting
    its tensor once per rank (`_count` twice)."""
    steps = [
        (lambda: comm.all_reduce(torch.zeros(2, 3, dtype=torch.float64), "gradients"), {"gradients": (1, 48)}),
        (lambda: comm.all_reduce(torch.zeros(5, dtype=torch.float16), "gradients", async_op=True).wait(),
         {"gradients": (2, 58)}),
        (lambda: comm.broadcast(torch.zeros(4, dtype=torch.int16), "params", src=1), {"params": (1, 8)}),
        (lambda: comm.all_gather(torch.zeros(7, dtype=torch.uint8), "checksum"), {"checksum": (1, 7)}),
        (lambda: comm.gather(torch.zeros(3, dtype=torch.int32), "checkpoint", dst=0), {"checkpoint": (1, 12)}),
        (lambda: comm.send(torch.zeros(2, 2), "batches", dst=1), {"batches": (1, 16)}),
        (lambda: comm.recv(torch.zeros(3), "batches", src=1), {"batches": (2, 28)}),
        (lambda: comm.isend(torch.zeros(1, dtype=torch.int64), "weight_sync", dst=1).wait(), {"weight_sync": (1, 8)}),
        (lambda: comm.irecv(torch.zeros(6, dtype=torch.bfloat16), "weight_sync", src=1).wait(),
         {"weight_sync": (2, 20)}),
    ]
    expected = {}
    for i, (step, counted) in enumerate(steps):
        step()
        expected.update(counted)
        assert comm.ledger_snapshot() == expected, i


def test_a_header_is_counted_under_the_purpose_it_names_once_received(two_ranks):
    """recv_then_count receives first, then counts the message under purpose_of(what arrived): the fake receive
    writes 3, so one call of 8 bytes (int64) is counted under "kind3", and nothing under "a message header".
    Mutant: `_count("a message header", tensor)` in recv_then_count."""
    received = comm.recv_then_count(torch.zeros(1, dtype=torch.int64), lambda t: f"kind{int(t[0])}", src=1)
    assert received.tolist() == [3] and comm.ledger_snapshot() == {"kind3": (1, 8)}


def test_the_collectives_sum_and_broadcast_from_the_rank_given_in_the_group_in_use(two_ranks, monkeypatch):
    """all_reduce asks for a SUM (every cross-rank statistic is built from sums); broadcast passes the caller's
    source rank; all_reduce, broadcast, all_gather and gather run in the group use_group set.
    Mutant: `op=ReduceOp.MAX` in all_reduce; `src=0` in broadcast."""
    group = object()
    monkeypatch.setattr(comm, "_GROUP", group)
    comm.all_reduce(torch.ones(2), "metrics")
    comm.broadcast(torch.ones(2), "params", src=1)
    comm.all_gather(torch.ones(2), "checksum")
    comm.gather(torch.ones(2), "checkpoint", dst=1)
    (_, _, reduce_kw), (_, _, broadcast_kw), (_, _, gather_all_kw), (_, _, gather_kw) = two_ranks
    assert reduce_kw["op"] == torch.distributed.ReduceOp.SUM and broadcast_kw["src"] == 1 and gather_kw["dst"] == 1
    assert [kw["group"] for kw in (reduce_kw, broadcast_kw, gather_all_kw, gather_kw)] == [group] * 4


def test_expected_ledger_merges_rows_of_one_purpose():
    """Two rows under one purpose add up: a setup broadcast of 100 + 20 bytes (2 calls) and an iteration all-reduce
    of 8 bytes in 3 rounds over 4 iterations (12 calls, 96 bytes) are "params": [14, 216]; a third row of another
    purpose stays apart; a row without calls adds no entry, even under a purpose of its own.
    Mutant: `out[row.purpose] = [0, 0]` in expected_ledger (the last row of a purpose replaces the earlier ones)."""
    rows = [PlanRow("params", "r", "broadcast", "setup", [100, 20]),
            PlanRow("metrics", "r", "all_reduce", "iteration", [16]),
            PlanRow("params", "r", "all_reduce", "iteration", [8], rounds=3),
            PlanRow("kept", "r", "-", "-", [])]
    assert expected_ledger(rows, 4) == {"params": [14, 216], "metrics": [4, 64]}


def test_an_empty_row_of_a_communicating_cadence_adds_no_purpose():
    """A row with a cadence but no messages (a component that has nothing to send at this size) predicts nothing:
    no purpose with [0, 0], which a ledger that never counted it would not hold.
    Mutant: `if n:` in place of `if n and row.calls:` in expected_ledger."""
    rows = [PlanRow("sampler", "r", "all_reduce", "every", [], every=2), PlanRow("metrics", "r", "all_reduce",
                                                                              "iteration", [8])]
    assert expected_ledger(rows, 4) == {"metrics": [4, 32]}


def test_a_resumed_run_s_iteration_rows_count_its_own_iterations_only():
    """From checkpoint iteration 5, 3 more iterations run an iteration row 3 times, not 8: the start shifts which
    iterations an `every` row falls on (after 6 and 8 for every 2: 2 times), not how many iterations ran.
    Mutant: `return iterations + start` for cadence "iteration"."""
    rows = [PlanRow("metrics", "r", "all_reduce", "iteration", [8]), PlanRow("sampler", "r", "all_reduce", "every",
                                                                            [4], every=2)]
    assert expected_ledger(rows, 3, start=5) == {"metrics": [3, 24], "sampler": [2, 8]}


def test_a_gather_gives_the_stack_to_its_destination_alone(two_ranks):
    """Rank 0 gathering to rank 1 passes no receive buffers and gets None back (the other ranks receive nothing,
    what makes gather cheaper than an all-gather); it still counts what it sent: 1 call, 3 x 4 bytes.
    Mutant: the receive buffer made on every rank (`if True else None` for `get_rank() == dst`)."""
    assert comm.gather(torch.zeros(3, dtype=torch.int32), "checkpoint", dst=1) is None
    ((name, args, kwargs),) = two_ranks
    assert (name, args[1], kwargs["dst"]) == ("gather", None, 1)
    assert comm.ledger_snapshot() == {"checkpoint": (1, 12)}


def test_an_all_gather_stacks_the_ranks_tensors_along_a_new_first_dim(two_ranks, monkeypatch):
    """Each rank's (2, 3) tensor, gathered from 2 ranks, comes back as [2, 2, 3] with rank r's tensor at [r] (the
    fake backend writes r + 1 into rank r's slot), not concatenated along the existing first dim.
    Mutant: `torch.cat(out)` for `torch.stack(out)` in all_gather."""
    def fill(out, tensor, group=None):
        for r, slot in enumerate(out):
            slot.fill_(r + 1)
    monkeypatch.setattr(comm.torch_dist, "all_gather", fill)
    gathered = comm.all_gather(torch.zeros(2, 3), "checksum")
    assert gathered.shape == (2, 2, 3) and gathered[:, 0, 0].tolist() == [1.0, 2.0]


def test_a_row_without_messages_shows_no_steps_in_the_plan_table():
    """A row that crosses nothing ("-", no call sizes) prints "-" for its bytes even when it has rounds: "(x3 steps)"
    belongs to rows whose messages repeat per optimizer step.
    Mutant: `if r.rounds > 1:` for `if r.call_bytes and r.rounds > 1:` in format_plan."""
    text = format_plan([PlanRow("kept", "identical by construction", "-", "-", [], rounds=3)], 2)
    assert text.splitlines()[-1].endswith("  -") and "steps" not in text


@pytest.mark.parametrize("backend", ["mpi", "ucc"])
def test_an_unset_device_is_the_host_under_any_backend_but_nccl(monkeypatch, backend):
    """device()'s rule, unset: the current CUDA device under an NCCL group only, "else the host", so a copy of
    dist/comm.py in a project on another backend stages its tensors on the host (no CUDA device is asked for).
    Mutant: `get_backend(_GROUP) != "gloo"` for `== "nccl"` in device()."""
    monkeypatch.setattr(comm, "_DEVICE", None)
    monkeypatch.setattr(comm.torch_dist, "is_initialized", lambda: True)
    monkeypatch.setattr(comm.torch_dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert comm.device() == torch.device("cpu")
