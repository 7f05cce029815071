"""GradSync against torch's DistributedDataParallel (and plain autograd) on edge cases: frozen, zero-sized,
transposed, tied and rank-dependently unused parameters; shared parameters passed twice; calls made
out of order, which must be a clear error rather than a silently wrong or local gradient; and clip_ against torch's
clip_grad_norm_."""

import pytest
import torch
from torch import nn

from dist.grad_sync import GradSync
from tests.multirank import run_ranks

B = 6


class Odd(nn.Module):
    """Every awkward kind of parameter at once."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 4)
        self.a.bias.requires_grad_(False)                           # frozen
        self.empty = nn.Parameter(torch.zeros(0, 4))                # zero-sized
        self.wt = nn.Parameter(torch.randn(3, 4).t())               # non-contiguous (transposed view)
        self.b = nn.Linear(3, 3)
        self.c = nn.Linear(3, 3)
        self.c.weight = self.b.weight                               # tied: one Parameter used twice
        self.only_rank0 = nn.Linear(3, 3)                           # used on rank 0 only

    def forward(self, x, rank):
        h = torch.tanh(self.a(x)) @ self.wt + self.empty.sum()
        h = self.c(torch.tanh(self.b(h)))
        return self.only_rank0(h) if rank == 0 else h


def data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(B, 5, generator=g), torch.randn(B, 3, generator=g)


def odd_grad_sync(rank, world_size, mode, bucket_mb):
    net = Odd()
    sync = GradSync(net.parameters(), mode, bucket_mb=bucket_mb, unused="zero")
    x, y = data(rank)
    sync.zero_grad()
    sync.arm()
    (net(x, rank) - y).square().mean().backward()
    sync.synchronize()
    grads = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
    norm = sync.clip_(0.01)
    return grads, [None if p.grad is None else p.grad.clone() for p in net.parameters()], norm


def odd_ddp(rank, world_size):
    net = Odd()
    ddp = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    x, y = data(rank)
    (ddp(x, rank) - y).square().mean().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
    return grads, [None if p.grad is None else p.grad.clone() for p in net.parameters()], norm


@pytest.mark.slow
@pytest.mark.parametrize("mode,bucket_mb", [("flat", 25.0), ("bucketed", 1e-5)])
def test_awkward_parameters_equal_ddp(mode, bucket_mb):
    results = run_ranks(odd_grad_sync, 2, args=(mode, bucket_mb))
    ddp_grads, ddp_clipped, ddp_norm = run_ranks(odd_ddp, 2)[0]
    for grads, clipped, norm in results:
        for g, c, dg, dc in zip(grads, clipped, ddp_grads, ddp_clipped):
            if dg is None:               # frozen: no gradient in either
                assert g is None
                continue
            torch.testing.assert_close(g, dg, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(c, dc, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(norm, ddp_norm)
    assert ddp_norm > 0.01                # the clip really scaled


# ---- shared parameters passed twice ------------------------------------------------------------------

class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        trunk = nn.Linear(5, 8)
        self.actor = nn.Sequential(trunk, nn.Tanh(), nn.Linear(8, 2))
        self.critic = nn.Sequential(trunk, nn.Tanh(), nn.Linear(8, 1))

    def loss(self, x):
        return self.actor(x).square().mean() + self.critic(x).square().mean()


@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_a_shared_parameter_listed_twice_is_synchronized_once(mode):
    # [*actor.parameters(), *critic.parameters()] names the shared trunk twice (as a torch optimizer
    # would accept with a warning); it must still be one gradient, equal to plain autograd.
    net = ActorCritic()
    params = [*net.actor.parameters(), *net.critic.parameters()]
    sync = GradSync(params, mode, bucket_mb=1e-4)
    x = data(0)[0]
    sync.zero_grad()
    sync.arm()
    net.loss(x).backward()
    sync.synchronize()
    expected = torch.autograd.grad(net.loss(x), list(net.parameters()))
    for p, g in zip(net.parameters(), expected):
        torch.testing.assert_close(p.grad, g)


# ---- calls out of order -------------------------------------------------------------------------------

def arm_twice(rank, world_size, mode):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    sync = GradSync(net.parameters(), mode, bucket_mb=1e-4)
    x, y = data(rank)
    sync.zero_grad()
    sync.arm()
    (net(x) - y).square().mean().backward()      # bucketed: the all-reduces are in flight now
    try:
        sync.arm()
    except RuntimeError as exc:
        return str(exc)
    sync.synchronize()
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_arm_again_after_the_armed_backward_is_an_error(mode):
    # Bucketed, a second arm() forgot the launched all-reduces and launched every bucket again on the same
    # buffers: gradients silently wrong. Either mode must say so instead.
    for result in run_ranks(arm_twice, 2, args=(mode,)):
        assert isinstance(result, str) and "arm()" in result and "synchronize()" in result, result


def test_zero_grad_between_arm_and_synchronize_is_an_error():
    # It zeroed the staged extras (KL sum and count came back 0) and, bucketed, buffers being all-reduced.
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    sync = GradSync(net.parameters(), "flat", num_extras=2)
    sync.zero_grad()
    sync.arm(torch.tensor([0.5, 6.0]))
    with pytest.raises(RuntimeError, match=r"zero_grad\(\).*arm\(\).*synchronize\(\)"):
        sync.zero_grad()


def test_clip_before_synchronize_is_an_error():
    # The local (unsynchronized) gradient would be clipped, on its own norm, then averaged.
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    sync = GradSync(net.parameters(), "flat")
    sync.zero_grad()
    sync.arm()
    x, y = data(0)
    (net(x) - y).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"clip_\(\).*synchronize\(\)"):
        sync.clip_(0.01)


def test_synchronize_twice_in_a_step_says_so_and_leaves_the_gradient_alone():
    """A second synchronize() in one step (a helper that synchronizes, then the loop again) was told "synchronize()
    without arm(): call arm() before the last micro-batch's backward", though arm() had been called; it now says
    twice, and the averaged gradient stays as the first call left it. Without any arm() the old message stays.
    Mutant: the `self._synchronized` branch removed (the second call gets the "without arm()" message)."""
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    sync = GradSync(net.parameters(), "flat")
    with pytest.raises(RuntimeError, match=r"^synchronize\(\) without arm\(\)"):
        sync.synchronize()
    sync.zero_grad()
    sync.arm()
    x, y = data(0)
    (net(x) - y).square().mean().backward()
    sync.synchronize()
    expected = torch.autograd.grad((net(x) - y).square().mean(), list(net.parameters()))
    with pytest.raises(RuntimeError, match=r"^synchronize\(\) twice in one step: the gradients are already averaged"):
        sync.synchronize()
    for p, g in zip(net.parameters(), expected):
        torch.testing.assert_close(p.grad, g)


def test_extras_without_num_extras_are_an_error():
    # They were dropped silently: synchronize() returned an empty tensor instead of their sum.
    net = nn.Linear(5, 3)
    sync = GradSync(net.parameters(), "flat")
    with pytest.raises(ValueError, match="num_extras"):
        sync.arm(torch.tensor([0.5, 6.0]))


def _grads_after_clip(mode: str, max_norm: float, scale: float):
    """One process (world size 1): the gradients of a small net after GradSync.clip_(max_norm), torch's
    clip_grad_norm_ on an identical copy, and both norms. `scale` multiplies the loss to set the gradient norm."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    ref.load_state_dict(net.state_dict())
    x = torch.randn(9, 5)
    # bucket_mb of 100 bytes: three buckets (bias and weight of the last layer share one), so the norm spans buckets
    sync = GradSync(net.parameters(), mode, bucket_mb=100 / 2**20)
    sync.zero_grad()
    sync.arm()
    (scale * net(x).square().mean()).backward()
    sync.synchronize()
    norm = sync.clip_(max_norm)
    (scale * ref(x).square().mean()).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    return sync, [p.grad.clone() for p in net.parameters()], [p.grad for p in ref.parameters()], norm, ref_norm


