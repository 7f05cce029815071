"""Generalized advantage estimation over a rank-local [T, N] rollout. No communication."""

import torch


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, last_values: torch.Tensor,
                gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns, each [T, N].

    rewards, values, dones: [T, N]; last_values: [N] = V(obs after the last step).
    `dones` marks both terminations and time-outs: the next observation belongs to a new episode, so
    neither bootstraps from it. dones[t] is the flag step t returned, in its row (CleanRL keeps it one row
    later, with its obs: pass torch.cat([dones[1:], next_done[None]]); its own dones[0] is not used).
    A time-out's bootstrap, gamma * V(final obs), must already be folded into its reward by the caller
    (computed at collection time, added by fill_storage); a termination has none.
    Shapes that do not match raise: a critic's [T, N, 1] values (or [N, 1] last values) would broadcast against the
    [N] rewards of a step to [N, N].
    """
    if values.shape != rewards.shape or dones.shape != rewards.shape or last_values.shape != rewards.shape[1:]:
        raise ValueError(f"compute_gae expects rewards, values and dones of shape [T, N] and last_values [N] (squeeze "
                         f"the critic's last dim), got {list(rewards.shape)}, {list(values.shape)}, "
                         f"{list(dones.shape)} and {list(last_values.shape)}")
    # Everything but the recursion at once, for all T (a third of the kernels of a per-step loop; same operations in
    # the same order, so the same bits).
    not_done = 1.0 - dones.to(rewards.dtype)  # float64 inputs keep gamma's digits
    next_values = torch.cat([values[1:], last_values[None]])
    delta = rewards + gamma * not_done * next_values - values
    decay = gamma * lam * not_done
    advantages = torch.empty_like(rewards)
    next_advantage = torch.zeros_like(last_values)
    for t in reversed(range(rewards.shape[0])):
        next_advantage = delta[t] + decay[t] * next_advantage
        advantages[t] = next_advantage
    return advantages, advantages + values


def bootstrap_time_outs(reward: torch.Tensor, truncated: torch.Tensor, final_critic_obs: torch.Tensor, value_fn,
                        gamma: float) -> torch.Tensor:
    """reward + gamma * V(final obs) on the envs that timed out (`truncated`, [N] bool); others unchanged.

    Every row flagged in `truncated` is bootstrapped: pass `truncated & ~terminated` (gymnasium may flag a
    step both; that is a termination, never bootstrapped). CleanRL bootstraps no time-out.

    On CPU the critic runs only on the timed-out rows (usually a few percent of N, so most of the
    forward is saved). On an accelerator it runs on all N rows and keeps the timed-out ones: picking the
    rows needs their count on the host, a device sync per env step that costs more than the whole small forward.
    `value_fn` maps [rows, critic obs dim] to [rows] values (a critic's [rows, 1] is refused: on an accelerator it
    broadcast against [N] to an [N, N] reward).
    """
    if reward.device.type != "cpu":
        # Selected, not multiplied by the mask: 0 * V is nan where V is not finite (the final observation of an env
        # that terminated, e.g. a simulator that blew up there), which the CPU path never evaluates.
        values = _one_per_row(value_fn(final_critic_obs), final_critic_obs.shape[0])
        return torch.where(truncated, reward + gamma * values.to(reward.dtype), reward)
    ids = truncated.nonzero().squeeze(-1)
    if ids.numel() == 0:
        return reward
    # A bfloat16 policy copy (--rollout.dtype) gives bfloat16 values: index_add does not promote them as + does,
    # and gamma multiplies them in the rewards' dtype, as on an accelerator above.
    values = _one_per_row(value_fn(final_critic_obs.index_select(0, ids)), ids.shape[0])
    return reward.index_add(0, ids, gamma * values.to(reward.dtype))


def _one_per_row(values: torch.Tensor, rows: int) -> torch.Tensor:
    """`values` if it is [rows] (a shape check: no host sync), else a ValueError naming the fix."""
    if values.shape != (rows,):
        raise ValueError(f"bootstrap_time_outs: value_fn must return one value per row, [{rows}] (squeeze the "
                         f"critic's last dim), got {list(values.shape)}")
    return values
