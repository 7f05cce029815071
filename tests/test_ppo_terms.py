"""PPO's building blocks against their formulas: the loss terms, the adaptive-LR rule, the observation and
reward normalizers, the rollout storage and the actor-critic's initialization. Every expected number is
computed independently of the code under test (by hand, numpy in float64, torch.distributions)."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from configs import PolicyConfig
from ppo.actor_critic import ActorCritic, build_actor_critic
from ppo.kl_schedule import adaptive_lr
from ppo.loss import ppo_loss
from ppo.normalizer import ObsNormalizer, RewardNormalizer


# ---- ppo/loss.py, ppo/kl_schedule.py ---------------------------------------------------------------

def test_value_loss_is_a_squared_error_weighted_by_value_loss_coef():
    """The value loss is the mean SQUARED error (the existing hand test only used errors of 0 and 1, where
    |e| == e^2), clipped or not, and the total loss weighs it by value_loss_coef (not a fixed 0.5)."""
    zeros = torch.zeros(2)                                            # ratio 1: surrogate = -mean(A) = 0
    adv, ent = torch.tensor([1.0, -1.0]), torch.tensor([0.5, 1.5])
    values, old_values, returns = torch.tensor([3.0, -1.0]), torch.tensor([2.0, -1.0]), torch.tensor([0.5, 0.5])
    clipped = ppo_loss(zeros, zeros, adv, values, old_values, returns, ent, clip_param=0.2, clip_value_loss=True,
                       value_loss_coef=2.0, entropy_coef=0.1)
    # sample 0: v=3, clipped v = 2 + 0.2 = 2.2: max((3-0.5)^2, (2.2-0.5)^2) = max(6.25, 2.89) = 6.25
    # sample 1: v = old v = -1: (-1.5)^2 = 2.25
    assert clipped["value_function"].item() == pytest.approx((6.25 + 2.25) / 2, rel=1e-6)
    assert clipped["surrogate"].item() == pytest.approx(0.0, abs=1e-7)
    assert clipped["entropy"].item() == pytest.approx(1.0, rel=1e-6)
    assert clipped["loss"].item() == pytest.approx(0.0 + 2.0 * 4.25 - 0.1 * 1.0, rel=1e-6)
    unclipped = ppo_loss(zeros, zeros, adv, values, old_values, returns, ent, 0.2, False, 2.0, 0.1)
    assert unclipped["value_function"].item() == pytest.approx((2.5**2 + 1.5**2) / 2, rel=1e-6)


def test_adaptive_lr_keeps_the_lr_at_exactly_half_the_desired_kl():
    """The rule raises the LR only when kl < desired / 2 (strictly), as RSL-RL does; at the boundary the LR
    stays. The device rule is checked against this host rule, so a boundary slip here would go unseen there
    (its KLs pass through float32, which never hits 0.005 exactly)."""
    desired = 0.01
    assert 0.5 * desired == 0.005
    assert adaptive_lr(1e-3, kl=0.5 * desired, desired_kl=desired, lr_min=1e-5, lr_max=1e-2) == 1e-3
    assert adaptive_lr(1e-3, kl=0.0049, desired_kl=desired, lr_min=1e-5, lr_max=1e-2) == 1e-3 * 1.5


# ---- ppo/normalizer.py -----------------------------------------------------------------------------

def test_obs_normalizer_forward_uses_the_population_std_of_every_merged_batch_and_clips():
    """forward(x) = clip((x - mean) / (std + eps), -10, 10) with mean and POPULATION std over all samples
    merged so far. A constant feature (std 0) must map to 0, not NaN (the eps), and outliers are clipped:
    both keep a network input finite and bounded."""
    g = torch.Generator().manual_seed(0)
    scale, shift = torch.tensor([1.0, 4.0, 0.0]), torch.tensor([2.0, -3.0, 7.0])      # feature 2 is constant 7
    batches = [torch.randn(n, 3, generator=g) * scale + shift for n in (40, 60)]
    norm = ObsNormalizer(3)
    for b in batches:
        norm.update(b)
    union = torch.cat(batches).double().numpy()
    mean, std = union.mean(0), union.std(0)                 # ddof=0
    assert std[2] == 0.0
    np.testing.assert_allclose(norm.mean.numpy(), mean, rtol=1e-6)
    np.testing.assert_allclose(norm.std.numpy(), std, rtol=1e-6, atol=0)
    x = torch.tensor([[float(mean[0] + 7 * std[0]), 100.0, 7.0],       # 7 sigma: inside the clip; 25.8 sigma: clipped
                      [-50.0, -3.0, 8.0]])                              # constant feature off by 1: 1e8 -> clipped
    expected = np.clip((x.double().numpy() - mean) / (std + 1e-8), -10.0, 10.0)
    out = norm(x)
    assert torch.isfinite(out).all()
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert expected[0, 2] == 0.0 and expected[0, 1] == 10.0 and expected[1, 0] == -10.0 and 6 < expected[0, 0] < 8


def test_set_first_shift_does_nothing_once_statistics_exist():
    """set_first_shift only conditions the very first merge; called again later (a resumed run, a second
    reset) it must not move the running mean, or every later merge would be off by the shift."""
    g = torch.Generator().manual_seed(1)
    b1, b2 = torch.randn(30, 2, generator=g) + 5.0, torch.randn(20, 2, generator=g) * 2 - 1.0
    norm = ObsNormalizer(2)
    norm.update(b1)
    norm.set_first_shift(torch.full((4, 2), 1000.0))
    norm.update(b2)
    union = torch.cat([b1, b2]).double().numpy()
    assert norm.count.item() == 50
    np.testing.assert_allclose(norm.mean64.numpy(), union.mean(0), rtol=1e-12)
    np.testing.assert_allclose((norm.m2 / norm.count).numpy(), union.var(0), rtol=1e-9)


def test_set_first_shift_leaves_the_forward_pass_unchanged_until_the_first_merge():
    """The shift only conditions the first merge's sums: before that merge the forward must still be the identity
    (mean 0, std 1; the rollout that collects the first batch sees raw observations), and after it the forward
    uses the batch's own mean and population std, as without a shift."""
    norm = ObsNormalizer(2)
    norm.set_first_shift(torch.tensor([[100.0, -40.0], [102.0, -44.0]]))    # shift (101, -42)
    x = torch.tensor([[3.0, -4.0], [0.5, 2.0]])
    assert torch.equal(norm(x), x)                                         # |x| < clip: (x - 0) / (1 + 1e-8) == x
    batch = torch.tensor([[100.0, -40.0], [104.0, -46.0]])                # mean (102, -43), std (2, 3)
    norm.update(batch)
    expected = (torch.tensor([[106.0, -37.0]]) - torch.tensor([102.0, -43.0])) / torch.tensor([2.0, 3.0])
    torch.testing.assert_close(norm(torch.tensor([[106.0, -37.0]])), expected)   # (2, 2)


