"""Extreme but legitimate inputs, checked against numpy float64 over the same float32 values."""

import glob
import math

import numpy as np
import pytest
import torch

import train
from dist.errors import RunError
from dist.stats import merge_moments
from ppo.gae import compute_gae
from ppo.normalizer import ObsNormalizer, RewardNormalizer
from ppo.update import checked_noise_std
from tests.ppo_fixtures import make_model
from tests.test_config_errors import cfg_with


def test_a_constant_feature_merged_away_from_its_shift_has_std_zero_not_nan():
    # s2 - s1^2 / n cancels to a rounding residue of either sign for identical samples: with the old code 158 of these
    # 600 pairs of merges ended nan on the machine this was written on, so a different summation order still fails.
    rng = np.random.default_rng(0)
    for _ in range(300):
        value = np.float32(rng.uniform(-100, 100))
        n, shift = int(rng.integers(2, 5000)), rng.uniform(-5, 5)
        batch = torch.full((n, 1), float(value))
        zero = torch.zeros(1, dtype=torch.float64)
        for first_mean in (zero, zero + value + shift):    # no shift (RewardNormalizer, count 0), a rough shift
            count, mean, m2 = merge_moments(torch.zeros((), dtype=torch.float64), first_mean.clone(), zero.clone(),
                                            batch)
            count, mean, m2 = merge_moments(count, mean, m2, batch)     # the same again: residues add up
            reference = np.full(2 * n, value, dtype=np.float64)
            std = (m2 / count).sqrt()
            assert m2.item() >= 0 and torch.isfinite(std).all(), (value, n, shift, m2.item())
            # Float64 cancellation of n identical squares leaves M2 / n within ~n * eps * d^2: std <= 1e-6 * |d|.
            assert std.item() <= reference.std() + 1e-6 * (abs(float(value)) + abs(shift))
            np.testing.assert_allclose(mean.item(), reference.mean(), rtol=1e-12)


def test_normalizers_merging_no_sample_at_all_keep_their_identity_forward_then_learn_from_the_next():
    """An update over empty batches on every rank (a copied normalizer, a rank with nothing this time) left std 0 / 0
    = nan and the forward shifted by set_first_shift's mean; RewardNormalizer.update() without a step failed in
    torch.cat. Both keep the identity forward, then the next update equals numpy over its batch."""
    obs = ObsNormalizer(2)
    obs.set_first_shift(torch.tensor([[5.0, -3.0], [7.0, -1.0]]))
    obs.update(torch.zeros(0, 2))
    x = torch.tensor([[1.0, 2.0]])
    assert obs.count.item() == 0 and torch.equal(obs(x), ObsNormalizer(2)(x))
    batch = torch.tensor([[6.0, -2.0], [8.0, -4.0], [4.0, 0.0]])
    obs.update(batch)
    assert torch.allclose(obs.mean, torch.tensor([6.0, -2.0])) and torch.allclose(obs.std, torch.tensor(
        np.std(batch.numpy(), axis=0), dtype=torch.float32))
    rewards = RewardNormalizer(num_envs=2, gamma=0.9, clip=10.0)
    rewards.update()
    assert rewards.count.item() == 0 and rewards.std.item() == 1.0
    rewards(torch.tensor([1.0, 3.0]), torch.zeros(2))
    rewards.update()
    assert rewards.count.item() == 2 and rewards.std.item() == pytest.approx(1.0)   # returns 1 and 3: std 1


