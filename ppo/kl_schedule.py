"""Adaptive learning rate from the KL divergence between the rollout policy and the current one."""


def adaptive_lr(lr: float, kl: float, desired_kl: float, lr_min: float, lr_max: float) -> float:
    """Divide by 1.5 when kl > 2 * desired, multiply by 1.5 when kl < desired / 2, clamp to [lr_min, lr_max].

    Every rank must pass the same `kl` (the global mean, see dist/) so every rank picks the same LR and
    optimizer states never drift apart; no LR broadcast is needed.
    """
    if kl > 2.0 * desired_kl:
        lr = lr / 1.5
    elif kl < 0.5 * desired_kl:
        lr = lr * 1.5
    return min(max(lr, lr_min), lr_max)
