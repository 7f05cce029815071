"""RSL-RL 5.5.1's own code as the oracle for syncppo's GAE, KL and loss
(rsl-rl-lib, from requirements-dev.txt)."""

from types import SimpleNamespace

import pytest
import rsl_rl.algorithms.ppo as ppo_module
import rsl_rl.modules.distribution as distribution
import torch

from ppo.gae import compute_gae
from ppo.loss import gaussian_kl, ppo_loss


class _FixedCritic:
    """What RSL-RL's compute_returns asks of its critic: a (stateless) value of the last observation."""

    def __init__(self, last_values):
        self.last_values = last_values

    def get_hidden_state(self):
        return None

    def reset(self, hidden_state=None):
        pass

    def __call__(self, obs):
        return self.last_values


def test_gae_with_terminations_and_time_outs_equals_rsl_rl_compute_returns():
    # A time-out's bootstrap is folded into its reward in both (RSL-RL in process_env_step, syncppo in fill_storage),
    # so equal rewards with dones on both kinds of episode end must give equal returns and raw advantages.
    g = torch.Generator().manual_seed(3)
    T, N, gamma, lam = 9, 6, 0.97, 0.9
    rewards, values = torch.randn(T, N, generator=g), torch.randn(T, N, generator=g)
    dones = torch.rand(T, N, generator=g) < 0.25
    dones[-1, 0], dones[0, 1] = True, True          # an end at the last step (no bootstrap from last_values) and first
    last_values = torch.randn(N, generator=g)
    storage = SimpleNamespace(num_transitions_per_env=T, values=values[..., None].clone(),
                              rewards=rewards[..., None].clone(), dones=dones[..., None].float(),
                              returns=torch.zeros(T, N, 1), advantages=None)
    oracle = SimpleNamespace(storage=storage, critic=_FixedCritic(last_values[:, None]), gamma=gamma, lam=lam,
                             normalize_advantage_per_mini_batch=True)   # raw advantages: normalization is tested apart
    ppo_module.PPO.compute_returns(oracle, obs=None)
    advantages, returns = compute_gae(rewards, values, dones, last_values, gamma, lam)
    torch.testing.assert_close(returns, storage.returns[..., 0])
    torch.testing.assert_close(advantages, storage.advantages[..., 0])


def test_gaussian_kl_is_rsl_rl_kl_of_old_to_new():
    # KL(old || new), the direction whose value the adaptive LR rule compares against desired_kl.
    g = torch.Generator().manual_seed(4)
    mu_old, mu = torch.randn(7, 3, generator=g), torch.randn(7, 3, generator=g)
    sigma_old, sigma = torch.rand(7, 3, generator=g) + 0.2, torch.rand(7, 3, generator=g) + 0.2
    expected = distribution.GaussianDistribution.kl_divergence(None, (mu_old, sigma_old), (mu, sigma))
    torch.testing.assert_close(gaussian_kl(mu_old, sigma_old, mu, sigma), expected)
    assert not torch.allclose(gaussian_kl(mu, sigma, mu_old, sigma_old), expected)   # the other direction differs


@pytest.mark.parametrize("clip_value_loss", [True, False])
def test_ppo_loss_equals_rsl_rl_update_formulas(clip_value_loss):
    # RSL-RL 5.5.1 ppo.py update(): max of the negated surrogates, value clipped around the stored (rollout) values.
    g = torch.Generator().manual_seed(5)
    B, clip, vcoef, ecoef = 64, 0.2, 1.0, 0.008
    log_prob, old_log_prob = torch.randn(B, generator=g) * 0.3, torch.randn(B, generator=g) * 0.3
    adv, values, old_values, returns = (torch.randn(B, generator=g) for _ in range(4))
    entropy = torch.rand(B, generator=g)
    ratio = torch.exp(log_prob - old_log_prob)
    surrogate = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).mean()
    if clip_value_loss:
        value_clipped = old_values + (values - old_values).clamp(-clip, clip)
        value_loss = torch.max((returns - values).pow(2), (value_clipped - returns).pow(2)).mean()
    else:
        value_loss = (returns - values).pow(2).mean()
    terms = ppo_loss(log_prob, old_log_prob, adv, values, old_values, returns, entropy, clip, clip_value_loss,
                     vcoef, ecoef)
    torch.testing.assert_close(terms["loss"], surrogate + vcoef * value_loss - ecoef * entropy.mean())
    torch.testing.assert_close(terms["value_function"], value_loss)
