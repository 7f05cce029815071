"""Tests that kill mutants of dist/checksum.py which the other checksum tests let survive: each against the
independent reference in test_checksum_reference.py (plain Python integers)."""

import pytest
import torch

from test_checksum_reference import REF_P, REF_ROW, _ref_weights, ref_tensor_checksum


@pytest.mark.parametrize("byte", [127, -128])
@pytest.mark.parametrize("lanes", [REF_ROW, 4096])
def test_one_row_of_extreme_bytes_stays_exact_on_the_one_row_host_path(byte, lanes):
    """A tensor of at most one row (2**14 lanes) on the host takes numpy's one-row path (headers, tables, small
    tensors). With every lane at an int8 bound its weighted sum reaches about 2**14 * 128 * 2**24 = 2**52, so it
    must be reduced mod P before it is multiplied by the 31-bit row weight (else the product passes 2**63 and wraps
    in int64). By hand from the reference weights: byte * sum(W[s]) mod P, times H[0], mod P, per seed.
    Mutant: `(x @ w) * h % P` (no `% P` before the row weight) in tensor_checksum's one-row path."""
    from dist.checksum import tensor_checksum
    t = torch.full((lanes,), byte, dtype=torch.int8)
    w, h = _ref_weights(REF_ROW, 24, 0), _ref_weights(1, 31, 1 << 40)[0]
    parts = [(byte * sum(pair[k] for pair in w[:lanes])) % REF_P * h[k] % REF_P for k in range(2)]
    assert parts == [p for p in divmod(ref_tensor_checksum(t), 2**31)]
    assert int(tensor_checksum(t)) == parts[0] * 2**31 + parts[1]
