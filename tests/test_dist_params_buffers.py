"""dist/params.py's start-up broadcast (rank 0's parameters and buffers to every rank, one call per dtype, its plan
rows, and ranks whose parameter or buffer shapes differ stopped before it) and dist/buffers.py's buffer rules
(broadcast, mean and local buffers synced and counted as the plan says; a `mean` rule on a non-floating buffer
refused; so is a synced rule on a non-persistent buffer)."""

import pytest
import torch
from torch import nn

from dist import comm
from dist.buffers import buffer_plan_rows, resolve_buffer_policy, sync_buffers
from dist.params import broadcast_module, broadcast_plan_rows
from dist.plan import PlanRow
from tests.multirank import run_ranks


class Mixed(nn.Module):
    """Parameters and buffers of three dtypes, different on every rank (rank r adds 100 r)."""

    def __init__(self, rank):
        super().__init__()
        r = float(rank)
        self.w = nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]) + 100 * r)
        self.b = nn.Parameter(torch.tensor([5.0, 6.0, 7.0]) + 100 * r)
        self.register_buffer("shift", torch.tensor([8.0, 9.0], dtype=torch.float64) + 100 * r)
        self.register_buffer("steps", torch.tensor([10 + 100 * rank, 11], dtype=torch.int64))
        self.register_buffer("scale", torch.tensor([12.0]) + 100 * r)       # float32, after the parameters


def broadcast_body(rank, world_size):
    comm.reset_ledger()
    m = Mixed(rank)
    broadcast_module(m)
    state = {k: v.detach().clone() for k, v in [*m.named_parameters(), *m.named_buffers()]}
    return state, [p.requires_grad for p in m.parameters()], comm.ledger_snapshot()


@pytest.mark.slow
def test_broadcast_module_gives_every_rank_rank_0_s_tensors_in_one_call_per_dtype():
    rank0 = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([5.0, 6.0, 7.0]),
             "shift": torch.tensor([8.0, 9.0], dtype=torch.float64), "steps": torch.tensor([10, 11]),
             "scale": torch.tensor([12.0])}
    for state, requires_grad, ledger in run_ranks(broadcast_body, 3):
        assert state.keys() == rank0.keys()
        for name, value in rank0.items():
            assert state[name].dtype == value.dtype and torch.equal(state[name], value), name
        assert requires_grad == [True, True]
        # float32: 4 + 3 + 1 elements x 4 bytes; float64: 2 x 8; int64: 2 x 8
        assert ledger == {"shapes": (1, 8), "params": (3, 32 + 16 + 16)}   # the layout checksum, then the tensors


def test_broadcast_plan_row_is_one_setup_call_per_dtype_by_hand():
    (layout, row) = broadcast_plan_rows(Mixed(0))
    assert layout == PlanRow("shapes", "same names everywhere", "all_gather", "setup", [8])
    assert (row.purpose, row.rule, row.collective, row.cadence, row.rounds) == \
        ("params", "broadcast from rank 0", "broadcast", "setup", 1)
    assert sorted(row.call_bytes) == [16, 16, 32]          # the calls' order follows the dtypes' first appearance
    assert broadcast_plan_rows(nn.Linear(3, 2))[1:] == [PlanRow("params", "broadcast from rank 0", "broadcast", "setup",
                                                            [(6 + 2) * 4])]


def layout_body(rank, world_size):
    m = nn.Linear(3 + rank, 2)          # e.g. an env that reports another observation size on rank 1
    try:
        broadcast_module(m)
    except RuntimeError as e:
        return str(e)
    return f"no error, weight {tuple(m.weight.shape)}"


@pytest.mark.slow
def test_ranks_with_other_parameter_shapes_stop_before_the_broadcast_naming_the_ranks_and_their_layouts():
    """gloo broadcasts rank 0's 8 floats into rank 1's 10 without an error: the shapes must be compared first."""
    first, second = run_ranks(layout_body, 2)
    for message, shape in ((first, "(2, 3)"), (second, "(2, 4)")):
        assert "(name, shape, dtype) differ: rank(s) [1] differ from rank(s) [0]" in message, message
        assert f"weight {shape} torch.float32" in message


