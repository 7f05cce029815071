"""--ppo.capture-step on 2 gloo ranks: the step captured and replayed (tests/fake_cuda_graph.py) trains exactly as the
host path on each rank, flat and bucketed, with micro-batches, every advantage normalization and skipped steps. A
replay issues the step's all-reduces itself, so this is where a stand-in that did not wait for them raced: each rank
then stepped with a gradient half summed, the ranks apart."""

import contextlib
import glob
import os

import pytest
import torch

import train
from dist.grad_sync import GradSync
from ppo import minibatch_step
from ppo.storage import RolloutStorage
from ppo.update import ppo_update
from tests import fake_cuda_graph
from tests.multirank import run_ranks
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg
from tests.test_minibatch_step import run_update
from tests.test_train import small_tracking


def _updates(rank, world_size, capture, grad_sync, overrides, nan_env=None):
    """3 updates on this rank's fixed rollout; the sync-free step recorded after its warm-up (as on CUDA) and
    replayed. Crosses ranks: ppo_update's (the gradient all-reduces, the global advantage statistics)."""
    torch.cuda.CUDAGraph, torch.cuda.graph = fake_cuda_graph.CUDAGraph, fake_cuda_graph.graph
    torch.cuda.Stream = torch.cuda.current_stream = fake_cuda_graph.Stream
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, torch.device("cpu"))
    fill(storage, rank, model)
    if nan_env is not None and rank == 1:    # one rank's NaN: the synchronized norm makes both skip
        storage.returns[:, nan_env] = float("nan")
    cfg = ppo_cfg(capture_step=capture, **overrides)
    optimizer = minibatch_step.build_optimizer(model.parameters(), cfg, torch.device("cpu"))
    sync = GradSync(model.parameters(), grad_sync, bucket_mb=0.0005, num_extras=2)   # bucketed: several buckets
    if capture:
        minibatch_step.sync_free_step(model, optimizer, sync, cfg).capture = True
    advantages, returns = storage.advantages.clone(), storage.returns.clone()
    stats = []
    for it in range(3):
        storage.advantages, storage.returns = advantages, returns
        stats.append(ppo_update(model, optimizer, storage, sync, cfg, generator=torch.Generator().manual_seed(7 + it)))
    replays = optimizer.sync_free_step.graph.replays if capture else None
    return {k: v.clone() for k, v in model.state_dict().items()}, stats, len(sync.buckets), replays


@pytest.mark.slow
@pytest.mark.parametrize("grad_sync, overrides, nan_env", [
    ("flat", {}, None),
    ("bucketed", {"num_micro_batches": 2}, None),
    ("bucketed", {"advantage_norm": "local", "schedule": "fixed"}, 2),
    ("flat", {"advantage_norm": "minibatch", "minibatch_unit": "transition", "num_micro_batches": 2}, None),
    ("bucketed", {"advantage_norm": "none", "desired_kl": 1e-5}, None),
])
def test_two_ranks_captured_and_replayed_train_exactly_as_the_host_path(grad_sync, overrides, nan_env):
    host = run_ranks(_updates, 2, args=(False, grad_sync, overrides, nan_env))
    dev = run_ranks(_updates, 2, args=(True, grad_sync, overrides, nan_env))
    assert dev[0][2] == (1 if grad_sync == "flat" else 6)
    for (h_state, h_stats, _, _), (d_state, d_stats, _, replays) in zip(host, dev):
        for key in h_state:
            assert torch.equal(h_state[key], d_state[key]), key
        assert d_stats == h_stats
        assert replays == 3 * 3 * 2 - minibatch_step.CAPTURE_WARMUP_STEPS
    for key in dev[0][0]:
        assert torch.equal(dev[0][0][key], dev[1][0][key]), key
    assert [s["skipped_steps"] for s in dev[0][1]] == [3.0 if nan_env is not None else 0.0] * 3


def _train(rank, world_size, cfg):
    """train.main on this rank, the sync-free step (when configured) recorded and replayed.
    Crosses ranks: train.main's collectives."""
    torch.cuda.CUDAGraph, torch.cuda.graph = fake_cuda_graph.CUDAGraph, fake_cuda_graph.graph
    torch.cuda.Stream = torch.cuda.current_stream = fake_cuda_graph.Stream
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    built, steps = minibatch_step.SyncFreeStep.__init__, []

    def captured_on_cpu(self, *args, **kwargs):
        built(self, *args, **kwargs)
        self.capture = True
        steps.append(self)
    minibatch_step.SyncFreeStep.__init__ = captured_on_cpu
    cfg.dist.device = "cpu"
    model, scalars, _ = train.main(cfg)
    assert [s.graph.replays > 0 for s in steps] == ([True] if cfg.ppo.capture_step else [])
    return {k: v.clone() for k, v in model.state_dict().items()}, {k: v for k, v in scalars.items() if "Perf/" not in k}


def _cfg(root, capture, schedule, **overrides):
    cfg = small_tracking(root, iterations=4, **overrides)
    cfg.ppo.capture_step, cfg.ppo.schedule = capture, schedule
    cfg.dist.grad_sync, cfg.dist.bucket_mb = "bucketed", 0.004     # several buckets
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["adaptive", "linear"])
def test_two_ranks_train_main_captured_equals_the_host_path_and_a_checkpoint_resumes_in_either(tmp_path, schedule):
    """4 iterations of train.main on 2 ranks, bucketed, in each path; then each path's checkpoint at 2 resumed in the
    other, against the host path's own resume (the saved LR, Adam moments and step counts carry over alike)."""
    runs, ckpts = {}, {}
    for capture in (False, True):
        runs[capture] = run_ranks(_train, 2, args=(_cfg(tmp_path / str(capture), capture, schedule),))
        (ckpts[capture],) = glob.glob(os.path.join(tmp_path, str(capture), "tracking", "*", "model_2.pt"))
    for saved, resumed in ((False, False), (False, True), (True, False)):
        cfg = _cfg(tmp_path / f"{saved}{resumed}", resumed, schedule, resume=ckpts[saved])
        runs[saved, resumed] = run_ranks(_train, 2, args=(cfg,))
    for host, other in ((runs[False], runs[True]), (runs[False, False], runs[False, True]),
                        (runs[False, False], runs[True, False])):
        for (h_state, h_scalars), (d_state, d_scalars) in zip(host, other):
            for key in h_state:
                assert torch.equal(h_state[key], d_state[key]), key
            assert d_scalars == h_scalars


def test_a_step_that_replaced_its_lr_tensor_between_updates_is_refused_by_the_stand_in(monkeypatch):
    """The bug class a GPU's graph punishes and equal numbers hide: were begin() to make a new LR tensor each update
    instead of writing the one the graph steps with, the adaptive rule's recorded copy_ would keep the old tensor in
    step, so the stand-in's replays would match the host path bit for bit, while a GPU's replay would read and write
    the old tensor's freed memory. The stand-in holds memory by address, as a GPU's graph does, and raises."""
    fake_cuda_graph.install(monkeypatch)
    begin = minibatch_step.SyncFreeStep.begin

    def begin_with_a_new_lr_tensor(self):
        begin(self)
        self.opt_lr = minibatch_step.lr_tensor(float(self.lr), self.lr.device)
        self.optimizer.param_groups[0]["lr"] = self.opt_lr
    monkeypatch.setattr(minibatch_step.SyncFreeStep, "begin", begin_with_a_new_lr_tensor)
    with pytest.raises(RuntimeError, match="freed after capture"):
        run_update(True, iterations=2, graph=True)
