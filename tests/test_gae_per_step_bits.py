"""ppo/gae.py's compute_gae against GAE's per-step recursion written from its definition: the same bits in float32
and float64, not only close."""

import pytest
import torch

from ppo.gae import compute_gae


def per_step_gae(rewards, values, dones, last_values, gamma, lam):
    """GAE as the per-step recursion from its definition, one step at a time, in the dtype of the inputs."""
    advantages, next_advantage, next_values = torch.empty_like(rewards), torch.zeros_like(last_values), last_values
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t].to(rewards.dtype)
        delta = rewards[t] + gamma * not_done * next_values - values[t]
        next_advantage = delta + gamma * lam * not_done * next_advantage
        advantages[t] = next_advantage
        next_values = values[t]
    return advantages


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gae_has_the_bits_of_the_per_step_recursion(dtype):
    """compute_gae precomputes delta and the decay for all steps, in the per-step recursion's operations and order:
    the advantages are the same bits, not only close (gamma 0.998 and lam 0.95 round differently in float32 when
    grouped as lam * (gamma * not_done)).

    Mutant: delta = rewards - values + gamma * not_done * next_values; decay = lam * (gamma * not_done)."""
    g = torch.Generator().manual_seed(7)
    rewards, values = torch.randn(32, 6, generator=g, dtype=dtype), torch.randn(32, 6, generator=g, dtype=dtype)
    dones, last = torch.rand(32, 6, generator=g) < 0.1, torch.randn(6, generator=g, dtype=dtype)
    advantages, returns = compute_gae(rewards, values, dones, last, 0.998, 0.95)
    expected = per_step_gae(rewards, values, dones, last, 0.998, 0.95)
    assert torch.equal(advantages, expected)
    assert torch.equal(returns, expected + values)
