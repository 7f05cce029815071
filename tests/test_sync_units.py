"""Single-process pieces of sync/: COO view and index encoding, message layout, checksum, codec, key helpers."""

import numpy as np
import pytest
import torch
from torch import nn

from sync import trainable_keys
from sync.checksum import tensor_checksum
from sync.compression import compress, decompress
from sync.coo import changed_mask, decode, encode, shape_2d, smallest_index_dtype, view_2d
from sync.transport import layout, pack, unpack


@pytest.mark.parametrize("shape, expected", [((), (1, 1)), ((7,), (1, 7)), ((3, 4), (3, 4)), ((2, 3, 4, 5), (2, 60))])
def test_2d_view(shape, expected):
    assert tuple(view_2d(torch.zeros(shape)).shape) == expected == shape_2d(shape)


def test_change_detection_is_on_bits():
    old = torch.tensor([0.0, float("nan"), 1.0, -0.0, 2.0])
    new = torch.tensor([-0.0, float("nan"), 1.0, 0.0, 3.0])
    # 0.0 -> -0.0 and back are changes; NaN -> the same NaN is not (a float compare would say all NaNs differ).
    assert changed_mask(new, old).flatten().tolist() == [True, False, False, True, True]


def test_delta_encoding_by_hand():
    rows = torch.tensor([0, 0, 0, 2, 2, 7])
    cols = torch.tensor([1, 4, 9, 0, 3, 5])
    sent_rows, sent_cols = encode(rows, cols, delta=True)
    assert sent_rows.tolist() == [0, 0, 0, 2, 0, 5]  # steps between rows
    assert sent_cols.tolist() == [1, 3, 5, 0, 3, 5]  # steps within a row, absolute at a row's first element
    for delta in (True, False):
        decoded = decode(*encode(rows, cols, delta), delta)
        assert decoded[0].tolist() == rows.tolist() and decoded[1].tolist() == cols.tolist()


def test_delta_encoding_round_trips_random_masks():
    g = torch.Generator().manual_seed(0)
    for density in (0.001, 0.05, 0.5, 1.0):
        mask = torch.rand(200, 300, generator=g) < density
        rows, cols = mask.nonzero().unbind(1)
        sent = encode(rows, cols, delta=True)
        assert min(int(sent[0].min()), int(sent[1].min())) >= 0
        narrow = [s.to(torch.uint8 if int(s.max()) < 256 else torch.int16) for s in sent]  # as sent on the wire
        back_rows, back_cols = decode(*narrow, delta=True)
        assert torch.equal(back_rows, rows) and torch.equal(back_cols, cols)


@pytest.mark.parametrize("largest, code", [(0, 0), (255, 0), (256, 1), (32767, 1), (32768, 2), (2**31, 3)])
def test_smallest_index_dtype(largest, code):
    assert smallest_index_dtype(largest) == code


def test_layout_puts_wider_elements_first_so_views_are_aligned():
    specs = [(torch.uint8, 3), (torch.float32, 2), (torch.int16, 1), (torch.float64, 1)]
    offsets, total = layout(specs)
    assert offsets == [18, 8, 16, 0] and total == 21  # float64 at 0, float32 at 8..16, int16 at 16, uint8 at 18
    segments = [torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([1.5, -2.0]),
                torch.tensor([-7], dtype=torch.int16), torch.tensor([3.25], dtype=torch.float64)]
    payload = pack(segments, "cpu")
    assert payload.numel() == total
    for original, view in zip(segments, unpack(payload, specs)):
        assert view.dtype == original.dtype and torch.equal(view, original)


def test_checksum_matches_a_reference_written_with_numpy():
    t = torch.randn(1000)
    lanes = t.numpy().view(np.int16).astype(np.int64)  # one slab: sum of lane * (position + 1), mod 2**31 - 1
    expected = int((lanes * np.arange(1, lanes.size + 1)).sum() % (2**31 - 1))
    assert int(tensor_checksum(t)) == expected


def test_checksum_sees_swaps_signed_zeros_and_every_slab():
    t = torch.randn(3 * 2**20 + 5)
    base = int(tensor_checksum(t))
    swapped = t.clone()
    swapped[[10, 2**20 + 10]] = t[[2**20 + 10, 10]]  # same values, other places
    zero = t.clone()
    zero[-1] = 0.0
    negative_zero = t.clone()
    negative_zero[-1] = -0.0
    assert int(tensor_checksum(swapped)) != base
    assert int(tensor_checksum(zero)) != int(tensor_checksum(negative_zero))
    assert int(tensor_checksum(t.clone())) == base
    assert int(tensor_checksum(torch.tensor([True, False]))) != int(tensor_checksum(torch.tensor([False, True])))


def test_zstd_round_trip_and_damage():
    payload = torch.arange(10_000, dtype=torch.int32).view(torch.uint8)
    packed = compress("zstd", payload)
    assert packed.numel() < payload.numel() and torch.equal(decompress("zstd", packed, payload.numel()), payload)
    with pytest.raises(ValueError, match="header announced|could not decompress"):
        decompress("zstd", packed, payload.numel() - 1)
    assert compress("none", payload) is payload


def test_trainable_keys_leave_out_frozen_parameters_only():
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    net[0].weight.requires_grad_(False)
    assert trainable_keys(net) == ["0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                                   "1.num_batches_tracked"]
