"""Single-process pieces of sync/ and dist/checksum: encodings against sizes computed with numpy, frame
layout, the checksum against a numpy reference, shifted writes, incremental updates, zstd, key helpers; and the
smallest encoding by exact size near the gap / bitmap crossover, worked out by hand."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from dist.checksum import ROW, P, checksum, tensor_checksum, update_checksum, weights
from sync import SyncIntegrityError, trainable_keys
from sync.encodings import BITMAP, DENSE, GAP_DTYPES, _bits, _changes, _decode, _encode
from sync.wire import GAPS8, GAPS16, GAPS32, _check_table, layout, zstd_compress, zstd_decompress


def _numpy_sizes(positions: np.ndarray, n: int, v: int) -> dict:
    """Exact payload bytes of every encoding, computed independently of sync/encodings.py."""
    gaps = np.diff(np.concatenate([[-1], positions])) - 1
    sizes = {DENSE: n * v, BITMAP: math.ceil(n / 8) + len(positions) * v}
    for code, width in zip(GAP_DTYPES, (1, 2, 4)):
        escape = 2 ** (8 * width) - 1
        sizes[code] = (len(positions) + int((gaps // escape).sum())) * width + len(positions) * v
    return sizes


@pytest.mark.parametrize("density", [0.0001, 0.001, 0.004, 0.03, 0.2, 0.6, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoding_is_the_smallest_and_round_trips(density, dtype):
    g = torch.Generator().manual_seed(0)
    n = 200_003
    current = torch.randn(n, generator=g).to(dtype)
    mask = torch.rand(n, generator=g) < density
    mask[-1] = density == 1.0 or bool(mask[-1])
    positions = mask.nonzero().view(-1)
    encoding, parts, _ = _encode(current, mask, positions.numel())
    sizes = _numpy_sizes(positions.numpy(), n, current.element_size())
    assert sum(p.numel() * p.element_size() for p in parts) == min(sizes.values())
    assert sizes[encoding] == min(sizes.values())
    if encoding != DENSE:
        index, flags = _decode(parts[0], encoding, n)
        assert torch.equal(index, positions) and not any(bool(f) for f in flags)
        assert torch.equal(_bits(parts[1]), _bits(current[positions]))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 200_003])
@pytest.mark.parametrize("density", [0.0, 0.0005, 0.01, 0.05, 0.3, 1.0])
def test_changes_are_counted_and_collected_like_nonzero(n, density):
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < density
    count, index = _changes(mask)
    positions = mask.nonzero().view(-1)
    assert count == positions.numel()
    if density <= 0.01:       # few changes: collected in the counting pass
        assert index is not None
    if index is not None:
        assert torch.equal(index, positions)


def test_gap_escapes_by_hand():
    mask = torch.zeros(70_000, dtype=torch.bool)
    mask[[3, 300, 70_000 - 1]] = True  # gaps 3, 296, 69698
    encoding, parts, _ = _encode(torch.zeros(70_000), mask, 3)
    # 1-byte symbols: 3 | 255 41 | 255 x 273, 83 -> 277 bytes; 2-byte: 3, 296, 65535, 4163 -> 8 bytes.
    assert encoding == 1 and parts[0].numel() == 4
    index, _ = _decode(parts[0], encoding, 70_000)
    assert index.tolist() == [3, 300, 69_999]
    index, flags = _decode(parts[0], encoding, 69_999)  # the last position is outside a shorter tensor
    assert any(bool(f) for f in flags)
    assert index.tolist() == [3, 300, 69_998]    # flagged, and clamped: nothing reads past the end


@pytest.mark.parametrize("escapes", [False, True])
def test_a_gap_past_the_end_is_flagged_and_clamped(escapes):
    """A corrupted gap must not make the receiver index outside the tensor before it checks the flags."""
    changed = [*range(10), 300] if escapes else [200, 290]   # a gap of 290 needs one escape in 1-byte symbols
    mask = torch.zeros(301, dtype=torch.bool)
    mask[changed] = True
    encoding, parts, _ = _encode(torch.zeros(301), mask, len(changed))
    assert encoding == min(GAP_DTYPES) and (parts[0].numel() > len(changed)) == escapes
    index, flags = _decode(parts[0], encoding, 301)
    assert index.tolist() == changed and not any(bool(f) for f in flags)
    corrupted = parts[0].clone()
    corrupted[-1] = 254                           # the last gap grows past the end of the tensor
    index, flags = _decode(corrupted, encoding, 301)
    assert any(bool(f) for f in flags)
    assert index[:-1].tolist() == changed[:-1] and index[-1] == 300


def test_layout_puts_wider_elements_first_so_views_are_aligned():
    specs = [(torch.uint8, 3), (torch.float32, 2), (torch.int16, 1), (torch.float64, 1)]
    order, offsets, total = layout(specs)
    assert order == [3, 1, 2, 0] and offsets == [18, 8, 16, 0] and total == 21


def _numpy_checksum(t: torch.Tensor) -> int:
    raw = t.contiguous().view(-1).view(torch.uint8).numpy()  # the bytes, whatever the dtype
    lanes = raw.view(np.int8).astype(np.int64)
    rows = -(-lanes.size // ROW)
    w, h = weights(ROW, 24), weights(rows, 31, offset=1 << 40)
    parts = []
    for k in range(2):
        total = 0
        for r in range(rows):
            part = lanes[r * ROW:(r + 1) * ROW]
            total = (total + int((part * w[:part.size, k]).sum()) % P * int(h[r, k])) % P
        parts.append(total)
    return parts[0] * 2**31 + parts[1]


@pytest.mark.parametrize("t", [torch.randn(3 * ROW + 5), torch.randn(7).bfloat16(), torch.rand(33) < 0.5,
                               torch.randint(-9, 9, (5, 4)), torch.randn(ROW // 2), torch.randn(ROW // 2 + 1)],
                         ids=["fp32", "bf16", "bool", "int64", "one row", "one row and a lane"])
def test_checksum_matches_a_numpy_reference(t):
    assert int(tensor_checksum(t)) == _numpy_checksum(t)


def test_checksum_catches_shifted_and_permuted_writes():
    a, b = torch.zeros(50, dtype=torch.bool), torch.zeros(50, dtype=torch.bool)
    a[[5, 12]], b[[7, 10]] = True, True  # equal under linear position weights (5 + 12 == 7 + 10)
    assert int(tensor_checksum(a)) != int(tensor_checksum(b))
    g = torch.Generator().manual_seed(0)
    t = torch.randn(5000, generator=g)
    base = int(tensor_checksum(t))
    seen = {base}
    for shift in range(1, 20):  # a block of values written shift places off
        moved = t.clone()
        moved[100 + shift:200 + shift] = t[100:200]
        seen.add(int(tensor_checksum(moved)))
    for _ in range(20):
        seen.add(int(tensor_checksum(t[torch.randperm(5000, generator=g)])))
    assert len(seen) == 40
    zero, negative_zero = t.clone(), t.clone()
    zero[-1], negative_zero[-1] = 0.0, -0.0
    assert int(tensor_checksum(zero)) != int(tensor_checksum(negative_zero))


def test_checksum_updates_from_changed_elements_alone():
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.int64):
        old = ((torch.randn(5 * ROW, generator=g) > 0) if dtype == torch.bool
               else torch.randn(5 * ROW, generator=g).to(dtype))
        index = torch.randperm(old.numel(), generator=g)[:300].sort().values
        new = old.clone()
        new[index] = ~old[index] if dtype == torch.bool else (old[index] + 1).to(dtype)
        assert int(update_checksum(tensor_checksum(old), index, old[index], new[index], old.numel())) == \
            int(tensor_checksum(new))
    # Changes in the first row only of a tensor of many rows (and of one partial row): rows beyond them add 0.
    for numel in (7 * ROW + 5, 5):
        old = torch.randn(numel, generator=g)
        index = torch.tensor([0, numel - 1]) if numel < ROW else torch.tensor([1, 2])
        new = old.clone()
        new[index] += 1
        assert int(update_checksum(tensor_checksum(old), index, old[index], new[index], numel)) == \
            int(tensor_checksum(new))
    # The largest change in every lane of whole rows: per-row sums at their bound stay exact.
    for dtype in (torch.int16, torch.int64):
        old = torch.full((2 * ROW,), -128, dtype=torch.int8).view(dtype)
        new = torch.full((2 * ROW,), 127, dtype=torch.int8).view(dtype)
        index = torch.arange(old.numel())
        assert int(update_checksum(tensor_checksum(old), index, old, new, old.numel())) == int(tensor_checksum(new))


def test_checksum_of_many_tensors_matches_a_numpy_reference():
    tensors = [torch.randn(ROW + 3), torch.arange(5), torch.rand(9) < 0.5]
    w = weights(len(tensors), 31, offset=1 << 50)
    parts = [sum(divmod(_numpy_checksum(t), 2**31)[k] * int(w[i, k]) for i, t in enumerate(tensors)) % P
             for k in range(2)]
    assert int(checksum(tensors)) == parts[0] * 2**31 + parts[1]


def test_checksum_of_many_tensors_is_order_sensitive():
    a, b = torch.randn(10), torch.randn(10)
    assert int(checksum([a, b])) != int(checksum([b, a]))
    assert int(checksum([a, b])) == int(checksum([a.clone(), b.clone()]))
    assert int(tensor_checksum(torch.zeros(0, 3))) == 0


def test_zstd_round_trip_and_damage():
    payload = torch.arange(10_000, dtype=torch.int32).view(torch.uint8)
    packed = zstd_compress(payload)
    assert packed.numel() < payload.numel() and torch.equal(zstd_decompress(packed, payload.numel()), payload)
    with pytest.raises(SyncIntegrityError, match="header announced|could not decompress"):
        zstd_decompress(packed, payload.numel() - 1)


def test_trainable_keys_leave_out_frozen_parameters_only():
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    net[0].weight.requires_grad_(False)
    assert trainable_keys(net) == ["0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                                   "1.num_batches_tracked"]


@pytest.mark.parametrize("density", [0.0005, 0.03, 0.3, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64])
def test_device_kernels_match_the_host_kernels(monkeypatch, density, dtype):
    """The torch code that GPUs run (mask, positions, bit packing) gives the host's numpy results bit for bit."""
    import sync.encodings as patch
    g = torch.Generator().manual_seed(3)
    n = 100_003
    old = (torch.rand(n, generator=g) < 0.5) if dtype == torch.bool else torch.randn(n, generator=g).to(dtype)
    flip = torch.rand(n, generator=g) < density
    new = torch.where(flip, ~old if dtype == torch.bool else (old + 1).to(dtype), old)
    results = []
    for host_numpy in (True, False):
        monkeypatch.setattr(patch, "HOST_NUMPY", host_numpy)
        mask = patch._differ(new, old, torch.empty(n, dtype=torch.bool))
        count, index = _changes(mask)
        encoding, parts, _ = _encode(new, mask, count, index)
        decoded = _decode(parts[0], encoding, n)[0] if encoding != DENSE else None
        results.append((mask, count, encoding, parts, decoded))
    (mask, count, encoding, parts, decoded), other = results
    assert torch.equal(mask, flip) and count == int(flip.sum())
    assert torch.equal(other[0], mask) and other[1:3] == (count, encoding)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(parts, other[3]))
    if decoded is not None:
        assert torch.equal(decoded, flip.nonzero().view(-1)) and torch.equal(other[4], decoded)


