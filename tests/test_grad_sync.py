"""GradSync (flat and bucketed) against one process over the concatenated batch and against torch DDP."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

from dist.grad_sync import GradSync
from tests.multirank import run_ranks

B = 12   # samples per rank


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
        self.unused = nn.Linear(4, 4)        # never in the forward: gets no gradient

    def forward(self, x):
        return self.body(x)


def data(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(B, 6, generator=g), torch.randn(B, 3, generator=g)


def loss_fn(net, x, y):
    return (net(x) - y).square().mean()


def sync_grads(rank, world_size, mode, num_micro_batches, bucket_mb, count=1.0):
    net = Net()
    sync = GradSync(net.parameters(), mode, bucket_mb=bucket_mb, num_extras=2, unused="zero")
    x, y = data(rank)
    sync.zero_grad()
    for i, (xm, ym) in enumerate(zip(x.chunk(num_micro_batches), y.chunk(num_micro_batches))):
        if i == num_micro_batches - 1:
            sync.arm(torch.tensor([float(rank), count]))
        (loss_fn(net, xm, ym) / num_micro_batches).backward()
    extras = sync.synchronize()
    works_left = sum(b.work is not None for b in sync.buckets)   # a work kept past its wait can abort the exit
    grads = [p.grad.clone() for p in net.parameters()]
    norm = sync.clip_(0.05)
    clipped = [p.grad.clone() for p in net.parameters()]
    return {"grads": grads, "clipped": clipped, "norm": norm, "extras": extras, "buckets": len(sync.buckets),
            "works_left": works_left}


def ddp_grads(rank, world_size):
    net = Net()
    ddp = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    x, y = data(rank)
    loss_fn(ddp, x, y).backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in net.parameters()]


def single_process_grads(world_size):
    net = Net()
    xs, ys = zip(*(data(r) for r in range(world_size)))
    loss_fn(net, torch.cat(xs), torch.cat(ys)).backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in net.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_grads_equal_single_process_and_ddp(mode, world_size):
    # 0.01 MB buckets: several buckets, and the 64x64 weight (16 KB) is larger than a bucket.
    results = run_ranks(sync_grads, world_size, args=(mode, 1, 0.01))
    reference = single_process_grads(world_size)
    ddp = run_ranks(ddp_grads, world_size)[0]
    if mode == "bucketed":
        assert results[0]["buckets"] == 3      # [head + unused], [64x64 weight: 16 KB > the 10 KB cap], [first layer]
    for res in results:
        for g, ref, oracle in zip(res["grads"], reference, ddp):
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(g, oracle, rtol=1e-5, atol=1e-7)
        # extras are summed, not averaged: sum of ranks, and one count per rank
        assert res["extras"].tolist() == [float(sum(range(world_size))), float(world_size)]
        assert res["works_left"] == 0     # synchronize() drops every finished all-reduce's work
        for g, other in zip(res["grads"], results[0]["grads"]):
            assert torch.equal(g, other), "every rank must hold bit-identical gradients"
    assert results[0]["grads"][-1].abs().sum() == 0 and results[0]["grads"][-2].abs().sum() == 0   # unused = zero


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_micro_batches_give_the_same_synchronized_and_clipped_gradient(mode):
    one = run_ranks(sync_grads, 2, args=(mode, 1, 0.01))
    four = run_ranks(sync_grads, 2, args=(mode, 4, 0.01))
    for a, b in zip(one, four):
        for key in ("grads", "clipped"):
            for x, y in zip(a[key], b[key]):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(a["norm"], b["norm"])
        assert a["norm"] > 0.05       # the clip really scaled the step
    clipped_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in one[0]["clipped"]]))
    assert clipped_norm.item() == pytest.approx(0.05, rel=1e-4)


def sync_grads_under_nccl(rank, world_size, mode):
    """sync_grads with the backend saying nccl, its AVG done as NCCL does it for floats (each rank's input
    multiplied by 1/W rounded to float32, then summed; NCCL's ncclDevPreMulSum), and 7 samples counted per rank;
    returns the same dict, plus how many all-reduces asked for AVG."""
    import torch.distributed as torch_dist
    real, averaged = torch_dist.all_reduce, []

    def all_reduce(tensor, op=torch_dist.ReduceOp.SUM, group=None, async_op=False):
        if op == torch_dist.ReduceOp.AVG:
            averaged.append(tensor.numel())
            tensor.mul_(torch.tensor(1.0 / world_size, dtype=tensor.dtype))
            op = torch_dist.ReduceOp.SUM
        return real(tensor, op=op, group=group, async_op=async_op)

    torch_dist.all_reduce, torch_dist.get_backend = all_reduce, lambda group=None: "nccl"
    return {**sync_grads(rank, world_size, mode, 2, 0.01, 7.0), "averaged": len(averaged)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_under_nccl_the_gradients_are_summed_then_divided_and_the_extras_stay_exact(mode):
    """NCCL's AVG rounds each rank's share before summing: at 3 ranks a count of 7 per rank came back 21.000002
    and the gradients differed from gloo's in the last bits. GradSync sums on every backend and divides, so the
    NCCL run gives the gloo run's numbers bit for bit (no GPU here: NCCL's arithmetic emulated on gloo)."""
    gloo = run_ranks(sync_grads, 3, args=(mode, 2, 0.01, 7.0))
    nccl = run_ranks(sync_grads_under_nccl, 3, args=(mode,))
    for ours, theirs in zip(nccl, gloo):
        assert ours["extras"].tolist() == [0.0 + 1.0 + 2.0, 21.0]   # summed: ranks 0 + 1 + 2, and 3 x 7 samples
        for key in ("grads", "clipped"):
            assert all(torch.equal(x, y) for x, y in zip(ours[key], theirs[key])), key
        assert torch.equal(ours["norm"], theirs["norm"])
        assert ours["averaged"] == 0


def test_missing_gradient_is_an_error_naming_the_parameter():
    net = Net()
    sync = GradSync(net.parameters(), "flat")
    sync.zero_grad()
    sync.arm()
    loss_fn(net, *data(0)).backward()
    with pytest.raises(RuntimeError, match=r"2 parameter\(s\) received no gradient.*unused=\"zero\"\), "
                                           r"--dist.unused-params zero"):
        sync.synchronize()


def test_a_single_parameter_without_gradient_is_an_error_too():
    """One missing gradient is enough (e.g. a log-std the loss forgot): #2, a 0-dim scale never in the forward."""
    lin, scale = nn.Linear(3, 1), nn.Parameter(torch.ones(()))
    sync = GradSync([*lin.parameters(), scale], "flat")
    sync.zero_grad()
    sync.arm()
    lin(torch.ones(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"^1 parameter\(s\) received no gradient this step \(#2 of shape \(\)\)"):
        sync.synchronize()


@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_a_parameter_used_in_an_earlier_step_but_not_this_one_is_missing(mode):
    """unused="error" asks about THIS step: a head that got a gradient in the previous step but none now must
    still be named, not counted as received from before the zero_grad()."""
    torch.manual_seed(0)
    trunk, head_a, head_b = nn.Linear(3, 4), nn.Linear(4, 1), nn.Linear(4, 1)
    sync = GradSync([*trunk.parameters(), *head_a.parameters(), *head_b.parameters()], mode, bucket_mb=1e-4)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    sync.zero_grad()
    sync.arm()
    (head_a(trunk(x)) + head_b(trunk(x))).square().mean().backward()     # step 1: every parameter used
    sync.synchronize()
    sync.zero_grad()
    sync.arm()
    head_a(trunk(x)).square().mean().backward()                           # step 2: head b unused
    with pytest.raises(RuntimeError, match=r"2 parameter\(s\) received no gradient this step \(#4 of shape \(1, 4\), "
                                           r"#5 of shape \(1,\)\)"):
        sync.synchronize()


def test_bad_arguments_are_rejected():
    net = Net()
    with pytest.raises(ValueError, match="--dist.grad-sync"):
        GradSync(net.parameters(), "ring")
    with pytest.raises(ValueError, match="--dist.bucket-mb"):
        GradSync(net.parameters(), "bucketed", bucket_mb=0)
    sync = GradSync(net.parameters(), "flat", num_extras=2)
    with pytest.raises(ValueError, match="2 extra scalars"):
        sync.arm(torch.zeros(3))
    with pytest.raises(RuntimeError, match="arm"):
        GradSync(net.parameters()).synchronize()
    net.requires_grad_(False)                      # every parameter frozen: nothing to synchronize, said so
    with pytest.raises(ValueError, match="at least one parameter that requires grad"):
        GradSync(net.parameters())


def test_grads_detached_from_the_buckets_are_an_error_not_a_silent_local_step():
    net = Net()
    sync = GradSync(net.parameters(), "flat", unused="zero")
    torch.optim.Adam(net.parameters()).zero_grad()          # set_to_none: autograd allocates fresh grads
    sync.arm()
    loss_fn(net, *data(0)).backward()
    with pytest.raises(RuntimeError, match="sync.zero_grad"):
        sync.synchronize()


def test_grads_stay_views_into_the_buckets_across_steps():
    net = Net()
    sync = GradSync(net.parameters(), "bucketed", bucket_mb=0.01, unused="zero")
    opt = torch.optim.Adam(net.parameters())
    for _ in range(3):
        sync.zero_grad()
        sync.arm()
        loss_fn(net, *data(0)).backward()
        sync.synchronize()
        opt.step()
    for bucket in sync.buckets:
        for p in bucket.params:
            assert p.grad.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_a_second_backward_after_arm_is_an_error(mode):
    net = Net()
    sync = GradSync(net.body.parameters(), mode, bucket_mb=0.001)
    sync.zero_grad()
    x, y = data(0)
    loss_fn(net, x, y).backward()              # accumulating before arm() is what micro-batches do: fine
    sync.arm()
    loss_fn(net, x, y).backward()
    with pytest.raises(RuntimeError, match=r"a second backward after arm\(\)"):
        loss_fn(net, x, y).backward()


def test_a_new_grad_sync_takes_the_parameters_over_and_the_old_one_is_freed():
    import gc
    import weakref
    net = Net()
    old = GradSync(net.parameters(), "flat", unused="zero")
    gone = weakref.ref(old)
    new = GradSync(net.parameters(), "bucketed", bucket_mb=0.001, unused="zero")
    assert not old._hooks and len(new._hooks) == len(new.params)
    del old
    gc.collect()
    assert gone() is None          # no hook keeps it (and its gradient buckets) alive
    new.zero_grad()
    new.arm()
    loss_fn(net, *data(0)).backward()
    new.synchronize()
    expected = torch.autograd.grad(loss_fn(net, *data(0)), list(net.parameters()), allow_unused=True)
    assert all(torch.equal(p.grad, torch.zeros_like(p) if g is None else g) for p, g in zip(net.parameters(), expected))
    new.remove_hooks()               # explicitly, with no successor: freed as well
    gone = weakref.ref(new)
    del new
    gc.collect()
    assert gone() is None


def test_a_stale_remove_hooks_leaves_the_successor_s_parameters_to_it():
    """remove_hooks() on a GradSync already taken over (a second call, from cleanup code) must not forget who serves
    the parameters now: the next GradSync still takes them over from the successor, whose hooks then go and which
    is freed (else its hooks would keep it and its buckets alive, and it would see every later backward)."""
    import gc
    import weakref
    net = Net()
    first = GradSync(net.parameters(), "flat", unused="zero")
    second = GradSync(net.parameters(), "flat", unused="zero")
    first.remove_hooks()
    third = GradSync(net.parameters(), "bucketed", bucket_mb=0.001, unused="zero")
    assert not second._hooks and len(third._hooks) == len(third.params)
    gone = weakref.ref(second)
    del second
    gc.collect()
    assert gone() is None


def test_grad_sync_can_be_copied_into_another_package(tmp_path):
    """README's promise: dist/grad_sync.py with dist/comm.py and dist/plan.py work under any package name."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    package = tmp_path / "myproject" / "parallel"
    package.mkdir(parents=True)
    (tmp_path / "myproject" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    for name in ("grad_sync.py", "comm.py", "plan.py"):
        shutil.copy(os.path.join(repo, "dist", name), package / name)
    script = ("import torch\nfrom myproject.parallel.grad_sync import GradSync\n"
              "model = torch.nn.Linear(3, 2)\nsync = GradSync(model.parameters(), mode='bucketed', bucket_mb=1)\n"
              "sync.zero_grad(); sync.arm(); model(torch.ones(4, 3)).sum().backward(); sync.synchronize()\n"
              "print(model.weight.grad.tolist())\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str([[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]])   # d(sum(W x + b))/dW = sum of x: 4


@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_the_extras_synchronize_returns_are_the_caller_s_a_later_step_leaves_them_alone(mode):
    """synchronize() returns the extras as a tensor of the caller's own: the bucket's extras slot is staged again
    by the next arm(), and a caller keeping a step's KL sum and count past it must not see them turn into the next
    step's (ppo/minibatch_step.py reads them within the step; the contract is GradSync's own)."""
    net = Net()
    sync = GradSync(net.parameters(), mode, bucket_mb=0.001, num_extras=2, unused="zero")
    x, y = data(0)
    returned = []
    for staged in ([3.0, 7.0], [-1.0, 5.0]):
        sync.zero_grad()
        sync.arm(torch.tensor(staged))
        loss_fn(net, x, y).backward()
        returned.append(sync.synchronize())
    assert [r.tolist() for r in returned] == [[3.0, 7.0], [-1.0, 5.0]]


def test_arm_again_before_the_armed_backward_restages_the_extras():
    """arm() raises only once the armed backward ran (its all-reduces may be in flight); before that it may be
    called again and the last extras staged win. One process: the synchronized gradient is the plain backward's
    (the unused layer's a zero) and the extras come back as staged."""
    net, reference = Net(), Net()
    sync = GradSync(net.parameters(), "bucketed", bucket_mb=0.01, num_extras=2, unused="zero")
    x, y = data(0)
    sync.zero_grad()
    sync.arm(torch.tensor([1.0, 2.0]))
    sync.arm(torch.tensor([3.0, 4.0]))
    loss_fn(net, x, y).backward()
    assert sync.synchronize().tolist() == [3.0, 4.0]
    loss_fn(reference, x, y).backward()
    for p, ref in zip(net.parameters(), reference.parameters()):
        assert torch.equal(p.grad, ref.grad if ref.grad is not None else torch.zeros_like(p))


def test_extras_that_still_require_grad_leave_no_autograd_history_in_the_buckets():
    """A KL sum computed outside no_grad, staged by arm(), must be copied as a value: copied with its history the
    bucket (so every .grad view) would join the graph, keep each step's forward alive and hand back extras that
    require grad."""
    net = Net()
    sync = GradSync(net.parameters(), "flat", num_extras=2, unused="zero")
    x, y = data(0)
    sync.zero_grad()
    kl = net(x).sum()                          # requires grad
    sync.arm(torch.stack([kl, kl.new_tensor(12.0)]))
    loss_fn(net, x, y).backward()
    extras = sync.synchronize()
    assert extras.tolist() == [kl.item(), 12.0] and not extras.requires_grad
    assert all(not p.grad.requires_grad and p.grad.grad_fn is None for p in net.parameters())


@pytest.mark.parametrize("zero", ["none", "optimizer"])
def test_a_backward_after_synchronize_before_zero_grad_is_an_error(zero):
    """A backward between synchronize() and the next sync.zero_grad() (an auxiliary loss before optimizer.step(), or
    zeroing with optimizer.zero_grad(set_to_none=False), which keeps the views) would add a gradient on its rank
    only: the ranks would step to different weights. It raises; after sync.zero_grad() the next step runs."""
    net = Net()
    sync = GradSync(net.parameters(), "flat", unused="zero")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sync.zero_grad()
    sync.arm()
    loss_fn(net, *data(0)).backward()
    sync.synchronize()
    if zero == "optimizer":
        opt.zero_grad(set_to_none=False)
    with pytest.raises(RuntimeError, match=r"a backward after synchronize\(\) and before sync.zero_grad\(\)"):
        loss_fn(net, *data(1)).backward()
    sync.zero_grad()
    sync.arm()
    loss_fn(net, *data(1)).backward()
    sync.synchronize()
    expected = torch.autograd.grad(loss_fn(net, *data(1)), list(net.parameters()), allow_unused=True)
    assert all(torch.equal(p.grad, torch.zeros_like(p) if g is None else g) for p, g in zip(net.parameters(), expected))


def test_synchronize_of_a_grad_sync_taken_over_names_the_takeover():
    """Two GradSyncs over a shared trunk (one per optimizer): the second takes the trunk over, and the first's
    synchronize() says so, rather than blaming an optimizer.zero_grad() the user never called."""
    net = Net()
    first = GradSync(net.parameters(), "flat", unused="zero")
    second = GradSync(net.body.parameters(), "flat", unused="zero")
    for sync in (first, second):
        sync.zero_grad()
        sync.arm()
    loss_fn(net, *data(0)).backward()
    with pytest.raises(RuntimeError, match="no longer served by this GradSync: one built over it later took it over"):
        first.synchronize()


def test_parameters_on_two_devices_are_refused_by_name():
    """One bucket lives on one device: parameters on two are refused at construction with both devices named (a
    meta tensor stands in for a second device), not torch's error about assigning a gradient."""
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, device="meta"))]
    with pytest.raises(ValueError, match=r"one device, got \['cpu', 'meta'\]"):
        GradSync(params)
