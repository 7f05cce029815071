import math

import numpy as np
import pytest
import torch

from ppo.kl_schedule import adaptive_lr
from ppo.loss import gaussian_kl, ppo_loss


def test_ppo_loss_terms_match_hand_calculation():
    lp = torch.tensor([0.0, math.log(1.5), math.log(0.5)])        # ratios 1, 1.5, 0.5 vs old log-prob 0
    old = torch.zeros(3)
    adv = torch.tensor([1.0, 2.0, -1.0])
    v, old_v, ret = torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0.5, 0.5, 2.0]), torch.tensor([2.0, 0.0, 2.0])
    ent = torch.tensor([1.0, 2.0, 3.0])
    out = ppo_loss(lp, old, adv, v, old_v, ret, ent, clip_param=0.2, clip_value_loss=True,
                   value_loss_coef=0.5, entropy_coef=0.01)
    # surrogate per sample: -min(r*A, clip(r)*A): 1 -> -1; 1.5*2=3 vs 1.2*2=2.4 -> -2.4;
    # 0.5*-1=-0.5 vs 0.8*-1=-0.8 -> 0.8
    surrogate = np.mean([-1.0, -2.4, 0.8])
    # value: clipped = old + clip(v-old, +-0.2) = [0.7, 0.3, 2.2]
    # max((v-R)^2, (vc-R)^2): [max(1, 1.69), max(0, 0.09), max(1, 0.04)] = [1.69, 0.09, 1.0]
    value = np.mean([1.69, 0.09, 1.0])
    entropy = 2.0
    assert math.isclose(out["surrogate"].item(), surrogate, rel_tol=1e-6)
    assert math.isclose(out["value_function"].item(), value, rel_tol=1e-6)
    assert math.isclose(out["entropy"].item(), entropy, rel_tol=1e-6)
    assert math.isclose(out["loss"].item(), surrogate + 0.5 * value - 0.01 * entropy, rel_tol=1e-6)

    unclipped = ppo_loss(lp, old, adv, v, old_v, ret, ent, 0.2, False, 0.5, 0.01)
    assert math.isclose(unclipped["value_function"].item(), np.mean([1.0, 0.0, 1.0]), rel_tol=1e-6)


def test_clip_fraction_counts_the_ratios_beyond_the_clip_range_on_both_sides():
    """Ratios 1, 1.5, 0.5, 1.1, 0.85 with clip 0.2: 1.5 and 0.5 lie outside [0.8, 1.2], so 2 of 5, whatever the sign
    of the advantage (CleanRL's clipfrac); it carries no gradient.
    Mutant: clip_fraction counting only ratios above 1 + clip_param (no abs): 1 of 5."""
    ratios = torch.tensor([1.0, 1.5, 0.5, 1.1, 0.85])
    lp = ratios.log().requires_grad_()
    zeros, ones = torch.zeros(5), torch.ones(5)
    out = ppo_loss(lp, zeros, torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0]), ones, ones, ones, ones, 0.2, False, 0.5, 0.0)
    assert out["clip_fraction"].item() == pytest.approx(2 / 5)
    assert not out["clip_fraction"].requires_grad


def test_clip_fraction_does_not_count_a_ratio_exactly_on_the_clip_boundary():
    """Beyond 1 +- clip_param means strictly beyond (CleanRL's `(ratio - 1).abs() > clip_coef`). Ratios e^0.25,
    e^0.5 and e^0.1 (float64), with clip_param set to the first ratio minus 1 as torch computes it (not math.exp,
    which may differ from torch's exp in the last bit): the first sits on the boundary and does not count, only e^0.5
    does: 1 of 3. Ratio 1 with clip_param 0 is not clipped either.
    Mutant: `>` -> `>=` in clip_fraction (counts the boundary samples: 2 of 3, and 1 of 1 at clip 0)."""
    lp = torch.tensor([0.25, 0.5, 0.1], dtype=torch.float64)
    zeros, ones = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    clip = torch.exp(lp)[0].item() - 1.0      # the ratio ppo_loss computes from these log-probs (the old ones 0)
    out = ppo_loss(lp, zeros, ones, ones, ones, ones, ones, clip, False, 0.5, 0.0)
    assert out["clip_fraction"].item() == pytest.approx(1 / 3)
    one = torch.zeros(1, dtype=torch.float64)
    assert ppo_loss(one, one, one, one, one, one, one, 0.0, False, 0.5, 0.0)["clip_fraction"].item() == 0.0


def test_gaussian_kl_matches_torch_distributions():
    torch.manual_seed(0)
    mu0, mu1 = torch.randn(5, 3), torch.randn(5, 3)
    s0, s1 = torch.rand(5, 3) + 0.1, torch.rand(5, 3) + 0.1
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(mu0, s0), torch.distributions.Normal(mu1, s1))
    torch.testing.assert_close(gaussian_kl(mu0, s0, mu1, s1), ref.sum(-1))