@pytest.mark.parametrize("mode", ["flat", "bucketed"])
@pytest.mark.parametrize("max_norm_over_norm", [10.0, 0.3])
@pytest.mark.parametrize("loss_scale", [1.0, 1e-4])
def test_clip_only_scales_down_and_equals_torch_clip_grad_norm(mode, max_norm_over_norm, loss_scale):
    """Below max_norm the gradient is left as it is (clip_grad_norm_'s clamp at 1: never scaled up); above, it is
    scaled by max_norm / (norm + 1e-6) as torch's clip_grad_norm_ does (visible at a tiny norm), over all buckets
    together; the returned norm is the one before clipping."""
    _, _, _, unclipped_norm, _ = _grads_after_clip(mode, float("inf"), loss_scale)
    max_norm = max_norm_over_norm * unclipped_norm.item()
    sync, grads, ref_grads, norm, ref_norm = _grads_after_clip(mode, max_norm, loss_scale)
    if mode == "bucketed":
        assert len(sync.buckets) == 3   # [12 + 84 bytes], [28], [140]: the cap is reached in each
    torch.testing.assert_close(norm, ref_norm)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    n = unclipped_norm.item()
    assert torch.isclose(total, torch.tensor(n * min(1.0, max_norm / (n + 1e-6))), rtol=1e-5)


def test_buckets_fill_from_the_last_parameter_each_one_up_to_exactly_the_cap():
    """A tensor joins the current bucket while it stays at or under the cap, counting every bucket's bytes from 0:
    at an 8-byte cap, float32 parameters of 2, 1, 1, 1, 1 elements make [4 + 4], [4 + 4], [8], last parameter first.
    Mutant: a bucket after the first started its count at 1 byte (`current, size = [], 1`), splitting [4 + 4]."""
    params = [nn.Parameter(torch.zeros(n)) for n in (2, 1, 1, 1, 1)]
    sync = GradSync(params, "bucketed", bucket_mb=8 / 2**20)
    assert [[id(p) for p in b.params] for b in sync.buckets] == [[id(params[4]), id(params[3])],
                                                                  [id(params[2]), id(params[1])], [id(params[0])]]
    assert sync.bucket_bytes() == [8, 8, 8]
