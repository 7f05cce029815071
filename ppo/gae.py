"""Generalized advantage estimation over a rank-local [T, N] rollout. No communication."""

import torch


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, last_values: torch.Tensor,
                gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns, each [T, N].

    rewards, values, dones: [T, N]; last_values: [N] = V(obs after the last step).
    `dones` marks both terminations and time-outs: the next observation belongs to a new episode, so
    neither bootstraps from it. A time-out's bootstrap, gamma * V(final obs), must already be folded
    into its reward by the caller (the runner does this at collection time); a termination has none.
    """
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(last_values)
    next_values = last_values
    for t in reversed(range(num_steps)):
        not_done = 1.0 - dones[t].float()
        delta = rewards[t] + gamma * not_done * next_values - values[t]
        next_advantage = delta + gamma * lam * not_done * next_advantage
        advantages[t] = next_advantage
        next_values = values[t]
    return advantages, advantages + values