def test_reward_normalizer_of_episodes_ending_every_step_with_one_reward_stays_finite():
    # Every env ends every step with the same reward (a robot that falls at spawn, a constant penalty): every recorded
    # return is that reward, std 0. The first merge is unshifted; a nan std made every scaled reward of the next
    # iteration nan, so all of its steps were skipped (and every iteration's, for as long as the reward stayed).
    # Sizes drawn too: sums of 2^k identical squares round exactly (10 of these 100 cases were nan with the old code).
    rng = np.random.default_rng(1)
    for _ in range(100):
        reward = np.float32(rng.uniform(-10, 10))
        num_envs, num_steps = int(rng.integers(1, 65)), int(rng.integers(1, 65))
        normalizer = RewardNormalizer(num_envs, gamma=0.99, clip=10.0)
        done = torch.ones(num_envs, dtype=torch.bool)
        for _ in range(num_steps):
            normalizer(torch.full((num_envs,), float(reward)), done)
        normalizer.update()
        assert torch.isfinite(normalizer.std), (reward, normalizer.m2.item())
        assert normalizer.std.item() <= 1e-6 * abs(float(reward))        # numpy: std of identical returns is 0
        scaled = normalizer(torch.full((num_envs,), float(reward)), done)
        # Scaled by std + eps ~ 1e-8, then clipped: what the formula gives for a reward with a zero std.
        np.testing.assert_array_equal(scaled.numpy(), np.full(num_envs, np.sign(reward) * 10.0, np.float32))


def test_gae_over_a_thousand_steps_of_large_rewards_stays_within_float32_rounding_of_float64():
    # Each step rounds a handful of float32 operations and gamma * lam <= 1 damps earlier errors, so the error stays
    # below ~4 * T * eps * max|A| (4.8e-4 relative at T = 1000, a worst case); a reformulation that grows errors with T
    # (powers of 1 / (gamma * lam)) or a bfloat16 accumulator exceeds it. Measured: 4e-7 at gamma = lam = 1, 7e-7 at
    # 0.999 / 0.99.
    rng = np.random.default_rng(2)
    T, N = 1000, 8
    rewards = (1e3 + 1e3 * rng.standard_normal((T, N))).astype(np.float32)
    values = (1e5 * rng.standard_normal((T, N))).astype(np.float32)
    last = (1e5 * rng.standard_normal(N)).astype(np.float32)
    dones = rng.random((T, N)) < 0.002
    dones[-1, 0] = True                                    # a time-out at the last step: last_values unused there
    for gamma, lam in ((1.0, 1.0), (0.999, 0.99)):
        adv, ret = compute_gae(*(torch.from_numpy(a) for a in (rewards, values, dones, last)), gamma, lam)
        # Float64, from the definition A_t = sum_k (gamma lam)^(k-t) delta_k over the steps before the episode ends.
        r, v = rewards.astype(np.float64), values.astype(np.float64)
        next_v = np.concatenate([v[1:], last[None].astype(np.float64)])
        delta = r + gamma * (1.0 - dones) * next_v - v
        expected = np.zeros((T, N))
        for t in range(T):
            alive = np.cumprod(np.concatenate([np.ones((1, N)), 1.0 - dones[t:-1]]), axis=0)   # 0 after a done
            expected[t] = ((gamma * lam) ** np.arange(T - t)[:, None] * alive * delta[t:]).sum(0)
        bound = 4 * T * np.finfo(np.float32).eps * np.abs(expected).max()
        np.testing.assert_allclose(adv.double().numpy(), expected, rtol=0, atol=bound)
        np.testing.assert_allclose(ret.double().numpy(), expected + v, rtol=0, atol=bound + np.finfo(np.float32).eps
                                   * np.abs(expected + v).max())


def test_the_noise_std_read_after_an_update_refuses_a_policy_it_left_unusable():
    model = make_model()
    with torch.no_grad():
        model.log_std.copy_(torch.tensor([-0.5, 0.0, 0.7][:model.log_std.numel()]))
    expected = float(np.mean(np.exp(model.log_std.detach().numpy().astype(np.float64))))
    assert math.isclose(checked_noise_std(model, 4, 1e-3), expected, rel_tol=1e-6)
    with torch.no_grad():
        model.critic[2].bias[1] = float("inf")
    with pytest.raises(RunError, match=r"^the update of iteration 4 left the policy unusable: non-finite weights in "
                                       r"critic\.2\.bias, at LR 0\.001; .*lower --ppo\.learning-rate"):
        checked_noise_std(model, 4, 1e-3)
    for log_std, std in ((1e4, "inf"), (-200.0, "0")):     # finite weights, but exp() leaves float32's range
        model = make_model()
        with torch.no_grad():
            model.log_std[0] = log_std
        with pytest.raises(RunError, match=f"left the policy unusable: an action noise std of .*{std}.* \\(log_std\\)"):
            checked_noise_std(model, 1, 1e4)
    with torch.no_grad():     # the range over the actions' stds; one value once (one action read "0 to 0")
        model.log_std.fill_(-200.0)
    with pytest.raises(RunError, match=r"an action noise std of 0 \(log_std\)"):
        checked_noise_std(model, 1, 1e4)
    model.log_std.data[1] = 1e4
    with pytest.raises(RunError, match=r"an action noise std of 0 to inf \(log_std\)"):
        checked_noise_std(model, 1, 1e4)