def test_a_feature_constant_so_far_scales_a_deviation_by_one_over_eps_added_to_the_std():
    """The std + eps form (RSL-RL's), not CleanRL's sqrt(var + eps): a feature that was 0 in every observation so
    far (std 0) moved by 5e-8 reads 5e-8 / 1e-8 = 5 (inside the clip, so the clip cannot hide the form); under the
    root it would read 5e-8 / 1e-4 = 5e-4. The other feature (mean 2, std 1) is the plain (x - 2) / 1."""
    norm = ObsNormalizer(2)
    norm.update(torch.tensor([[0.0, 1.0], [0.0, 3.0]]))
    assert norm.std.tolist() == [0.0, 1.0]
    out = norm(torch.tensor([[5e-8, 2.5]]))
    torch.testing.assert_close(out, torch.tensor([[5.0, 0.5]]), rtol=1e-5, atol=0)


def test_set_first_shift_shifts_each_feature_by_its_own_mean():
    """The shift is per feature: features far apart (+1e6 and -1e6, unit spread) each need their own mean, or a
    shift by the mean over all features (~0 here) leaves the first merge plain sums of squares, which lose digits
    (tests/test_stats_merge.py shows by how much). Population std of each feature by numpy in float64."""
    g = torch.Generator().manual_seed(4)
    x = (torch.tensor([1e6, -1e6], dtype=torch.float64)
         + torch.randn(4096, 2, generator=g, dtype=torch.float64)).float()
    reference = x.double().numpy().std(0)
    norm = ObsNormalizer(2)
    norm.set_first_shift(x[:64])
    norm.update(x)
    np.testing.assert_allclose((norm.m2 / norm.count).sqrt().numpy(), reference, rtol=1e-9, atol=0)
    np.testing.assert_allclose(norm.mean64.numpy(), x.double().numpy().mean(0), rtol=1e-12, atol=0)


