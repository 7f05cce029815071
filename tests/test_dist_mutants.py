"""dist/verify.py and dist/buffers.py over W simulated ranks in one process: each rank a thread, and the dist.comm
collectives they call (all_gather, broadcast, all_reduce) replaced by tests/thread_ranks.py's fake, which does what
torch.distributed does with every thread's tensor. Expected values are written out by hand or computed with numpy
over the per-rank data. These run in milliseconds; the gloo versions are slow tests.

Equivalent (no test can tell it apart): differing_tensors comparing each tensor's checksums with the last rank's
instead of rank 0's (`per[-1, i]`): a column differs from its first entry exactly when it differs from its last,
so the same tensors are named."""

import numpy as np
import pytest
import torch
from torch import nn

from dist.buffers import buffer_plan_rows, resolve_buffer_policy, sync_buffers
from dist.verify import verify_replicas
from tests.thread_ranks import run_threads


def said(body):
    """A body that returns what verify_replicas raised, or "no error"."""
    def run(rank):
        try:
            body(rank)
        except RuntimeError as exc:
            return str(exc)
        return "no error"
    return run


def net(rank: int, moved: dict[int, str]) -> nn.Module:
    """The same small network on every rank (values set, not drawn: the threads share one RNG); on rank r the tensor
    `moved[r]` (if any) has 1 added to its first entry."""
    m = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).view_as(p) / 7 + i)
        if rank in moved:
            dict(m.named_parameters())[moved[rank]].view(-1)[0] += 1
    return m


def test_one_rank_apart_of_three_is_named_against_the_two_that_agree_with_the_tensor(monkeypatch):
    """Rank 1 of 3 differs in one tensor: every rank raises that rank 1 differs from ranks [0, 2] (the larger
    group), naming only that tensor; the message's head is exact.
    Mutant: `len(groups) > 2` (two groups not a divergence), `min(...)` for the agreeing group, `r in agree`, or
    `.all()` for the ranks of a differing tensor in differing_tensors."""
    out = run_threads(monkeypatch, 3, said(lambda rank: verify_replicas(net(rank, {1: "1.bias"}))))
    assert len(set(out)) == 1, out
    assert out[0].startswith("parameters diverged across ranks: rank(s) [1] differ from rank(s) [0, 2] (checksums ")
    assert out[0].endswith("; tensors that differ: ['1.bias']"), out[0]


def test_two_groups_apart_of_four_rank0_with_a_rank_alone_blames_the_larger_group(monkeypatch):
    """Ranks 0 and 3 hold one value, ranks 1 and 2 another moved weight: a tie of two ranks each goes to rank 0's
    group, so ranks [1, 2] are named; the first parameter alone differs and is named.
    Mutant: the checksum over `named[1:]` (the first tensor never compared), or `r in agree`."""
    out = run_threads(monkeypatch, 4, said(lambda rank: verify_replicas(net(rank, {1: "0.weight", 2: "0.weight"}))))
    assert out[0].startswith("parameters diverged across ranks: rank(s) [1, 2] differ from rank(s) [0, 3] "), out[0]
    assert out[0].endswith("; tensors that differ: ['0.weight']"), out[0]


class WithBuffers(nn.Module):
    """One parameter and three buffers; rank r sets each buffer in `apart` to r (so they differ across ranks)."""

    def __init__(self, rank: int, apart: tuple[str, ...]):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        for name in ("kept", "averaged", "own"):
            self.register_buffer(name, torch.full((2,), float(rank if name in apart else 0)))


RULES = {"kept": "broadcast", "averaged": "mean", "own": "local"}


@pytest.mark.parametrize("apart, named", [(("own",), None), (("averaged",), "averaged"), (("kept",), "kept")])
def test_buffers_are_checked_by_their_rule_a_local_one_never(monkeypatch, apart, named):
    """With the rules given, a `local` buffer apart across ranks passes; a `mean` or `broadcast` one apart is
    raised, naming it. Mutant: `rules.get(n, "local") == "local"` (only the local buffers checked)."""
    out = run_threads(monkeypatch, 2, said(lambda rank: verify_replicas(WithBuffers(rank, apart), buffer_rules=RULES)))
    if named is None:
        assert out == ["no error", "no error"]
    else:
        assert out[0].endswith(f"; tensors that differ: [{named!r}]"), out[0]