def test_malformed_table_rows_are_refused():
    """Every row must name a next tensor and sizes its encoding allows, before anything is allocated."""
    numels = [10, 100, 1000]
    valid = [[0, 10, DENSE, 0], [1, 3, BITMAP, 13], [2, 4, GAPS8, 6]]
    _check_table(torch.tensor(valid), numels)
    _check_table(torch.zeros(0, 4, dtype=torch.int64), numels)
    for bad in ([3, 1, DENSE, 0], [0, 10, DENSE, 0],   # names no tensor; repeats one
                [1, 99, DENSE, 0], [1, 100, DENSE, 1],
                [1, 3, BITMAP, 12], [1, 100, BITMAP, 13], [1, 0, BITMAP, 13],
                [2, 0, GAPS8, 0], [2, 5, GAPS8, 4], [2, 1000, GAPS16, 1000], [2, 4, GAPS32, 2**40],
                [2, 4, 9, 6]):                     # unknown encoding
        rows = valid[:1] + [bad]
        with pytest.raises(SyncIntegrityError, match="malformed table row"):
            _check_table(torch.tensor(rows), numels)


def test_a_bitmap_bit_in_the_first_padding_position_is_flagged():
    """Mutant: the padding check started one bit late (`bits[numel + 1:]`), so a bit set at position `numel`
    (the first past the tensor) passed. 10 elements take 2 bytes; byte 1 bit 2 is element 10, outside."""
    index, flags = _decode(torch.tensor([0b10, 0b110], dtype=torch.uint8), BITMAP, 10)  # bits 1, 9, 10
    assert index.tolist() == [1, 9] and any(bool(f) for f in flags)
    index, flags = _decode(torch.tensor([0b10, 0b10], dtype=torch.uint8), BITMAP, 10)   # bits 1, 9 only
    assert index.tolist() == [1, 9] and not any(bool(f) for f in flags)


