"""What must not pile up in a long-lived process: a run, a model or a GradSync that is done with is freed, weights and
gradient buckets included, however many come and go (a sweep calling train.main, a bench, this suite); and a run
holds no more after many iterations than after a few."""

import gc
import os
import threading
import weakref

import pytest
import torch
from torch import nn

import train
from dist import comm
from dist.grad_sync import GradSync
from ppo.logger import RunLogger
from tests.test_train import small_tracking


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def step(model, sync):
    """One synchronized step's gradients (one process: the all-reduce is a no-op)."""
    sync.zero_grad()
    sync.arm()
    model(torch.ones(4, 6)).sum().backward()
    sync.synchronize()


def post_accumulate_hooks(p: torch.Tensor) -> int:
    return len(p._post_accumulate_grad_hooks or {})


@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_a_grad_sync_dropped_with_its_model_is_freed_weights_and_buckets_too(mode):
    model = net()
    sync = GradSync(model.parameters(), mode, bucket_mb=1e-4)
    step(model, sync)
    assert len(sync.buckets) == (1 if mode == "flat" else 4)     # bucketed: the 105-byte cap, a bucket per tensor
    gone = [weakref.ref(o) for o in (sync, model, *model.parameters(), *(b.buffer for b in sync.buckets))]
    del model, sync
    gc.collect()
    assert [r() is None for r in gone] == [True] * len(gone)


def test_grad_syncs_made_and_dropped_over_a_live_model_leave_no_hooks_behind_and_the_next_one_works():
    model = net()
    for _ in range(5):
        step(model, GradSync(model.parameters(), "bucketed", bucket_mb=1e-4))
        gc.collect()
    # each dropped GradSync took its hooks with it: none are left (before, each stayed alive and saw every backward)
    assert [post_accumulate_hooks(p) for p in model.parameters()] == [0] * 4
    sync = GradSync(model.parameters(), "flat")
    assert [post_accumulate_hooks(p) for p in model.parameters()] == [1] * 4
    step(model, sync)
    # d(sum over 4 rows of W x + b)/dW2 = 4 * tanh(W1 x + b1) per output row (x = ones), computed independently
    hidden = torch.tanh(model[0](torch.ones(1, 6))).detach()
    assert torch.allclose(model[2].weight.grad, 4 * hidden.expand(3, 16))
    assert torch.equal(model[2].bias.grad, torch.full((3,), 4.0))


def test_a_grad_sync_held_by_its_owner_keeps_its_hooks_while_the_model_lives():
    """Weak hooks, not lost ones: a GradSync still in use serves every backward, bucket by bucket."""
    model = net()
    sync = GradSync(model.parameters(), "bucketed", bucket_mb=1e-4)
    gc.collect()
    sync.zero_grad()
    sync.arm()
    model(torch.ones(4, 6)).sum().backward()
    assert [b.pending for b in sync.buckets] == [0] * 4        # the hooks counted every gradient in
    assert sync._next_launch == 4                               # and launched every bucket's all-reduce
    sync.synchronize()
    assert torch.equal(model[2].bias.grad, torch.full((3,), 4.0))


def test_train_main_called_again_and_again_in_one_process_keeps_no_model_of_a_finished_run(tmp_path):
    """A sweep of runs in one process: each run's model (weights and gradient buckets) goes once the caller drops
    what main returned. Before, every run's GradSync and parameters lived as long as the process."""
    gone = []
    for i in range(3):
        model, scalars, _ = train.main(small_tracking(tmp_path / str(i), iterations=1))
        assert scalars and all(p.grad is not None for p in model.parameters())   # it trained
        gone += [weakref.ref(model), *(weakref.ref(p) for p in model.parameters())]
        del model
        gc.collect()
    assert [r() is None for r in gone] == [True] * len(gone)


def live_state() -> dict:
    """What a process holds that could pile up: tensors (and their bytes), tensors still in an autograd graph,
    threads, open files, ledger purposes."""
    gc.collect()
    # type(o), not isinstance: isinstance reads __class__, which warns on torch's lazy deprecated attributes
    tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors),
            "in a graph": sum(t.grad_fn is not None for t in tensors), "threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")), "purposes": len(comm.LEDGER)}


@pytest.mark.slow      # 45 iterations: 4-9 s
def test_a_long_run_holds_as_much_after_many_iterations_as_after_a_few(tmp_path, monkeypatch):
    """Per-iteration state (episode returns, normalizer batches, ledger entries, losses kept with their graphs,
    writer threads, files) is replaced, not accumulated: researchers run tens of thousands of iterations. Every
    per-iteration feature on (returns, reward normalization, verification); saves only at the end, so what the
    first save caches (RNG layouts, checksum tables) is not counted as growth."""
    cfg = small_tracking(tmp_path, iterations=45)
    cfg.log.save_every, cfg.log.episode_returns, cfg.ppo.normalize_rewards = 1000, True, True
    cfg.dist.verify_every = cfg.dist.sampler_sync_every = 1
    seen, log = {}, RunLogger.log

    def logged(self, scalars, step, returns=()):
        log(self, scalars, step, returns)
        if step in (15, 45):
            seen[step] = live_state()
    monkeypatch.setattr(RunLogger, "log", logged)
    train.main(cfg)
    assert seen[15]["in a graph"] == 0
    assert seen[45] == seen[15]
