"""GradSync against plain autograd where the layout or the order of calls is unusual (found by an adversarial audit
against torch's DDP): a transposed parameter, a parameter with gaps or a size-1 dimension of any stride, a
collective between the armed backward and synchronize(), and a minibatch that does not split into equal
micro-batches."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist.grad_sync import GradSync
from ppo.minibatch_step import backward_minibatch, build_optimizer
from ppo.storage import RolloutStorage
from tests.multirank import run_ranks
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg


class Transposed(nn.Module):
    """A weight stored transposed (strides (1, 3)), as a tied or imported layer can be."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wt = nn.Parameter(torch.randn(3, 5).t())
        self.b = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return (x @ self.wt.t() + self.b).tanh().square().sum()


def test_a_transposed_parameter_steps_with_the_fused_adam_exactly_as_plain_autograd():
    """The gradient view had contiguous strides, so the fused Adam (build_optimizer's) added grad element i to weight
    element i of another layout: after one step at lr 0.1 the weight was off by ~0.2. Now the view takes the
    parameter's strides and two steps match plain autograd bit for bit."""
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    plain, synced = Transposed(), Transposed()
    cfg = ppo_cfg(learning_rate=0.1)
    optimizers = [build_optimizer(m.parameters(), cfg, torch.device("cpu")) for m in (plain, synced)]
    sync = GradSync(synced.parameters())
    assert synced.wt.grad.stride() == synced.wt.stride() == (1, 5)
    for _ in range(2):
        optimizers[0].zero_grad()
        plain(x).backward()
        optimizers[0].step()
        sync.zero_grad()
        sync.arm()
        synced(x).backward()
        sync.synchronize()
        optimizers[1].step()
    assert torch.equal(synced.wt, plain.wt) and torch.equal(synced.b, plain.b)


def test_a_parameter_with_gaps_is_refused_by_name():
    every_other = nn.Parameter(torch.randn(4, 6)[:, ::2])
    assert every_other.stride() == (6, 2)
    with pytest.raises(ValueError, match=r"^parameter #1 of shape \(4, 3\) has strides \(6, 2\), a view with gaps"):
        GradSync([nn.Parameter(torch.randn(2)), every_other])
    GradSync([nn.Parameter(torch.randn(0, 4)), nn.Parameter(torch.randn(4, 0))])   # zero-sized ones are dense


def two_layers():
    torch.manual_seed(0)
    return nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)


def head_on_rank_0_only(rank, first, head):
    """Rank 0's loss goes through both layers; rank 1's skips the head (a parameter unused on one rank only)."""
    hidden = first(torch.randn(4, 3, generator=torch.Generator().manual_seed(rank)))
    return head(hidden).square().sum() if rank == 0 else hidden.square().sum()


def collective_between_body(rank, world_size):
    first, head = two_layers()
    sync = GradSync([first.weight, head.weight], "bucketed", bucket_mb=1e-6, unused="zero")   # a bucket each
    sync.zero_grad()
    sync.arm()
    head_on_rank_0_only(rank, first, head).backward()
    metric = torch.full((9,), float(rank + 1))
    dist.all_reduce(metric)               # e.g. a logged value, issued before synchronize()
    sync.synchronize()
    return metric, first.weight.grad.clone(), head.weight.grad.clone()


@pytest.mark.slow
def test_a_collective_between_the_armed_backward_and_synchronize_pairs_with_the_same_one_on_every_rank():
    """Bucketed with unused="zero": rank 0 launched the head's bucket during backward, rank 1 only at synchronize(),
    so the all-reduce issued in between paired with rank 0's bucket (metric -0.6 and 2.86, gradients off by ~1.2 and
    different per rank). With unused="zero" every bucket now launches at synchronize() on every rank."""
    expected = []
    for rank in range(2):
        layers = two_layers()
        grads = torch.autograd.grad(head_on_rank_0_only(rank, *layers), [m.weight for m in layers], allow_unused=True)
        expected.append([torch.zeros(3, 3) if g is None else g for g in grads])
    mean = [(expected[0][i] + expected[1][i]) / 2 for i in range(2)]
    for metric, first_grad, head_grad in run_ranks(collective_between_body, world_size=2):
        assert metric.tolist() == [3.0] * 9
        torch.testing.assert_close(first_grad, mean[0])
        torch.testing.assert_close(head_grad, mean[1])


def test_backward_minibatch_refuses_a_minibatch_that_does_not_split_into_equal_micro_batches():
    """10 transitions in 4 micro-batches were chunks of 3, 3, 3, 1 weighted alike (a biased gradient, silently); in 6,
    five chunks, and the error named a missing arm()."""
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, torch.device("cpu"))
    fill(storage, 0, model)
    batch = {k: v[:10] for k, v in storage.split(storage.data.flatten(0, 1)).items()}
    for q in (4, 6):
        with pytest.raises(ValueError, match=rf"^a minibatch of 10 transitions does not split into {q} equal "
                                             r"micro-batches \(--ppo.num-micro-batches\)$"):
            backward_minibatch(model, batch, GradSync(model.parameters(), num_extras=2),
                               ppo_cfg(num_micro_batches=q))


class CheckpointedHead(nn.Module):
    """A trunk, then a head run under reentrant torch.utils.checkpoint: its backward is a nested graph task."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.head, self.trunk(x), use_reentrant=True).square().sum()


def checkpointed_body(rank, world_size, unused):
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))
    model = CheckpointedHead()
    sync = GradSync(model.parameters(), "bucketed", bucket_mb=1e-6, unused=unused)   # a bucket per parameter
    sync.zero_grad()
    sync.arm()
    model(x).backward()
    sync.synchronize()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("unused", ["error", "zero"])
def test_reentrant_checkpointing_gives_every_bucket_its_whole_gradient(unused):
    """A bucket launches only once its gradients are whole, also when the head's backward is a nested graph task
    (reentrant checkpointing runs the head's hooks before the trunk's): the mean over ranks of plain autograd's
    gradients is the oracle."""
    expected = []
    for rank in range(2):
        model = CheckpointedHead()
        model(torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))).backward()
        expected.append([p.grad for p in model.parameters()])
    mean = [(a + b) / 2 for a, b in zip(*expected)]
    for grads in run_ranks(checkpointed_body, 2, args=(unused,)):
        for got, want in zip(grads, mean):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("strides", [(4, 4, 1), (4, 100, 1)])
def test_a_parameter_with_a_size_1_dimension_is_dense_whatever_that_dimension_s_stride(strides):
    """A size-1 dimension's stride never addresses a second element: a contiguous [3, 1, 4] parameter (strides
    (4, 4, 1)) and one with any stride there fill 12 consecutive slots, so GradSync takes them, and their
    gradient is autograd's."""
    p = torch.nn.Parameter(torch.empty_strided((3, 1, 4), strides).copy_(torch.randn(3, 1, 4)))
    w = torch.randn(3, 1, 4)
    sync = GradSync([p])
    sync.zero_grad()
    sync.arm()
    (p * w).sum().backward()
    sync.synchronize()
    assert p.grad.stride() == strides
    torch.testing.assert_close(p.grad, w)
