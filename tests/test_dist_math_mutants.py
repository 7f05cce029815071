"""Tests that pin behaviour a manual mutation campaign found unpinned (dist/stats.py, dist/grad_sync.py). Expected
values are computed independently (by hand, or on one process over the concatenated data)."""

import pytest
import torch

from dist.grad_sync import GradSync
from dist.stats import reduce_metrics


def test_reduce_metrics_drops_a_key_of_zero_count_whatever_its_sum():
    """"Keys with a zero total count are dropped": by the count alone, also when the sum is not 0 (a sum of NaN-free
    junk with nothing counted is no mean; dividing by 0 must not be tried)."""
    out = reduce_metrics({"a": torch.tensor(3.0, dtype=torch.float64), "b": torch.tensor(5.0, dtype=torch.float64)},
                         {"a": torch.tensor(2.0, dtype=torch.float64), "b": torch.tensor(0.0, dtype=torch.float64)})
    assert out == {"a": 1.5}


def _grads_after_clip(mode: str, max_norm: float, scale: float):
    """One process (world size 1): the gradients of a small net after GradSync.clip_(max_norm), torch's
    clip_grad_norm_ on an identical copy, and both norms. `scale` multiplies the loss to set the gradient norm."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    ref.load_state_dict(net.state_dict())
    x = torch.randn(9, 5)
    # bucket_mb of 100 bytes: three buckets (bias and weight of the last layer share one), so the norm spans buckets
    sync = GradSync(net.parameters(), mode, bucket_mb=100 / 2**20)
    sync.zero_grad()
    sync.arm()
    (scale * net(x).square().mean()).backward()
    sync.synchronize()
    norm = sync.clip_(max_norm)
    (scale * ref(x).square().mean()).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    return sync, [p.grad.clone() for p in net.parameters()], [p.grad for p in ref.parameters()], norm, ref_norm


@pytest.mark.parametrize("mode", ["flat", "bucketed"])
@pytest.mark.parametrize("max_norm_over_norm", [10.0, 0.3])
@pytest.mark.parametrize("loss_scale", [1.0, 1e-4])
def test_clip_only_scales_down_and_equals_torch_clip_grad_norm(mode, max_norm_over_norm, loss_scale):
    """Below max_norm the gradient is left as it is (clip_grad_norm_'s clamp at 1: never scaled up); above, it is
    scaled by max_norm / (norm + 1e-6) as torch's clip_grad_norm_ does (visible at a tiny norm), over all buckets
    together; the returned norm is the one before clipping."""
    _, _, _, unclipped_norm, _ = _grads_after_clip(mode, float("inf"), loss_scale)
    max_norm = max_norm_over_norm * unclipped_norm.item()
    sync, grads, ref_grads, norm, ref_norm = _grads_after_clip(mode, max_norm, loss_scale)
    if mode == "bucketed":
        assert len(sync.buckets) == 3   # [12 + 84 bytes], [28], [140]: the cap is reached in each
    torch.testing.assert_close(norm, ref_norm)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    n = unclipped_norm.item()
    assert torch.isclose(total, torch.tensor(n * min(1.0, max_norm / (n + 1e-6))), rtol=1e-5)


@pytest.mark.parametrize("strides", [(4, 4, 1), (4, 100, 1)])
def test_a_parameter_with_a_size_1_dimension_is_dense_whatever_that_dimension_s_stride(strides):
    """A size-1 dimension's stride never addresses a second element: a contiguous [3, 1, 4] parameter (strides
    (4, 4, 1)) and one with any stride there fill 12 consecutive slots, so GradSync takes them, and their
    gradient is autograd's."""
    p = torch.nn.Parameter(torch.empty_strided((3, 1, 4), strides).copy_(torch.randn(3, 1, 4)))
    w = torch.randn(3, 1, 4)
    sync = GradSync([p])
    sync.zero_grad()
    sync.arm()
    (p * w).sum().backward()
    sync.synchronize()
    assert p.grad.stride() == strides
    torch.testing.assert_close(p.grad, w)
