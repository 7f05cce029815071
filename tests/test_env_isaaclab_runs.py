"""The isaaclab preset trained end to end through the adapter against the fake Isaac Lab, at 1 and 2 ranks."""

import glob
import os

import pytest
import torch

import train
from configs import preset
from dist.setup import rank_seed
from tests.fake_isaaclab import MAX_EPISODE_LENGTH, install
from tests.multirank import run_ranks
from tests.test_env_isaaclab import fake  # noqa: F401 - the fixture that installs the fake Isaac Lab


def small_run(root, iterations=2):
    cfg = preset("isaaclab")
    cfg.env.num_envs, cfg.env.critic_obs_groups = 8, ("policy", "critic")
    cfg.ppo.num_steps, cfg.max_iterations = 8, iterations
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16, 16)
    cfg.log.root, cfg.log.print_every = str(root), 100
    return cfg


def test_trains_end_to_end_through_the_adapter(fake, tmp_path, monkeypatch):
    # The fake simulates on the CPU, so the learner must pick the CPU too, also on a machine with a GPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = small_run(tmp_path)
    model, scalars = train.main(cfg)[:2]
    (launch,) = fake.launches
    assert launch["device"] == "cuda:0" and launch["seed"] == rank_seed(cfg.seed, 0) and launch["num_envs"] == 8
    assert not launch["distributed"] and launch["physics"] == "newton_mjwarp"   # the task's default: kitless
    assert model.actor[0].in_features == 3 and model.critic[0].in_features == 7
    assert scalars["Metrics/constant"] == pytest.approx(0.5)
    assert 0 < scalars["Train/mean_episode_length"] <= MAX_EPISODE_LENGTH
    assert glob.glob(os.path.join(tmp_path, "isaaclab", "*", "model_2.pt"))
    # 2 iterations x 8 steps reached the simulator, as (8 envs x 2 actions) tensors on the env's device.
    actions = fake.envs[0].received_actions
    assert len(actions) == 16 and actions[0].shape == (8, 2)


def rank_body(rank, world_size, root):
    torch.cuda.is_available = lambda: False    # the fake simulates on the CPU: so does this spawned rank
    record = install(rank)
    model = train.main(small_run(root))[0]
    return record.launches, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_two_ranks_simulate_on_their_own_gpu_with_their_own_seed(tmp_path):
    (launches0, state0), (launches1, state1) = run_ranks(rank_body, 2, args=(str(tmp_path),))
    base_seed = preset("isaaclab").seed
    # Both ranks tell the launcher `distributed` (Kit then pins its renderer to the rank's GPU).
    assert [(launch["device"], launch["seed"], launch["distributed"]) for launch in launches0 + launches1] == [
        ("cuda:0", rank_seed(base_seed, 0), True), ("cuda:1", rank_seed(base_seed, 1), True)]
    for key in state0:
        assert torch.equal(state0[key], state1[key]), f"{key} diverged across ranks"
