"""Gaps a mutation audit of the algorithm core (ppo/loss.py, ppo/gae.py, ppo/normalizer.py, ppo/kl_schedule.py,
ppo/storage.py, ppo/actor_critic.py) found: each test here fails on a plausible change of that code which every other
test let through. Expectations are written by hand or computed in float64 from the definitions.

Mutants of these files found equivalent (no test can tell them apart):
- kl_schedule: clamping to lr_max before lr_min (configs/config.py refuses lr_min > lr_max, the only case it changes);
- gae.bootstrap_time_outs: no early return when nothing timed out (index_add of zero rows returns the same rewards),
  `nonzero().flatten()` for `nonzero().squeeze(-1)` (the same [k] index);
- normalizer: set_first_shift's mean in float32 (the shift only conditions the merge's sums; float32 observations
  carry no more digits than it), the float64 std rounded to float32 before its copy (the copy rounds the same way);
- storage: float dones (GAE, their only reader, takes `.float()` of them).
"""

import inspect

import numpy as np
import torch
from torch import nn

from configs import PolicyConfig
from ppo.actor_critic import ActorCritic, Gaussian
from ppo.loss import ppo_loss
from ppo.normalizer import ObsNormalizer


def test_gaussian_sample_is_a_constant_to_autograd():
    """Like torch.distributions.Normal.sample, a sampled action carries no graph: an action drawn with gradients
    enabled (an evaluation loop, a rollout outside inference mode) and then scored by log_prob must give the
    score-function gradient (a - mu) / sigma^2, not one that also flows back through a = mu + sigma * eps
    (which cancels the mean's gradient to 0)."""
    mean = torch.tensor([[0.3, -1.2], [2.0, 0.5]], requires_grad=True)
    log_std = torch.tensor([0.1, -0.4], requires_grad=True)
    torch.manual_seed(0)
    action = Gaussian(mean, log_std).sample()
    assert not action.requires_grad
    Gaussian(mean, log_std).log_prob(action).sum().backward()
    a, mu, sigma = action.double().numpy(), mean.detach().double().numpy(), np.exp(log_std.detach().double().numpy())
    np.testing.assert_allclose(mean.grad.double().numpy(), (a - mu) / sigma**2, rtol=1e-5)
    np.testing.assert_allclose(log_std.grad.double().numpy(), ((a - mu) ** 2 / sigma**2 - 1.0).sum(0), rtol=1e-5)


def test_actor_critic_defaults_are_the_command_lines_defaults():
    """ActorCritic built directly (an evaluation script, an export, a user of the module) must be the model train.py
    builds with default flags: a default without the critic's normalizer would give a model whose state_dict lacks
    `critic_normalizer.*` (a checkpoint of a default run would not load) and whose critic sees raw observations."""
    model = ActorCritic(3, 4, 2)
    assert isinstance(model.critic_normalizer, ObsNormalizer) and isinstance(model.actor_normalizer, nn.Identity)
    assert [m.out_features for m in model.actor if isinstance(m, nn.Linear)] == [128, 128, 2]
    assert torch.equal(model.log_std.detach(), torch.zeros(2))                 # init_noise_std 1
    defaults = {name: p.default for name, p in inspect.signature(ActorCritic).parameters.items()
                if p.default is not inspect.Parameter.empty}
    cfg = PolicyConfig()
    assert defaults == {name: getattr(cfg, name) for name in defaults}
    assert len(defaults) == 7


def test_ppo_loss_ratio_of_log_probs_beyond_float32_exp_range():
    """The ratio is exp(log_prob - old_log_prob), never exp(log_prob) / exp(old_log_prob): log-probs summed over many
    action dims leave float32's exp range in ordinary runs (a sharp policy near its mean, 25 dims at sigma 0.01, gives
    +92, past exp's 88.7; a far-off action gives -150, past -103): the quotient is inf / inf or 0 / 0, a nan loss."""
    log_prob = torch.tensor([95.0, -150.0, 95.0])
    old_log_prob = torch.tensor([94.8, -150.5, 95.5])
    advantages = torch.tensor([1.0, -2.0, 0.5])
    zeros = torch.zeros(3)
    terms = ppo_loss(log_prob, old_log_prob, advantages, zeros, zeros, zeros, zeros, clip_param=0.2,
                     clip_value_loss=False, value_loss_coef=1.0, entropy_coef=0.0)
    ratio = np.exp(np.array([95.0, -150.0, 95.0], dtype=np.float32).astype(np.float64)
                   - np.array([94.8, -150.5, 95.5], dtype=np.float32).astype(np.float64))   # e^0.2, e^0.5, e^-0.5
    adv = np.array([1.0, -2.0, 0.5])
    expected = -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv).mean()
    assert torch.isfinite(terms["loss"])
    assert abs(terms["surrogate"].item() - expected) < 1e-5
