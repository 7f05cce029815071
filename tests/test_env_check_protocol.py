"""ppo/env_check.py's protocol checks called directly on a cart-pole: a sampler needs both a tensor local_counts and
a commit_global method, reset() returns exactly (obs, extras), a logged value is a real number, and a non-finite
reset observation stops train.main before anything of the run is written."""

from types import SimpleNamespace

import pytest
import torch

from dist.errors import RunError
from envs import CartPole
from ppo.env_check import check_built, check_extras, check_reset


@pytest.mark.parametrize("sampler, fits", [
    (SimpleNamespace(local_counts=torch.zeros(3), commit_global=lambda summed: None), True),
    (SimpleNamespace(local_counts=[0.0, 0.0, 0.0], commit_global=lambda summed: None), False),   # not a tensor
    (SimpleNamespace(local_counts=torch.zeros(3)), False),                                      # no commit_global
    (SimpleNamespace(local_counts=torch.zeros(3), commit_global=torch.zeros(3)), False),        # not callable
], ids=["both", "counts_list", "no_commit", "commit_not_callable"])
def test_a_sampler_needs_both_a_tensor_local_counts_and_a_commit_global_method(sampler, fits):
    """Mutants: the sampler check without its local_counts tensor test, or without its commit_global test. Each half
    is tried alone: a sampler that has one of the two is refused, naming what the runner needs."""
    env = CartPole(2, "cpu", 0)
    env.sampler = sampler
    if fits:
        check_built(env, "mine", 2)
        return
    with pytest.raises(RunError, match=r"^env 'mine': env.sampler is a SimpleNamespace without a tensor local_counts "
                                       r"and a commit_global\(summed\) method"):
        check_built(env, "mine", 2)


def test_reset_returning_three_items_is_refused():
    """Mutant: check_reset's `len(result) == 2` dropped. (obs, extras, info), a tuple whose first item is a valid obs,
    is refused as not (obs, extras); the pair itself is accepted."""
    env = CartPole(2, "cpu", 0)
    obs, extras = env.reset()
    assert check_reset(env, (obs, extras), "mine", torch.device("cpu")) is obs
    with pytest.raises(RunError, match=r"^env 'mine': reset\(\) must return \(obs, extras\)"):
        check_reset(env, (obs, extras, {}), "mine", torch.device("cpu"))


def test_a_complex_number_logged_by_the_env_is_refused():
    """Mutant: numbers.Real widened to numbers.Number. A complex log value adds into no float sum: refused naming the
    key and the type; a float and a 0-d tensor under the same key are accepted."""
    env = CartPole(2, "cpu", 0)
    env.log_keys = ("Episode/height",)
    for fine in (0.5, torch.tensor(0.5)):
        check_extras(env, {"log": {"Episode/height": fine}}, "mine", False, torch.device("cpu"))
    with pytest.raises(RunError, match=r"^env 'mine': step\(\)'s extras\['log'\]\['Episode/height'\] must be a "
                                       r"scalar .* got a complex"):
        check_extras(env, {"log": {"Episode/height": 1 + 2j}}, "mine", False, torch.device("cpu"))


class NanAtReset(CartPole):
    """Cart-pole whose reset puts inf into env 1's critic feature 2."""

    def reset(self):
        obs, extras = super().reset()
        obs["critic"][1, 2] = torch.inf
        return obs, extras


def test_a_non_finite_reset_observation_stops_the_run_before_anything_of_it_is_written(tmp_path, monkeypatch):
    """docs/design.md: a NaN/inf in the reset's observations is named at start-up, before anything of the run is
    written (no run directory, config, event file or checkpoint).

    Mutant: train.main taking env.reset() without check_reset (the rollout's check_finite names it later, after the
    run directory and its config are written)."""
    import train
    from configs import preset
    monkeypatch.setattr(train, "make_env", lambda cfg, device, seed, base_seed: NanAtReset(cfg.num_envs, device, seed))
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.max_iterations = 8, 4, 2, 1
    cfg.log.root = str(tmp_path)
    with pytest.raises(RunError, match=r"^env 'cartpole': reset\(\)'s obs\['critic'\] holds inf at env 1 feature 2;"):
        train.main(cfg)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
