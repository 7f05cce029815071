"""A new env's sizes must be ints: obs_dims values and num_actions written as a gym space's shape ((3,), as Isaac Lab's
spaces give them) or as a float are one line naming the field, not a TypeError traceback from the runner's checks or
from inside nn.Linear (docs/design.md, "Adding an env of your own")."""

import numpy as np
import pytest
import torch

import train
from configs import preset
from dist.errors import RunError
from envs import CartPole
from ppo.env_check import check_built


class Sized(CartPole):
    """Cart-pole whose declared sizes are set by the test."""

    def __init__(self, num_envs, device, seed, obs_dims=None, num_actions=1):
        super().__init__(num_envs, device, seed)
        self.obs_dims, self.num_actions = obs_dims or {"policy": 4, "critic": 4}, num_actions


WRONG = {
    "obs_dims_shape": ({"policy": (4,), "critic": (4,)}, 1, r"env.obs_dims\['policy'\] is a tuple \(\(4,\)\), not an "
                                                           r"int: the width of a \[num_envs, width\] tensor"),
    "critic_float": ({"policy": 4, "critic": 4.0}, 1, r"env.obs_dims\['critic'\] is a float \(4.0\), not an int"),
    "num_actions_shape": (None, torch.Size([1]), r"env.num_actions is a Size \(torch.Size\(\[1\]\)\), not an int"),
    "num_actions_bool": (None, True, r"env.num_actions is a bool \(True\), not an int"),
}


@pytest.mark.parametrize("case", WRONG)
def test_a_size_that_is_not_an_int_is_named(case):
    obs_dims, num_actions, error = WRONG[case]
    with pytest.raises(RunError, match=r"^env 'mine': " + error):
        check_built(Sized(8, "cpu", 0, obs_dims, num_actions), "mine", 8)


def test_numpy_ints_are_sizes_too():
    """Sizes read off numpy arrays (np.int64) are ints: accepted as before."""
    check_built(Sized(8, "cpu", 0, {"policy": np.int64(4), "critic": np.int64(4)}, np.int64(1)), "mine", 8)


def test_train_stops_with_the_one_line_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "make_env", lambda cfg, device, seed, base_seed: Sized(
        cfg.num_envs, device, seed, {"policy": (4,), "critic": (4,)}))
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.max_iterations = 8, 4, 2, 1
    cfg.log.root = str(tmp_path)
    with pytest.raises(RunError, match=r"^env 'cartpole': env.obs_dims\['policy'\] is a tuple"):
        train.main(cfg)
    assert not any(tmp_path.rglob("events.out.*")) and not any(tmp_path.rglob("model_*.pt"))
