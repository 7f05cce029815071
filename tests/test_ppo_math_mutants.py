"""Tests that pin behaviour a manual mutation campaign found unpinned (ppo/loss.py, ppo/gae.py, ppo/normalizer.py,
ppo/update.py). Expected values are computed independently (by hand, numpy or torch.distributions)."""

import pytest
import torch

from ppo.loss import ppo_loss


def test_ppo_loss_refuses_seven_inputs_all_of_shape_b_1():
    """The docstring promises [B] inputs; seven [B, 1] tensors agree in shape with each other but are not [B]."""
    inputs = [torch.zeros(4, 1) for _ in range(7)]
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        ppo_loss(*inputs, 0.2, True, 0.5, 0.01)
