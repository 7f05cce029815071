"""The mujoco preset trained end to end through the gymnasium adapter, at 1 and 2 ranks."""

import glob
import os

import numpy as np
import pytest
import torch

import train
from configs import preset
from tests.multirank import run_ranks


def small_hopper(root, iterations=3):
    cfg = preset("mujoco")
    cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.max_iterations = 64, 4, iterations
    cfg.log.root, cfg.log.print_every = str(root), 100
    return cfg


def test_trains_end_to_end_on_hopper(tmp_path):
    model, scalars = train.main(small_hopper(tmp_path))[:2]
    assert model.actor[0].in_features == 11 and model.actor[-1].out_features == 3
    assert model.critic_normalizer.count.item() == 3 * 64          # every observation reached the normalizer
    assert np.isfinite(scalars["Train/mean_reward"]) and scalars["Train/mean_episode_length"] > 0
    (path,) = glob.glob(os.path.join(tmp_path, "mujoco", "*", "model_3.pt"))
    assert torch.load(path, weights_only=True)["optimizer"]["param_groups"][0]["eps"] == 1e-5   # CleanRL's Adam
    # Every finished episode's return, logged one by one: per iteration they average to Train/mean_reward,
    # which comes from the separate (sum, count) metric path.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(os.path.join(tmp_path, "mujoco", "*", "events.out.tfevents.*"))
    accumulator = EventAccumulator(events, size_guidance={"scalars": 0})
    accumulator.Reload()
    episodes: dict[int, list[float]] = {}
    for event in accumulator.Scalars("Episode/return"):
        episodes.setdefault(event.step, []).append(event.value)
    assert sorted(episodes) and set(episodes) <= {1, 2, 3}              # tagged with their iteration
    means = {event.step: event.value for event in accumulator.Scalars("Train/mean_reward")}
    # Tagged with the same iterations: comparing only the common ones compared nothing when the tags disagreed.
    assert set(means) == set(episodes)
    for step, returns in episodes.items():
        assert np.mean(returns) == pytest.approx(means[step], rel=1e-5)


def rank_body(rank, world_size, root):
    model = train.main(small_hopper(root, iterations=2))[0]
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_two_ranks_train_the_same_model(tmp_path):
    state0, state1 = run_ranks(rank_body, 2, args=(str(tmp_path),))
    for key in state0:
        assert torch.equal(state0[key], state1[key]), f"{key} diverged across ranks"
    assert state0["critic_normalizer.count"].item() == 2 * 64 * 2    # both ranks' observations merged
