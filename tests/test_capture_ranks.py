"""--ppo.capture-step on 2 gloo ranks: the step captured and replayed (tests/fake_cuda_graph.py) trains exactly as the
host path on each rank, flat and bucketed, with micro-batches, every advantage normalization and skipped steps. A
replay issues the step's all-reduces itself, so this is where a stand-in that did not wait for them raced: each rank
then stepped with a gradient half summed, the ranks apart."""

import contextlib

import pytest
import torch

from dist.grad_sync import GradSync
from ppo import minibatch_step
from ppo.storage import RolloutStorage
from ppo.update import ppo_update
from tests import fake_cuda_graph
from tests.multirank import run_ranks
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg


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
