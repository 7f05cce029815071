"""PPO loss terms for a Gaussian policy. Pure functions of tensors: copy this file anywhere."""

import torch


def ppo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
             values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, entropy: torch.Tensor,
             clip_param: float, clip_value_loss: bool, value_loss_coef: float,
             entropy_coef: float) -> dict[str, torch.Tensor]:
    """Clipped surrogate + (optionally clipped) value loss - entropy bonus, each a batch mean.

    All inputs are [B] (log-probs and entropies summed over action dims; values squeezed, not [B, 1]:
    other shapes raise, since [B, 1] - [B] would broadcast to [B, B]). Advantages are used as given
    (normalize them before, e.g. per minibatch as CleanRL does). Returns the terms and their weighted sum
    `loss` = surrogate + value_loss_coef * value_function - entropy_coef * entropy, all still attached
    to the graph (detach them for logging). `surrogate` is the negated clipped objective (a loss);
    `value_function` is the mean squared error, clipped to old_values +- clip_param when
    `clip_value_loss`, with no factor 1/2 (as RSL-RL): CleanRL's `vf_coef` c is value_loss_coef = c / 2.
    Also `clip_fraction` (no gradient): the share of samples whose ratio lies beyond 1 +- clip_param, as
    CleanRL's `clipfrac`; near 0 the clip never acts, a large share says the steps are too big for clip_param.
    """
    inputs = (log_prob, old_log_prob, advantages, values, old_values, returns, entropy)
    if len({t.shape for t in inputs}) != 1 or log_prob.dim() != 1:
        raise ValueError(f"ppo_loss expects 7 tensors of shape [B] (log_prob, old_log_prob, advantages, values, "
                         f"old_values, returns, entropy), got {[tuple(t.shape) for t in inputs]}")
    ratio = torch.exp(log_prob - old_log_prob)
    surrogate = -torch.min(ratio * advantages, ratio.clamp(1.0 - clip_param, 1.0 + clip_param) * advantages).mean()
    if clip_value_loss:
        clipped = old_values + (values - old_values).clamp(-clip_param, clip_param)
        value_loss = torch.max((values - returns).square(), (clipped - returns).square()).mean()
    else:
        value_loss = (values - returns).square().mean()
    entropy = entropy.mean()
    loss = surrogate + value_loss_coef * value_loss - entropy_coef * entropy
    clip_fraction = ((ratio.detach() - 1.0).abs() > clip_param).to(ratio.dtype).mean()
    return {"loss": loss, "surrogate": surrogate, "value_function": value_loss, "entropy": entropy,
            "clip_fraction": clip_fraction}


def gaussian_kl(mu_old: torch.Tensor, sigma_old: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """KL(old || new) per sample [B], summed over action dims, for diagonal Gaussians."""
    return (torch.log(sigma / sigma_old) + (sigma_old.square() + (mu_old - mu).square()) / (2.0 * sigma.square())
            - 0.5).sum(-1)
