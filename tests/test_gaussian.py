"""ppo.actor_critic.Gaussian gives torch.distributions.Normal's numbers, with the std terms on [A], and its samples
carry no graph, as Normal.sample's do."""

import numpy as np
import torch

from ppo.actor_critic import Gaussian


def test_gaussian_matches_torch_normal_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    mean, log_std = torch.randn(257, 6, generator=g), torch.randn(6, generator=g) * 0.5
    actions = torch.randn(257, 6, generator=g)
    ours, ref = Gaussian(mean, log_std), torch.distributions.Normal(mean, log_std.exp().expand_as(mean))
    assert torch.equal(ours.log_prob(actions), ref.log_prob(actions))
    assert torch.equal(ours.log_prob(actions).sum(-1), ref.log_prob(actions).sum(-1))
    assert torch.equal(ours.entropy().sum(-1), ref.entropy().sum(-1))
    assert torch.equal(ours.stddev, ref.stddev) and torch.equal(ours.mean, ref.mean)
    std = ref.stddev
    for rows in (1, 2, 257):   # under 16 elements torch fills normals one by one, above 16 at a time
        ours, ref = Gaussian(mean[:rows], log_std), torch.distributions.Normal(mean[:rows], std[:rows])
        torch.manual_seed(1)
        a = ours.sample()
        torch.manual_seed(1)
        assert torch.equal(a, ref.sample())   # same draws from the same RNG stream as Normal.sample


def test_gaussian_gradients_match_torch_normal():
    g = torch.Generator().manual_seed(2)
    actions = torch.randn(64, 3, generator=g)
    grads = []
    for make in (lambda m, s: Gaussian(m, s), lambda m, s: torch.distributions.Normal(m, s.exp().expand_as(m))):
        mean = torch.randn(64, 3, generator=torch.Generator().manual_seed(3)).requires_grad_()
        log_std = torch.full((3,), -0.3, requires_grad=True)
        pi = make(mean, log_std)
        (pi.log_prob(actions).sum(-1).mean() + 0.01 * pi.entropy().sum(-1).mean()).backward()
        grads.append((mean.grad, log_std.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-6, atol=1e-7)   # summation order only


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