def test_trainable_keys_leave_out_a_frozen_parameter_under_every_name_it_has():
    """Mutant: trainable_keys listed parameters with duplicates removed, so a frozen module used twice was
    frozen under its first name only and its second state_dict key counted as trainable (sent by every sync)."""
    shared = nn.Linear(2, 2)
    shared.weight.requires_grad_(False)
    net = nn.Sequential(shared, shared)          # state_dict: 0.weight, 0.bias, 1.weight, 1.bias
    assert list(net.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert trainable_keys(net) == ["0.bias", "1.bias"]


def _nbytes(parts) -> int:
    return sum(p.numel() * p.element_size() for p in parts)


@pytest.mark.parametrize("step, count", [(10, 100), (8, 124)], ids=["25-bytes-under", "1-byte-under"])
def test_one_byte_gaps_win_whenever_they_are_smaller_than_the_bitmap(step, count):
    """1000 float32 elements, every `step`-th changed from 0 (gaps of step - 1 < 255: no escapes). By definition:
    1-byte gaps cost count + 4 count bytes, a bitmap 125 + 4 count, 2-byte gaps 2 count + 4 count, dense 4000.
    count=100: 1-byte gaps 500 < bitmap 525 < 2-byte gaps 600; count=124 (0..984): 620 < bitmap 621 < 744.
    Mutant: gap sizes were worked out only when the smaller of dense and bitmap exceeds count * (2 + v) rather
    than count * (1 + v), so here the bitmap (the larger) was sent."""
    positions = list(range(0, 1000, step))[:count]
    mask = torch.zeros(1000, dtype=torch.bool)
    mask[positions] = True
    current = torch.arange(1000, dtype=torch.float32)
    encoding, parts, _ = _encode(current, mask, count)
    assert encoding == GAPS8
    assert _nbytes(parts) == count + 4 * count < 125 + 4 * count
    assert parts[0].tolist() == [0] + [step - 1] * (count - 1)
    assert _decode(parts[0], GAPS8, 1000)[0].tolist() == positions


def test_a_gap_encoding_pays_for_its_values_too_when_compared_with_the_bitmap():
    """8000 int8 elements (1 byte each), 990 changed: 27 after gaps of exactly 255 (positions 255, 511, ..., 6911:
    each gap one escape and a 0 in 1-byte gaps), then 963 adjacent ones (6912..7874). By definition: bitmap
    1000 + 990 = 1990 bytes; 1-byte gaps (990 + 27 symbols) + 990 = 2007; 2-byte gaps 1980 + 990; dense 8000.
    The bitmap is the smallest. Mutant: gap sizes counted their symbols only (1017 < 1990), so 1-byte gaps
    were sent, 17 bytes more than the bitmap."""
    positions = [256 * k + 255 for k in range(27)] + list(range(6912, 7875))
    assert len(positions) == 990 and positions[26] == 6911
    mask = torch.zeros(8000, dtype=torch.bool)
    mask[positions] = True
    current = (torch.arange(8000) % 100).to(torch.int8)
    encoding, parts, _ = _encode(current, mask, 990)
    assert encoding == BITMAP
    assert [p.numel() * p.element_size() for p in parts] == [1000, 990]
    index, flags = _decode(parts[0], BITMAP, 8000)
    assert index.tolist() == positions and not any(bool(f) for f in flags)
