"""GradSync over several steps and at construction: a second (and every later) optimizer step is all-reduced again,
bucketed as flat (against one process over the concatenated data); `flat` issues its one all-reduce at synchronize(),
never from a gradient hook, `bucketed` during the armed backward; the summed extras it returns are the caller's copy
(the next zero_grad()/arm() does not change them); a .grad replaced by another tensor (not None) is refused like one
set to None; parameters of two dtypes are refused at construction."""

import pytest
import torch
from torch import nn

from dist.grad_sync import GradSync
from tests.multirank import run_ranks


B = 4   # samples per rank per step


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _data(rank, step):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(B, 5, generator=g), torch.randn(B, 2, generator=g)


def _loss(net, x, y):
    return (net(x) - y).square().mean()


def three_steps(rank, world_size, mode):
    """Three synchronized SGD steps on this rank's data; the gradient and summed extras of each step."""
    net = _net()
    sync = GradSync(net.parameters(), mode, bucket_mb=1000 / 2**20, num_extras=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out = []
    for step in range(3):
        x, y = _data(rank, step)
        sync.zero_grad()
        sync.arm(torch.tensor([float(rank + 1)]))
        _loss(net, x, y).backward()
        extras = sync.synchronize()
        out.append(([p.grad.clone() for p in net.parameters()], extras.clone(), len(sync.buckets)))
        opt.step()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_every_optimizer_step_is_averaged_over_ranks_not_only_the_first(mode):
    """Steps 2 and 3 equal one process on the concatenated data too (a bucketed launch cursor left at the end
    after step 1 would all-reduce nothing later: each rank would step on its own gradient / world size)."""
    world_size = 2
    results = run_ranks(three_steps, world_size, args=(mode,))
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        xs, ys = zip(*(_data(r, step) for r in range(world_size)))
        opt.zero_grad()
        _loss(net, torch.cat(xs), torch.cat(ys)).backward()
        for res in results:
            grads, extras, num_buckets = res[step]
            if mode == "bucketed":
                assert num_buckets >= 3
            for g, p in zip(grads, net.parameters()):
                torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
            assert extras.tolist() == [1.0 + 2.0]
        opt.step()


class CallRecordingGradSync(GradSync):
    """Counts the all-reduces issued (in one process the collective itself is a no-op)."""

    def _all_reduce(self, buffer, async_op):
        self.calls += 1
        return super()._all_reduce(buffer, async_op)


def test_flat_issues_its_one_all_reduce_at_synchronize_and_bucketed_during_backward():
    """Module docstring: flat all-reduces once, "issued at synchronize(), after backward"; bucketed launches
    from the hooks of the armed backward. Two steps each, so every step issues its own collectives."""
    for mode, during_backward in (("flat", 0), ("bucketed", 3)):
        net = _net()
        sync = CallRecordingGradSync(net.parameters(), mode, bucket_mb=1000 / 2**20)
        assert len(sync.buckets) == (1 if mode == "flat" else 3)
        sync.calls = 0
        for step in range(2):
            x, y = _data(0, step)
            sync.zero_grad()
            sync.arm()
            _loss(net, x, y).backward()
            assert sync.calls == step * len(sync.buckets) + during_backward, mode
            sync.synchronize()
            assert sync.calls == (step + 1) * len(sync.buckets), mode


def test_the_returned_extras_are_a_copy_that_the_next_step_does_not_change():
    """synchronize() returns the summed extras; zero_grad() and arm() of the next step rewrite the bucket the
    extras rode in, and must not rewrite what the caller holds (e.g. the KL statistic it has yet to read)."""
    net = _net()
    sync = GradSync(net.parameters(), "flat", num_extras=2)
    x, y = _data(0, 0)
    sync.zero_grad()
    sync.arm(torch.tensor([0.25, 3.0]))
    _loss(net, x, y).backward()
    summed = sync.synchronize()
    sync.clip_(1e-3)
    sync.zero_grad()
    sync.arm(torch.tensor([7.0, 1.0]))
    assert summed.tolist() == [0.25, 3.0]


def test_a_grad_replaced_by_another_tensor_is_refused_like_one_set_to_none():
    """A .grad rebound to a fresh tensor (p.grad = torch.zeros_like(p), or p.grad = p.grad * 2) is no longer
    a view into the bucket: its gradient would never be all-reduced, so synchronize() must refuse."""
    net = _net()
    sync = GradSync(net.parameters(), "flat")
    x, y = _data(0, 0)
    sync.zero_grad()
    net[2].weight.grad = torch.zeros_like(net[2].weight)
    sync.arm()
    _loss(net, x, y).backward()
    with pytest.raises(RuntimeError, match=r"parameter #2's \.grad is no longer a view"):
        sync.synchronize()


@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_parameters_of_two_dtypes_are_refused_at_construction(mode):
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(300, dtype=torch.float64))]
    with pytest.raises(ValueError, match=r"one parameter dtype.*float32.*float64"):
        GradSync(params, mode, bucket_mb=1000 / 2**20)