def test_adaptive_lr_rule():
    assert adaptive_lr(1e-3, kl=0.05, desired_kl=0.01, lr_min=1e-5, lr_max=1e-2) == 1e-3 / 1.5
    assert adaptive_lr(1e-3, kl=0.001, desired_kl=0.01, lr_min=1e-5, lr_max=1e-2) == 1e-3 * 1.5
    assert adaptive_lr(1e-3, kl=0.01, desired_kl=0.01, lr_min=1e-5, lr_max=1e-2) == 1e-3
    assert adaptive_lr(1e-3, kl=0.02, desired_kl=0.01, lr_min=1e-5, lr_max=1e-2) == 1e-3   # boundary: not above 2x
    assert adaptive_lr(1e-5, kl=1.0, desired_kl=0.01, lr_min=1e-5, lr_max=1e-2) == 1e-5     # bounded below
    assert adaptive_lr(9e-3, kl=1e-4, desired_kl=0.01, lr_min=1e-5, lr_max=1e-2) == 1e-2    # bounded above
    # KL exactly 0: the policy has not moved (every update's first minibatch); no evidence, no change (RSL-RL's rule)
    assert adaptive_lr(1e-3, kl=0.0, desired_kl=0.01, lr_min=1e-5, lr_max=1e-2) == 1e-3
    assert adaptive_lr(1e-3, kl=1e-300, desired_kl=0.01, lr_min=1e-5, lr_max=1e-2) == 1e-3 * 1.5


def test_ppo_loss_refuses_values_of_shape_b_1():
    """A critic's [B, 1] output minus [B] returns would broadcast to [B, B]: a wrong value loss, silently."""
    b = torch.zeros(4)
    ppo_loss(b, b, b, b, b, b, b, 0.2, True, 0.5, 0.0)
    try:
        ppo_loss(b, b, b, b[:, None], b[:, None], b, b, 0.2, True, 0.5, 0.0)
    except ValueError as exc:
        assert "[B]" in str(exc) and "(4, 1)" in str(exc)
    else:
        raise AssertionError("values of shape [B, 1] were accepted")


@pytest.mark.parametrize("position", range(7))
def test_ppo_loss_refuses_a_b_1_tensor_in_any_one_of_its_seven_inputs(position):
    """Each input alone is checked: returns or advantages of shape [B, 1] would broadcast against [B] values or ratios
    to [B, B] (a wrong loss, silently), and the docstring promises every input is [B]."""
    inputs = [torch.zeros(4) for _ in range(7)]
    inputs[position] = torch.zeros(4, 1)
    with pytest.raises(ValueError, match=r"shape \[B\].*\(4, 1\)"):
        ppo_loss(*inputs, 0.2, True, 0.5, 0.01)


def test_ppo_loss_refuses_seven_inputs_all_of_shape_b_1():
    """The docstring promises [B] inputs; seven [B, 1] tensors agree in shape with each other but are not [B]."""
    inputs = [torch.zeros(4, 1) for _ in range(7)]
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        ppo_loss(*inputs, 0.2, True, 0.5, 0.01)


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


def test_ppo_loss_refuses_seven_inputs_of_one_shape_other_than_b():
    """Equal shapes are not enough: [B, 1] everywhere (an unsqueezed critic and unsummed log-probs) is refused too,
    as the docstring says: every input is [B]."""
    for shape in ((4, 1), ()):
        t = torch.zeros(shape)
        with pytest.raises(ValueError, match=r"shape \[B\]"):
            ppo_loss(t, t, t, t, t, t, t, 0.2, True, 0.5, 0.0)


def test_gaussian_kl_sums_over_the_last_dim_whatever_the_leading_dims():
    """Mutant: `.sum(-1)` -> `.sum(1)` in gaussian_kl (the same for [B, A], not for [T, B, A]).
    The action dims are the last: a [2, 3, 4] batch gives [2, 3] KLs, each row's equal to that [3, 4] slice's
    KL (torch.distributions, summed over the last dim)."""
    g = torch.Generator().manual_seed(3)
    mu0, mu1 = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    s0, s1 = torch.rand(2, 3, 4, generator=g) + 0.1, torch.rand(2, 3, 4, generator=g) + 0.1
    kl = gaussian_kl(mu0, s0, mu1, s1)
    assert kl.shape == (2, 3)
    for t in range(2):
        ref = torch.distributions.kl_divergence(torch.distributions.Normal(mu0[t], s0[t]),
                                                torch.distributions.Normal(mu1[t], s1[t])).sum(-1)
        torch.testing.assert_close(kl[t], ref)
