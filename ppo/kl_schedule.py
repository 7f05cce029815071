"""Adaptive learning rate from the KL divergence between the rollout policy and the current one."""


def adaptive_lr(lr: float, kl: float, desired_kl: float, lr_min: float, lr_max: float) -> float:
    """Divide by 1.5 when kl > 2 * desired, multiply by 1.5 when 0 < kl < desired / 2, clamp to [lr_min, lr_max].

    A KL of exactly 0 leaves the LR: the policy has not moved from the one that collected the rollout (every
    update's first minibatch), which says nothing about the step size. RSL-RL 5.x's rule skips it too (its KL is
    exactly 0 there; RSL-RL <= 2 and legged_gym add 1e-5 inside the log, so their KL there is ~1e-5 per action
    and raises the LR).

    Every rank must pass the same `kl` (the global mean, see dist/) so every rank picks the same LR and
    optimizer states never drift apart; no LR broadcast is needed.
    """
    if kl > 2.0 * desired_kl:
        lr = lr / 1.5
    elif 0.0 < kl < 0.5 * desired_kl:
        lr = lr * 1.5
    return min(max(lr, lr_min), lr_max)