def buffer_layout_body(rank, world_size):
    m = nn.Linear(3, 2)                 # the same parameters everywhere; a normalizer of another size on rank 1
    m.register_buffer("obs_mean", torch.zeros(3 + rank, dtype=torch.float64))
    try:
        broadcast_module(m)
    except RuntimeError as e:
        return str(e)
    return f"no error, obs_mean {tuple(m.obs_mean.shape)}"


@pytest.mark.slow
def test_ranks_whose_buffers_alone_differ_in_shape_stop_before_the_broadcast():
    """The layout compared before the broadcast covers the buffers too (normalizer statistics are buffers): with equal
    parameters, a buffer of another size on rank 1 must stop every rank, naming it, not be filled by gloo from rank
    0's smaller tensor."""
    first, second = run_ranks(buffer_layout_body, 2)
    for message, shape in ((first, "(3,)"), (second, "(4,)")):
        assert "(name, shape, dtype) differ: rank(s) [1] differ from rank(s) [0]" in message, message
        assert f"obs_mean {shape} torch.float64" in message, message


class Rules(nn.Module):
    BUFFER_POLICY = {"b_*": "broadcast", "m_*": "mean", "keep": "local"}

    def __init__(self, rank):
        super().__init__()
        self.register_buffer("b_float", torch.tensor([1.0, 2.0]) + 10 * rank)
        self.register_buffer("b_count", torch.tensor(3 + rank, dtype=torch.int32))
        self.register_buffer("m_float", torch.tensor([4.0, 6.0, 8.0]) * (rank + 1))
        self.register_buffer("keep", torch.tensor([float(rank)]))


def rules_body(rank, world_size):
    comm.reset_ledger()
    m = Rules(rank)
    sync_buffers(m, resolve_buffer_policy(m, m.BUFFER_POLICY))
    return {k: v.clone() for k, v in m.named_buffers()}, comm.ledger_snapshot()


@pytest.mark.slow
def test_sync_buffers_counts_its_collectives_as_buffers_as_its_plan_says():
    rows = buffer_plan_rows(Rules(0), resolve_buffer_policy(Rules(0), Rules.BUFFER_POLICY))
    assert [(r.collective, r.call_bytes) for r in rows] == [("broadcast", [8, 4]), ("all_reduce", [12])]
    for rank, (bufs, ledger) in enumerate(run_ranks(rules_body, 2)):
        assert torch.equal(bufs["b_float"], torch.tensor([1.0, 2.0]))
        assert bufs["b_count"].dtype == torch.int32 and bufs["b_count"].item() == 3
        assert torch.equal(bufs["m_float"], torch.tensor([6.0, 9.0, 12.0]))      # mean of 1x and 2x
        assert bufs["keep"].item() == rank
        assert ledger == {"buffers": (3, 8 + 4 + 12)}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_a_mean_rule_on_any_non_floating_buffer_is_a_start_up_error(dtype):
    m = nn.Module()
    m.register_buffer("flags", torch.zeros(2, dtype=dtype))
    with pytest.raises(ValueError, match=r"^buffers \['flags'\] are integer but declared `mean`"):
        resolve_buffer_policy(m, {"flags": "mean"})
    assert resolve_buffer_policy(m, {"flags": "broadcast"}) == {"flags": "broadcast"}


@pytest.mark.parametrize("rule", ["broadcast", "mean", "merge"])
def test_a_synced_rule_on_a_non_persistent_buffer_is_a_start_up_error(rule):
    """A buffer registered with persistent=False is in named_buffers (so the buffer sync and the replica check took
    it) but not in the state_dict: checkpoints dropped it and rollout ranks never received it, so their copies kept
    the constructor's value while the learners' changed (found adding such a buffer to the policy and comparing the
    rollout copy with the learner after training with --rollout.ranks 1). `local` stays allowed.
    Mutant: the `unsaved` check left out of resolve_buffer_policy."""
    m = nn.Module()
    m.register_buffer("scratch", torch.zeros(2), persistent=False)
    m.register_buffer("kept", torch.zeros(2))
    with pytest.raises(ValueError, match=r"^buffers \['scratch'\] are registered with persistent=False but declared "
                                         r"synced: .*register them persistent, or declare them `local`"):
        resolve_buffer_policy(m, {"scratch": rule, "kept": "broadcast"})
    assert resolve_buffer_policy(m, {"scratch": "local", "kept": rule}) == {"scratch": "local", "kept": rule}