def test_reward_normalizer_tracks_discounted_returns_that_restart_each_episode():
    """The statistics are those of the running discounted return, recorded after each step's reward is added
    and reset to 0 after an episode ends (CleanRL's NormalizeReward); each update merges only the returns
    recorded since the previous one."""
    rn = RewardNormalizer(num_envs=1, gamma=0.9, clip=10.0)
    for reward, done in ((1.0, False), (2.0, True), (3.0, False)):
        rn(torch.tensor([reward]), torch.tensor([done]))
    rn.update()
    first = [1.0, 0.9 * 1.0 + 2.0, 3.0]          # the episode ends after 2.9 is recorded; a new one starts at 3
    assert rn.count.item() == 3
    assert rn.std.item() == pytest.approx(np.std(first), rel=1e-6)
    rn(torch.tensor([1.0]), torch.tensor([False]))
    rn.update()
    both = first + [0.9 * 3.0 + 1.0]
    assert rn.count.item() == 4                   # the first iteration's returns are not merged twice
    assert rn.std.item() == pytest.approx(np.std(both), rel=1e-6)
    out = rn(torch.tensor([1.0]), torch.tensor([False]))
    assert out.item() == pytest.approx(1.0 / (np.std(both) + 1e-8), rel=1e-6)


def test_reward_normalizer_with_zero_return_spread_stays_finite():
    """An iteration of all-zero rewards gives std 0; a zero reward must then scale to 0 (the eps), not to
    0/0 = NaN, which would poison GAE and every later update."""
    rn = RewardNormalizer(num_envs=2, gamma=0.99, clip=10.0)
    for _ in range(3):
        rn(torch.zeros(2), torch.zeros(2, dtype=torch.bool))
    rn.update()
    assert rn.std.item() == 0.0
    out = rn(torch.tensor([0.0, 1.0]), torch.zeros(2, dtype=torch.bool))
    assert out.tolist() == [0.0, 10.0]            # 0 / 1e-8 = 0; 1 / 1e-8 clipped to 10


def test_reward_normalizer_clips_scaled_rewards_on_both_sides_at_its_clip():
    """The scaled reward is clipped to [-clip, clip] with the configured clip (--ppo.reward-clip, not a fixed 10):
    a large penalty is bounded like a large bonus. By hand with std 2, clip 3."""
    rn = RewardNormalizer(num_envs=5, gamma=0.99, clip=3.0)
    rn.std.fill_(2.0)                                         # as if earlier iterations had measured it
    out = rn(torch.tensor([-10.0, -4.0, 5.0, 7.0, 1.0]), torch.zeros(5, dtype=torch.bool))
    expected = [max(-3.0, min(3.0, r / (2.0 + 1e-8))) for r in (-10.0, -4.0, 5.0, 7.0, 1.0)]
    assert expected[0] == -3.0 and expected[3] == 3.0 and -3.0 < min(expected[1:3]) and max(expected[1:3]) < 3.0
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)


