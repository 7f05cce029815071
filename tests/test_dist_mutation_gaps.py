"""Gaps found by the mutation audits of dist/verify.py, dist/buffers.py, dist/batches.py, dist/params.py,
dist/checksum.py, dist/stats.py and dist/grad_sync.py: each test below fails on a hand-made mutation that every earlier
test let through. Expected values are computed independently (by hand, or torch's own clip_grad_norm_)."""

import pytest
import torch
from torch import nn

from dist.buffers import resolve_buffer_policy, sync_buffers
from dist.grad_sync import GradSync
from dist.params import broadcast_module
from dist.plan import PlanRow
from dist.stats import reduce_metrics
from dist.verify import verify_plan_rows


def test_a_replica_check_every_iteration_has_its_plan_row():
    """--dist.verify-every 1 checks the replicas after every iteration: the plan (compared with the ledger after a
    run) must hold its 8-byte all-gather with every=1, not only for K > 1."""
    assert verify_plan_rows(1, False) == [PlanRow("checksum", "all ranks equal rank 0", "all_gather", "every", [8],
                                                  every=1)]


class Wide(nn.Module):
    """float64 and int64 state whose values have no float32 twin (2**53 + 2 and 1 + 2**-40)."""
    BUFFER_POLICY = {"b_*": "broadcast", "m_*": "mean"}

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor([1 + 2**-40, -3.0], dtype=torch.float64))
        self.register_buffer("b_double", torch.tensor([1 + 2**-40, 2.0**53 + 2], dtype=torch.float64))
        self.register_buffer("b_steps", torch.tensor([2**53 + 1], dtype=torch.int64))
        self.register_buffer("m_double", torch.tensor([1 - 2**-45], dtype=torch.float64))


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in [*m.named_parameters(), *m.named_buffers()]}


def test_buffer_sync_keeps_every_bit_and_dtype_of_float64_and_int64_buffers():
    """Normalizer statistics are float64 and step counters int64: the coalesced tensor must travel in the buffers'
    own dtype, or a round trip through float32 rounds them (here on one rank, where the values must come back
    exactly as they were)."""
    m = Wide()
    before = _state(m)
    sync_buffers(m, resolve_buffer_policy(m, m.BUFFER_POLICY))
    after = _state(m)
    for name, value in before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name


def test_the_start_up_broadcast_keeps_every_bit_and_dtype_of_float64_and_int64_tensors():
    """broadcast_module coalesces per dtype: a float64 parameter or an int64 counter must not pass through float32
    (on one rank every tensor must come back bit for bit)."""
    m = Wide()
    before = _state(m)
    broadcast_module(m)
    after = _state(m)
    for name, value in before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name


def test_names_checksum_separates_the_names_so_a_shifted_boundary_differs():
    """Ranks compare lists of names (metric keys packed into one all-reduce, a model's layout) by one checksum of
    their UTF-8 bytes, one name per line: ["ab", "c"] and ["a", "bc"] are different lists and must not agree, and
    the checksum is that of the bytes b"ab\\nc"."""
    from dist.checksum import checksum
    from dist.verify import names_checksum

    assert names_checksum(["ab", "c"]) != names_checksum(["a", "bc"])
    assert names_checksum(["loss", "kl"]) != names_checksum(["los", "skl"])
    assert torch.equal(names_checksum(["ab", "c"]),
                       checksum([torch.tensor([0x61, 0x62, 0x0A, 0x63], dtype=torch.uint8)]))


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
