"""GradSync where a hand-picked mutation of dist/grad_sync.py survived the other tests: the divisor of the average
when dist.comm runs in a group smaller than the world (a learner group beside rollout ranks), and the gradient
buckets a GradSync starts from."""

import pytest
import torch
from torch import nn

from dist.grad_sync import GradSync
from tests.multirank import run_ranks

B = 6   # samples per rank


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(40 + rank)
    return torch.randn(B, 4, generator=g), torch.randn(B, 2, generator=g)


def _loss(net, x, y) -> torch.Tensor:
    return (net(x) - y).square().mean()


def grads_in_a_group(rank, world_size, mode, members):
    """Every rank builds every group (torch requires it), then runs GradSync in the group `members` puts it in."""
    import torch.distributed as torch_dist
    from dist import comm
    groups = [torch_dist.new_group(m) for m in members]
    comm.use_group(next(g for g, m in zip(groups, members) if rank in m))
    try:
        net = _net()
        sync = GradSync(net.parameters(), mode, bucket_mb=100 / 2**20, num_extras=1)
        x, y = _data(rank)
        sync.zero_grad()
        sync.arm(torch.tensor([1.0]))
        _loss(net, x, y).backward()
        extras = sync.synchronize()
        return [p.grad.clone() for p in net.parameters()], extras, len(sync.buckets)
    finally:
        comm.use_group(None)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_in_a_group_smaller_than_the_world_gradients_are_averaged_over_the_group_not_the_world(mode):
    """Three ranks, dist.comm's group [0, 1] for ranks 0 and 1 and [2] for rank 2 (a layout of learners beside a
    rank that is not one): ranks 0 and 1 hold the gradient of one process over their two batches concatenated,
    rank 2 its own gradient; the extras count the group's ranks (2, and 1).
    Mutant: synchronize() divides by the default group's size (`world = torch.distributed.get_world_size()`)
    instead of comm.world_size(), the group's."""
    members = [[0, 1], [2]]
    results = run_ranks(grads_in_a_group, 3, args=(mode, members))
    for group in members:
        net = _net()
        xs, ys = zip(*(_data(r) for r in group))
        _loss(net, torch.cat(xs), torch.cat(ys)).backward()
        for rank in group:
            grads, extras, num_buckets = results[rank]
            if mode == "bucketed":
                assert num_buckets >= 2
            assert extras.tolist() == [float(len(group))]
            for g, p in zip(grads, net.parameters()):
                torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_a_new_grad_sync_s_buckets_start_at_zero_whatever_memory_they_were_given(monkeypatch, mode):
    """Module docstring: building a GradSync replaces each .grad by a zeroed view. Allocations are poisoned with
    nan (torch.empty returns whatever memory held before, deterministically here), so a bucket left
    uninitialized shows: every gradient view is zero right after construction, and a first step whose backward
    comes before any zero_grad() gives autograd's gradient exactly.
    Mutant: _Bucket allocates its buffer with torch.empty instead of torch.zeros."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    net = _net()
    sync = GradSync(net.parameters(), mode, bucket_mb=100 / 2**20)
    monkeypatch.undo()
    for p in net.parameters():
        assert torch.equal(p.grad, torch.zeros_like(p))
    x, y = _data(0)
    sync.arm()
    _loss(net, x, y).backward()
    sync.synchronize()
    expected = torch.autograd.grad(_loss(net, x, y), list(net.parameters()))
    for p, e in zip(net.parameters(), expected):
        torch.testing.assert_close(p.grad, e)


@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_arm_without_the_extras_a_grad_sync_was_built_for_is_refused(mode):
    """A GradSync built with num_extras=2 refuses arm() with no extras (they would not be staged: the sum
    synchronize() returns would be whatever the bucket last held, the previous step's), and takes two.
    Mutant: arm() checks the extras only when some are given (`if extras is not None:` for `if self.num_extras:`)."""
    net = _net()
    sync = GradSync(net.parameters(), mode, bucket_mb=100 / 2**20, num_extras=2)
    sync.zero_grad()
    with pytest.raises(ValueError) as info:
        sync.arm()
    assert str(info.value) == "arm() expects 2 extra scalars, got None"
    sync.arm(torch.tensor([3.0, 4.0]))
    x, y = _data(0)
    _loss(net, x, y).backward()
    assert sync.synchronize().tolist() == [3.0, 4.0]


class _MirrorWork:
    """An all-reduce of two ranks whose other rank holds what this one held at launch: its sum lands at wait()."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.other = buffer, buffer.clone()

    def wait(self) -> None:
        self.buffer.add_(self.other)


@pytest.mark.parametrize("mode, unused", [("flat", "error"), ("bucketed", "error"), ("bucketed", "zero")])
def test_a_mirrored_world_of_two_gives_autograd_s_gradient_and_twice_the_extras_without_gloo(monkeypatch, mode,
                                                                                             unused):
    """No process group: comm.world_size() says 2 and comm.all_reduce adds, at wait(), a copy of the bucket as it
    was at launch (a second rank with the same data). Every step, the mean gradient is autograd's on that data,
    the extras come back doubled (summed, not averaged), and no all-reduce work is kept after synchronize().
    The mutants below were caught otherwise only by the gloo tests.
    Mutant: a bucket launched before its last gradient arrived (`bucket.pending -= 2`); the wait skipped; no
    division at world size 2 (`world > 2`); the extras divided too (`b.buffer.div_`), or the gradient view taking
    the extras in (`self.grads = self.buffer`); a finished work kept (`b.work = None` dropped)."""
    from dist import comm

    def mirrored(tensor, purpose, async_op=False):
        work = _MirrorWork(tensor)
        if not async_op:
            work.wait()
        return work if async_op else None
    monkeypatch.setattr(comm, "all_reduce", mirrored)
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    net = _net()
    sync = GradSync(net.parameters(), mode, bucket_mb=60 / 2**20, num_extras=2, unused=unused)
    if mode == "bucketed":
        assert [len(b.params) for b in sync.buckets] == [2, 1, 1]   # 8 + 40 bytes, then 20, then 80
    for step in range(2):
        x, y = _data(step)
        sync.zero_grad()
        sync.arm(torch.tensor([0.5, 3.0 + step]))
        _loss(net, x, y).backward()
        extras = sync.synchronize()
        assert extras.tolist() == [1.0, 6.0 + 2 * step]
        assert all(b.work is None for b in sync.buckets)
        expected = torch.autograd.grad(_loss(net, x, y), list(net.parameters()))
        for p, e in zip(net.parameters(), expected):
            torch.testing.assert_close(p.grad, e)