def test_a_run_whose_update_leaves_the_policy_unusable_stops_before_that_iteration_is_saved(tmp_path):
    """docs/running.md: an update that leaves the noise std 0 or inf (too large an LR) stops the run before its
    iteration is saved, naming the LR. A fixed LR of 1e4 with a save every iteration: Adam's first step moves log_std
    by about 1e4, so iteration 1 fails and no checkpoint is written.
    Mutant: the loop logs the noise std without checked_noise_std (`model.log_std.exp().mean().item()`)."""
    cfg = cfg_with(log__root=str(tmp_path), log__save_every=1, log__print_every=100, max_iterations=2,
                   env__num_envs=16, ppo__num_steps=8, ppo__schedule="fixed", ppo__learning_rate=1e4)
    with pytest.raises(RunError, match=r"^the update of iteration 1 left the policy unusable: .* at LR 10000; .*"
                                       r"\(nothing of this iteration was saved\)$"):
        train.main(cfg)
    assert glob.glob(str(tmp_path / "tracking" / "*" / "config_0.json"))     # the run had started
    assert not glob.glob(str(tmp_path / "tracking" / "*" / "*.pt"))


@pytest.mark.parametrize("broken, named", [
    (("actor.0.bias", "actor.2.weight", "critic.0.bias"), "actor.0.bias, actor.2.weight, critic.0.bias"),
    (("actor.0.bias", "actor.2.weight", "critic.0.bias", "critic.4.bias"),
     "actor.0.bias, actor.2.weight, critic.0.bias and 1 more"),
    (("log_std", "actor.0.bias", "actor.2.weight", "critic.0.bias", "critic.4.bias"),
     "log_std, actor.0.bias, actor.2.weight and 2 more")])
def test_an_unusable_policy_names_its_first_three_broken_weights_in_model_order_and_counts_the_rest(broken, named):
    """Three names at most, in the model's parameter order, then "and N more": one line whatever the model's size.
    (Kills listing two names, and counting the rest only from five broken weights.)"""
    model = make_model()
    with torch.no_grad():
        for name in broken:
            dict(model.named_parameters())[name].view(-1)[0] = float("nan")
    with pytest.raises(RunError) as exc:
        checked_noise_std(model, 2, 1e-3)
    assert str(exc.value).startswith(f"the update of iteration 2 left the policy unusable: non-finite weights in "
                                     f"{named}, at LR 0.001; ")


def test_a_learning_rate_that_blows_the_policy_up_stops_the_run_at_that_update_and_saves_nothing(tmp_path):
    """A fixed LR of 1e4: Adam's first steps move log_std by about 1e4, so exp() is inf and every action nan;
    the run used to go on, every step skipped, and save that policy (or blame the env for the nan it was fed)."""
    cfg = cfg_with(env__num_envs=16, ppo__num_steps=8, max_iterations=3, log__root=str(tmp_path),
                   log__save_every=1, ppo__schedule="fixed", ppo__learning_rate=1e4)
    with pytest.raises(RunError, match=r"^the update of iteration 1 left the policy unusable: .* at LR 10000; "):
        train.main(cfg)
    assert glob.glob(str(tmp_path / "**" / "config_0.json"), recursive=True)   # the run did start
    assert not glob.glob(str(tmp_path / "**" / "model_*.pt"), recursive=True)