def test_without_rules_no_buffer_is_checked(monkeypatch):
    """No buffer_rules: every buffer counts as `local` (the docstring's default), so buffers apart pass while the
    parameters agree. Mutant: a buffer missing from the rules taken as `broadcast` (`rules.get(n, "broadcast")`)."""
    out = run_threads(monkeypatch, 2, said(lambda rank: verify_replicas(WithBuffers(rank, ("kept", "averaged")))))
    assert out == ["no error", "no error"]


class Scaler(nn.Module):
    """A module that is not the model (as the reward normalizer), with one merged statistic."""

    def __init__(self, value: float):
        super().__init__()
        self.register_buffer("count", torch.tensor([value]))


def test_a_module_in_also_is_checked_and_named_by_its_class(monkeypatch):
    """Equal models, but the module passed in `also` holds another value on rank 1: raised, the tensor named
    `Scaler.count`. Mutant: the `also` modules left out of the check."""
    out = run_threads(monkeypatch, 2, said(lambda rank: verify_replicas(
        net(rank, {}), also=[(Scaler(float(rank)), {"count": "merge"})])))
    assert out[0].endswith("; tensors that differ: ['Scaler.count']"), out[0]


class Mixed(nn.Module):
    """Buffers of two dtypes under two rules, values by rank: f = [r, 10 r], g = [100 + r] (broadcast, float32);
    h = [r, 2 r, 3 r] and k = [7 r] (mean, float32); n = [2**25 + 1 + r] (broadcast, int64, past float32's exact
    integers); own = [r] (local)."""

    BUFFER_POLICY = {"f": "broadcast", "g": "broadcast", "n": "broadcast", "h": "mean", "k": "mean", "own": "local"}

    def __init__(self, r: int):
        super().__init__()
        self.register_buffer("f", torch.tensor([r, 10.0 * r]) + 1)
        self.register_buffer("g", torch.tensor([100.0 + r]))
        self.register_buffer("h", torch.tensor([r, 2.0 * r, 3.0 * r]))
        self.register_buffer("k", torch.tensor([7.0 * r]))
        self.register_buffer("n", torch.tensor([2 ** 25 + 1 + r], dtype=torch.int64))
        self.register_buffer("own", torch.tensor([float(r)]))


def test_sync_buffers_broadcasts_rank0s_averages_the_means_and_leaves_local_ones(monkeypatch):
    """3 ranks: after sync_buffers every rank holds rank 0's `broadcast` buffers (each its own values, the int64 one
    exactly), numpy's mean over ranks of each `mean` buffer, and its own `local` one.
    Mutant: broadcast from the last rank; mean not divided by the world size; the offset into the flat tensor not
    advanced; the `mean` rule skipped; all buffers grouped as float32 (int64 2**25 + 1 rounded)."""
    def body(rank):
        m = Mixed(rank)
        sync_buffers(m, resolve_buffer_policy(m, m.BUFFER_POLICY))
        return {k: v.clone() for k, v in m.named_buffers()}

    out = run_threads(monkeypatch, 3, body)
    ranks = [Mixed(r) for r in range(3)]
    for rank, got in enumerate(out):
        assert got["f"].tolist() == [1.0, 1.0] and got["g"].tolist() == [100.0]
        assert got["n"].dtype == torch.int64 and got["n"].tolist() == [2 ** 25 + 1]
        for name in ("h", "k"):
            expected = np.mean([getattr(m, name).numpy() for m in ranks], axis=0)
            np.testing.assert_allclose(got[name].numpy(), expected, rtol=1e-6)
        assert got["own"].tolist() == [float(rank)]


def test_buffer_plan_rows_count_bytes_per_dtype():
    """Mixed's rows, by hand: broadcast float32 f (2) + g (1) = 12 bytes and int64 n = 8 bytes; mean float32 h (3) +
    k (1) = 16 bytes. Mutant: numel counted instead of bytes."""
    m = Mixed(0)
    rows = buffer_plan_rows(m, resolve_buffer_policy(m, m.BUFFER_POLICY))
    assert [(r.collective, sorted(r.call_bytes)) for r in rows] == [("broadcast", [8, 12]), ("all_reduce", [16])]
