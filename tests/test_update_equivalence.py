"""Equivalence principle: W ranks with N envs each train exactly like one process with W*N envs."""

import pytest
import torch

from dist.grad_sync import GradSync
from ppo.storage import RolloutStorage
from ppo.update import ppo_update
from tests.multirank import run_ranks
from tests.ppo_fixtures import A, N, OBS, T, ConcatStorage, fill, make_model, ppo_cfg


def distributed_update(rank, world_size, cfg_overrides, num_micro_batches=1, mode="flat"):
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, torch.device("cpu"))
    fill(storage, rank, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sync = GradSync(model.parameters(), mode, bucket_mb=0.001, num_extras=2)
    cfg = ppo_cfg(num_micro_batches=num_micro_batches, **cfg_overrides)
    stats = ppo_update(model, optimizer, storage, sync, cfg, generator=torch.Generator().manual_seed(7 + rank))
    return {k: v.clone() for k, v in model.state_dict().items()}, stats


def single_process_update(world_size, cfg_overrides):
    model = make_model()
    storage = ConcatStorage(world_size, seeds=[7 + r for r in range(world_size)])
    for r in range(world_size):
        fill(storage, r, model, env_offset=r * N)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sync = GradSync(list(model.parameters()), num_extras=2)
    stats = ppo_update(model, optimizer, storage, sync, ppo_cfg(**cfg_overrides))
    return model.state_dict(), stats


@pytest.mark.slow
@pytest.mark.parametrize("world_size, micro, mode", [(2, 1, "flat"), (2, 4, "bucketed"), (3, 2, "flat")])
def test_whole_ppo_update_on_w_ranks_equals_one_process_on_concatenated_data(world_size, micro, mode):
    """E epochs x M minibatches, adaptive KL, global advantage normalization, normalizer merge, clipping."""
    results = run_ranks(distributed_update, world_size, args=({}, micro, mode))
    ref_state, ref_stats = single_process_update(world_size, {})
    for state, stats in results:
        for key, ref in ref_state.items():
            torch.testing.assert_close(state[key], ref, rtol=1e-4, atol=1e-5, msg=f"{key} differs")
        assert stats["learning_rate"] == pytest.approx(ref_stats["learning_rate"], rel=1e-6)
        assert stats["kl"] == pytest.approx(ref_stats["kl"], rel=1e-3)
    # The normalizer merged this iteration's critic observations of every rank.
    assert results[0][0]["critic_normalizer.count"].item() == world_size * N * T
    for state, _ in results[1:]:     # ranks agree bit for bit: they applied identical synchronized steps
        for key in state:
            assert torch.equal(state[key], results[0][0][key]), key


@pytest.mark.slow
@pytest.mark.parametrize("world_size, micro, mode", [(2, 2, "bucketed"), (3, 1, "flat")])
def test_minibatches_of_transitions_on_w_ranks_equal_one_process_on_concatenated_data(world_size, micro, mode):
    """--ppo.minibatch-unit transition (the isaaclab preset's): each rank shuffles its own T * N transitions; one
    process over the union of each minibatch takes the same steps."""
    unit = {"minibatch_unit": "transition"}
    results = run_ranks(distributed_update, world_size, args=(unit, micro, mode))
    ref_state, ref_stats = single_process_update(world_size, unit)
    trajectory_state, _ = single_process_update(world_size, {})
    assert max((trajectory_state[k] - ref_state[k]).abs().max().item() for k in ref_state) > 1e-4   # not trivial
    for state, stats in results:
        for key, ref in ref_state.items():
            torch.testing.assert_close(state[key], ref, rtol=1e-4, atol=1e-5, msg=f"{key} differs")
        assert stats["learning_rate"] == pytest.approx(ref_stats["learning_rate"], rel=1e-6)
        assert stats["kl"] == pytest.approx(ref_stats["kl"], rel=1e-3)


@pytest.mark.slow
def test_local_advantage_normalization_differs_from_global():
    """Guards the test above against passing trivially: with per-rank normalization the result changes."""
    results = run_ranks(distributed_update, 2, args=({"advantage_norm": "local"}, 1))
    ref_state, _ = single_process_update(2, {})
    diffs = [(results[0][0][k] - ref_state[k]).abs().max().item() for k in ref_state if k.startswith("actor.")]
    assert max(diffs) > 1e-4