def test_obs_normalizer_uses_the_statistics_of_a_single_merged_sample():
    """Mutant: `seen = self.count > 0` -> `self.count > 1` (one sample in all kept the identity forward).
    One observation (3, -1) merged: mean (3, -1), population std 0, so the forward reads a deviation d as
    d / 1e-8 (by hand: 5e-8 -> 5) and the sample itself as 0; the identity forward would return x unchanged."""
    norm = ObsNormalizer(2)
    norm.update(torch.tensor([[3.0, -1.0]]))
    assert norm.count.item() == 1 and norm.mean.tolist() == [3.0, -1.0] and norm.std.tolist() == [0.0, 0.0]
    assert norm(torch.tensor([[3.0, -1.0]])).tolist() == [[0.0, 0.0]]
    torch.testing.assert_close(norm(torch.tensor([[3.0, -1.0]], dtype=torch.float64) + 5e-8),
                               torch.tensor([[5.0, 5.0]], dtype=torch.float64), rtol=1e-4, atol=0)


def test_reward_normalizer_uses_the_std_of_a_single_merged_return():
    """Mutant: `torch.where(self.count > 0, ...)` -> `self.count > 1` in RewardNormalizer.update (one return in
    all kept std 1). One env, one step of reward 2: one return (2), population std 0, so a later reward r scales
    to r / (0 + 1e-8) (by hand: 3e-8 -> 3; 1 -> clipped to the clip 10), not to r / 1."""
    rn = RewardNormalizer(num_envs=1, gamma=0.99, clip=10.0)
    rn(torch.tensor([2.0]), torch.tensor([True]))
    rn.update()
    assert rn.count.item() == 1 and rn.std.item() == 0.0
    assert rn(torch.tensor([3e-8]), torch.tensor([True])).item() == pytest.approx(3.0, rel=1e-4)
    assert rn(torch.tensor([1.0]), torch.tensor([True])).item() == 10.0


# ---- ppo/actor_critic.py ---------------------------------------------------------------------------

def test_actor_and_critic_see_their_fitted_normalizers_output():
    """With fitted normalizers the networks get clip((x - mean) / (std + eps)), with mean/std over the data
    merged so far (numpy here); a normalizer that is built but bypassed would leave raw inputs in the MLPs."""
    torch.manual_seed(0)
    model = ActorCritic(3, 4, 2, (8,), (8,), normalize_actor_obs=True, normalize_critic_obs=True)
    g = torch.Generator().manual_seed(2)
    actor_data, critic_data = torch.randn(64, 3, generator=g) * 3 + 5, torch.randn(64, 4, generator=g) * 0.5 - 2
    model.actor_normalizer.update(actor_data)
    model.critic_normalizer.update(critic_data)

    def normalized(x, data):
        d = data.double().numpy()
        return torch.tensor(np.clip((x.double().numpy() - d.mean(0)) / (d.std(0) + 1e-8), -10, 10), dtype=torch.float32)

    xa, xc = torch.randn(16, 3, generator=g) * 3 + 5, torch.randn(16, 4, generator=g) * 0.5 - 2
    with torch.no_grad():
        torch.testing.assert_close(model.distribution(xa).mean, model.actor(normalized(xa, actor_data)),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.value(xc), model.critic(normalized(xc, critic_data)).squeeze(-1),
                                   rtol=1e-5, atol=1e-6)


