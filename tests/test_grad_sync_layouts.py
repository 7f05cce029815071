"""GradSync against plain autograd where the layout or the order of calls is unusual: a transposed parameter, a
parameter with gaps, overlaps or a size-1 dimension of any stride (refused whole, or taken in any dimension order),
a collective between the armed backward and synchronize(), and a minibatch that does not split into equal
micro-batches; which buckets launch from backward and which at synchronize(); and the whole messages of its
refusals (a parameter taken over or no longer served, a replaced .grad, a missing gradient, a second armed
backward)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist import comm
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


REFUSED = ("a view with gaps or overlaps: its gradient cannot be a slice of a bucket; make it a parameter of its own "
           "(.contiguous())")


@pytest.mark.parametrize("make, shape, strides", [
    (lambda: torch.randn(3).expand(4, 3), (4, 3), (0, 1)),       # every row the same 3 floats: overlaps
    (lambda: torch.randn(2, 6)[:, :3], (2, 3), (6, 1)),          # a gap after each row of a 2-row dimension
    (lambda: torch.randn(4)[::2], (2,), (2,)),                   # every other float of 4
])
def test_a_parameter_with_overlaps_or_a_gap_in_a_size_2_dimension_is_refused_whole_message(make, shape, strides):
    """A view whose elements overlap (stride 0) or skip slots in a dimension of size 2 is no slice of a bucket: it is
    refused naming its index, shape and strides and the fix (.contiguous()), not given a gradient laid out wrong.
    Mutant: `stride > expected` (overlaps taken); `size > 2` instead of `size != 1`; the message without
    (.contiguous())."""
    p = nn.Parameter(make())
    assert p.stride() == strides
    with pytest.raises(ValueError) as exc:
        GradSync([p])
    assert str(exc.value) == f"parameter #0 of shape {shape} has strides {strides}, {REFUSED}"


@pytest.mark.parametrize("make", [lambda: torch.randn(2, 3, 4), lambda: torch.randn(4, 3, 2).permute(2, 1, 0)])
def test_a_dense_3_d_parameter_in_any_dimension_order_is_taken_with_autograd_s_gradient(make):
    """A [2, 3, 4] parameter, contiguous (strides (12, 4, 1)) or permuted (strides (1, 2, 6)), fills 24 consecutive
    slots: GradSync takes it, its gradient keeps its strides and equals plain autograd's (the weights w).
    Mutant: `expected = size` instead of `expected *= size` in _dense (a third dimension refused)."""
    p = nn.Parameter(make())
    w = torch.randn(2, 3, 4)
    sync = GradSync([p])
    sync.zero_grad()
    sync.arm()
    (p * w).sum().backward()
    sync.synchronize()
    assert p.grad.stride() == p.stride()
    assert torch.equal(p.grad, w)


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


def record_all_reduce_phases(monkeypatch) -> tuple[list, list]:
    """Replace comm.all_reduce (one process issues no collective) by one that appends the phase it is called in,
    phase[0] ("backward" until the test sets it), to calls; returns (phase, calls)."""
    phase, calls = ["backward"], []

    class Done:
        def wait(self):
            pass

    def recorded(tensor, purpose, async_op=False):
        calls.append(phase[0])
        return Done()
    monkeypatch.setattr(comm, "all_reduce", recorded)
    return phase, calls


@pytest.mark.parametrize("mode, unused, launched", [
    ("bucketed", "error", ["backward", "backward"]),          # overlapping backward, one bucket per layer
    ("bucketed", "zero", ["synchronize", "synchronize"]),    # all at synchronize(): a parameter may be unused somewhere
    ("flat", "error", ["synchronize"]),                      # the one bucket, after backward
])
def test_which_buckets_launch_during_backward_and_which_at_synchronize(monkeypatch, mode, unused, launched):
    """Bucketed with unused="error" each bucket's all-reduce is launched from the backward that completes it (the
    overlap bucketing exists for); with unused="zero" and flat, every all-reduce is issued by synchronize(). One
    process issues no collective, so comm.all_reduce is replaced by one that records the phase it was called in.
    Mutant: the launch gate without `self.unused == "error"`, with "zero" for "error", or `mode == "bucketed" or
    unused == "error"` (flat launching from backward)."""
    phase, calls = record_all_reduce_phases(monkeypatch)
    first, head = two_layers()
    sync = GradSync([first.weight, head.weight], mode, bucket_mb=1e-6, unused=unused)   # bucketed: a bucket each
    sync.zero_grad()
    sync.arm()
    head(first(torch.ones(2, 3))).sum().backward()
    phase[0] = "synchronize"
    sync.synchronize()
    assert calls == launched


def test_a_parameter_used_only_before_the_armed_micro_batch_holds_its_bucket_and_the_later_ones_to_synchronize(
        monkeypatch):
    """Bucketed, unused="error", two micro-batches: the head is used in the first only. Its bucket (launched first:
    reverse order) never completes in the armed backward, so it and the first layer's bucket behind it launch at
    synchronize() (the module docstring's warning about a collective issued in between); the gradients are still
    the sum over both micro-batches.
    Mutant: arm() counting parameters that already have a gradient as arrived (`b.pending = sum(id(q) not in
    self._received for q in b.params)`): the buckets launch during backward, before the armed gradients are in."""
    phase, calls = record_all_reduce_phases(monkeypatch)
    first, head = two_layers()
    sync = GradSync([first.weight, head.weight], "bucketed", bucket_mb=1e-6)   # a bucket each, the head's first
    x = torch.ones(2, 3)
    sync.zero_grad()
    head(first(x)).sum().backward()
    sync.arm()
    first(x).square().sum().backward()
    phase[0] = "synchronize"
    sync.synchronize()
    assert calls == ["synchronize", "synchronize"]
    expected = torch.autograd.grad(head(first(x)).sum() + first(x).square().sum(), [first.weight, head.weight])
    torch.testing.assert_close(first.weight.grad, expected[0])
    torch.testing.assert_close(head.weight.grad, expected[1])


NOT_SERVED = ("is no longer served by this GradSync: one built over it later took it over (its gradient view and "
              "hooks), or remove_hooks() ran; build one GradSync over all the parameters (actor and critic with their "
              "shared trunk together)")


def armed_two_layers(unused="zero"):
    """(GradSync over both weights of two_layers(), first layer, head), after zero_grad() and arm()."""
    first, head = two_layers()
    sync = GradSync([first.weight, head.weight], unused=unused)
    sync.zero_grad()
    sync.arm()
    return sync, first, head


def test_synchronize_after_a_takeover_of_parameter_0_names_it_and_the_fix():
    """A second GradSync over the first weight only takes it over (and drops the first GradSync's hooks): the first's
    synchronize() names parameter #0, what happened and the fix.
    Mutant: the index off by one; the check skipping parameter #0; the message without the fix."""
    sync, first, _ = armed_two_layers()
    successor = GradSync([first.weight])     # kept: a freed one would serve nothing
    with pytest.raises(RuntimeError) as exc:
        sync.synchronize()
    assert str(exc.value) == f"parameter #0 {NOT_SERVED}"
    assert successor.params == [first.weight]


def test_synchronize_after_remove_hooks_is_refused_although_the_gradient_views_are_intact():
    """remove_hooks() leaves the .grad views in place but no longer serves the parameters (a later backward would not
    be counted): synchronize() after it refuses by name rather than average what happens to be in the buckets.
    Mutant: `_served_by(p) is not None and _served_by(p) is not self` (a parameter served by nobody passes)."""
    sync, first, head = armed_two_layers()
    head(first(torch.ones(2, 3))).sum().backward()
    sync.remove_hooks()
    with pytest.raises(RuntimeError) as exc:
        sync.synchronize()
    assert str(exc.value) == f"parameter #0 {NOT_SERVED}"


def test_a_grad_replaced_after_the_armed_backward_is_refused_naming_every_cause():
    """A .grad that is no longer the bucket view (here set to None, as optimizer.zero_grad() does; casting the model
    or create_graph=True replace it too) is refused naming the parameter and all three causes.
    Mutant: the message without "build the GradSync after casting or moving the model ... create_graph=True"."""
    sync, first, head = armed_two_layers()
    head(first(torch.ones(2, 3))).sum().backward()
    head.weight.grad = None
    with pytest.raises(RuntimeError) as exc:
        sync.synchronize()
    assert str(exc.value) == ("parameter #1's .grad is no longer a view into its gradient bucket, so it would not be "
                              "synchronized: zero gradients with sync.zero_grad(), never with optimizer.zero_grad() or "
                              "model.zero_grad() (they set grads to None); build the GradSync after casting or moving "
                              "the model, and do not backward with create_graph=True (both replace the grads)")


def test_a_missing_gradient_names_a_replaced_parameter_as_a_cause():
    """A parameter with no gradient: the error names it, both fixes, and the third cause (a parameter replaced after
    the GradSync was built, which then never gets a hook call).
    Mutant: the message without "(or they were replaced ... build it again)"."""
    sync, first, _ = armed_two_layers(unused="error")
    first(torch.ones(2, 3)).sum().backward()
    with pytest.raises(RuntimeError) as exc:
        sync.synchronize()
    assert str(exc.value) == ("1 parameter(s) received no gradient this step (#1 of shape (3, 3)); fix the loss, or "
                              "average them as zero gradients: GradSync(..., unused=\"zero\"), --dist.unused-params "
                              "zero in train.py (or they were replaced after the GradSync was built, e.g. "
                              "load_state_dict(assign=True): build it again)")


def test_a_second_armed_backward_names_reentrant_checkpointing_as_a_cause():
    """Two gradients for one parameter after arm(): the error says one backward was declared, and that a parameter
    used inside and outside a reentrant checkpoint gets two as well.
    Mutant: the message without the reentrant-checkpoint cause."""
    sync, first, head = armed_two_layers()
    head(first(torch.ones(2, 3))).sum().backward()
    with pytest.raises(RuntimeError) as exc:
        head(first(torch.ones(2, 3))).sum().backward()
    assert str(exc.value) == ("a second backward after arm(): arm() declares that exactly one more backward (the "
                              "minibatch's last micro-batch) follows before synchronize() (a parameter used inside "
                              "and outside a reentrant torch.utils.checkpoint also gets two)")
