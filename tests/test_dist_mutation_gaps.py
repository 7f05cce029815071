"""Gaps found by the mutation audit of dist/verify.py, dist/buffers.py, dist/batches.py, dist/params.py and
dist/checksum.py: each test below fails on a hand-made mutation that every earlier test let through."""

import torch
from torch import nn

from dist.buffers import resolve_buffer_policy, sync_buffers
from dist.params import broadcast_module
from dist.plan import PlanRow
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