def test_initial_noise_std_and_orthogonal_initialization():
    """init_noise_std is the policy's initial std (not its log); orthogonal init gives hidden layers gain
    sqrt(2), the actor head gain 0.01 (near-zero initial mean actions), the critic head gain 1, zero biases."""
    torch.manual_seed(0)
    model = ActorCritic(6, 5, 3, (16, 8), (16, 8), init_noise_std=0.5, orthogonal_init=True)
    torch.testing.assert_close(model.distribution(torch.zeros(2, 6)).stddev, torch.full((2, 3), 0.5))
    for net, head_gain in ((model.actor, 0.01), (model.critic, 1.0)):
        linears = [m for m in net if isinstance(m, nn.Linear)]
        for layer in linears:
            gain = head_gain if layer is linears[-1] else math.sqrt(2)
            w = layer.weight.detach().double()
            gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w      # the smaller side is orthonormal * gain
            torch.testing.assert_close(gram, gain**2 * torch.eye(gram.shape[0], dtype=torch.float64), rtol=0, atol=1e-6)
            assert torch.equal(layer.bias, torch.zeros_like(layer.bias))


def test_build_actor_critic_normalizes_the_observation_groups_it_is_told_to():
    model = build_actor_critic(PolicyConfig(actor_hidden=(4,), critic_hidden=(4,), normalize_actor_obs=True,
                                            normalize_critic_obs=False), {"policy": 3, "critic": 5}, 2)
    assert isinstance(model.actor_normalizer, ObsNormalizer) and model.actor_normalizer.mean.numel() == 3
    assert not isinstance(model.critic_normalizer, ObsNormalizer)
    assert list(model.normalizers()) == ["actor_obs"]


def test_every_normalizer_buffer_of_the_actor_critic_is_merged_never_broadcast_or_averaged():
    """The design's rule for the observation normalizers is `merge` (ObsNormalizer.update merges every rank's
    observations): a `broadcast` or `mean` rule would add a per-iteration collective on statistics that the merge
    already made identical, and `local` would declare them per-rank. So no buffer traffic is planned for them."""
    from dist.buffers import buffer_plan_rows, resolve_buffer_policy
    model = ActorCritic(3, 4, 2, (8,), (8,), normalize_actor_obs=True, normalize_critic_obs=True)
    rules = resolve_buffer_policy(model, model.BUFFER_POLICY)
    assert sorted(rules) == sorted(f"{side}_normalizer.{name}" for side in ("actor", "critic")
                                   for name in ("count", "mean64", "m2", "mean", "std"))
    assert set(rules.values()) == {"merge"}
    assert buffer_plan_rows(model, rules) == []


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int64, torch.float32])
def test_reward_normalizer_restarts_returns_for_dones_of_any_dtype(dtype):
    """An env that ended restarts its running return at 0 whatever the dtype of `done` (legged_gym-style envs give
    long dones): ~done on integers is -1 - done, which scaled the returns by -1 or -2 (uint8: 254, 255)."""
    rn = RewardNormalizer(num_envs=2, gamma=0.99, clip=10.0)
    rn(torch.ones(2), torch.tensor([0, 1]).to(dtype))
    rn(torch.ones(2), torch.tensor([0, 0]).to(dtype))
    np.testing.assert_allclose(rn.returns.numpy(), [0.99 * 1.0 + 1.0, 1.0], rtol=1e-7)


def test_reward_normalizer_restarts_returns_for_any_nonzero_done_not_only_one():
    """`done` is nonzero where the episode ended, as the docstring says: an integer code 2 or a float 0.5 ends it
    too, so both envs' returns restart at 0 while the env with done 0 keeps 0.99 * 1 + 1 (by hand).
    Mutant: `done.logical_not()` -> `1 - done` for non-bool dones (right only for 0/1: done 2 scales by -1)."""
    for done in (torch.tensor([0, 2, 3]), torch.tensor([0.0, 0.5, 2.0])):
        rn = RewardNormalizer(num_envs=3, gamma=0.99, clip=10.0)
        rn(torch.ones(3), done)
        assert rn.returns.tolist() == [1.0, 0.0, 0.0]
        rn(torch.ones(3), torch.zeros(3))
        np.testing.assert_allclose(rn.returns.numpy(), [0.99 * 1.0 + 1.0, 1.0, 1.0], rtol=1e-7)
