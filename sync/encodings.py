"""How patch.py writes a changed tensor's positions: the change mask and its count, the smallest encoding by exact
size (gaps in 1, 2 or 4 bytes with escape symbols, a bitmap, or dense), and its decoding, flagging what no sender
writes. The same results on every device: numpy's kernels on the host, torch's elsewhere. No communication."""

from typing import Optional

import numpy as np
import torch

from .wire import BITMAP, DENSE, GAPS8, GAPS16, GAPS32, SYMBOL_DTYPES, escape_symbol

GAP_DTYPES = {code: SYMBOL_DTYPES[code] for code in (GAPS8, GAPS16, GAPS32)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the same memory: equal bits compare equal, so NaN == NaN and -0.0 != 0.0."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _changes(mask: torch.Tensor) -> tuple[int, Optional[torch.Tensor]]:
    """(how many flags of `mask` are set, their flat positions or None). Words of 8 flags that hold a change
    are counted first (n/8 int64): when few, the positions are collected; when many, the flags only counted
    (no gap encoding can win then, and bitmap and dense need no positions)."""
    n = mask.numel()
    if int(torch.count_nonzero(mask[:n - n % 8].view(torch.int64))) > n // 64:   # changes in over 1 word of 8
        return _count(mask), None
    index = _positions(mask)
    return index.numel(), index


def _encode(current: torch.Tensor, mask: torch.Tensor, count: int, index: Optional[torch.Tensor] = None):
    """(encoding, segments, flat positions or None) for one changed tensor: the smallest encoding by exact size."""
    n, v = current.numel(), current.element_size()
    sizes = {DENSE: n * v, BITMAP: (n + 7) // 8 + count * v}
    if min(sizes.values()) > count * (1 + v):  # a gap encoding might be smaller: count its escapes
        index = _positions(mask) if index is None else index
        gaps = torch.diff(index, prepend=index.new_full((1,), -1)) - 1
        longest = int(gaps.max())  # escapes only where a gap reaches the escape symbol (integer division is slow)
        for code in GAP_DTYPES:
            extra = int((gaps // escape_symbol(code)).sum()) if longest >= escape_symbol(code) else 0
            sizes[code] = (count + extra) * GAP_DTYPES[code].itemsize + count * v
    encoding = min(sizes, key=lambda code: (sizes[code], -code))  # on a tie, the cheaper to apply
    if encoding == DENSE:
        return DENSE, [current], None
    if encoding == BITMAP:
        return BITMAP, [_pack_bits(mask), current.index_select(0, _positions(mask))], None
    symbols = gaps  # no escapes: one symbol per change, its gap
    if longest >= escape_symbol(encoding):
        per = gaps // escape_symbol(encoding) + 1  # symbols per change: its escapes, then its remainder
        ends = torch.cumsum(per, 0) - 1
        symbols = torch.full((int(ends[-1]) + 1,), escape_symbol(encoding), dtype=torch.int64, device=index.device)
        symbols[ends] = gaps % escape_symbol(encoding)
    return encoding, [_narrow(symbols, GAP_DTYPES[encoding]), current.index_select(0, index)], index


def _decode(symbols: torch.Tensor, encoding: int, numel: int):
    """(flat positions, [flags that are True when the positions are invalid]) from a gap or bitmap segment.

    Positions past the end (a corrupted gap) are flagged and clamped to the last element, so that nothing reads
    outside the tensor before the caller checks the flags (on a GPU, a device-side assert that ends the process)."""
    if encoding == BITMAP:
        bits = _unpack_bits(symbols)
        return _positions(bits[:numel]), [bits[numel:].any()]
    top = escape_symbol(encoding)
    s = symbols.to(torch.int64) & top  # the unsigned value of each symbol
    is_change = s != top
    if bool(is_change.all()):  # no escapes: every symbol is a gap
        index = torch.cumsum(s + 1, 0) - 1
        flags = [(index[-1:] >= numel).any()]
    else:
        positions = torch.cumsum(torch.where(is_change, s + 1, s), 0) - 1
        index = positions[is_change]
        flags = [(positions[-1:] >= numel).any() if index.numel() else torch.tensor(False), ~is_change[-1:].all()]
    return index.clamp_(max=numel - 1), flags


def _narrow(symbols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unsigned symbols into a (signed) wire dtype of the same width, bit for bit."""
    half = 2 ** (8 * dtype.itemsize - 1)
    return symbols.to(dtype) if dtype == torch.uint8 else torch.where(symbols >= half, symbols - 2 * half, symbols).to(dtype)


# On the host numpy's kernels beat torch's (change mask of 10M int32 pairs 3.9 vs 5.0 ms; nonzero over 10M flags
# at 20%: 5 vs 25-30 ms; count over 2M flags: 0.09 vs 0.42 ms); other devices use torch, with the same results.
# Flags stay bool: numpy's nonzero over uint8 is 7x slower. False runs the device code on the host (tests).
HOST_NUMPY = True


def _differ(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` = whether the bits of each element of the 1-D tensors `a` and `b` differ."""
    if HOST_NUMPY and out.device.type == "cpu":
        np.not_equal(_bits(a).numpy(), _bits(b).numpy(), out=out.numpy())
        return out
    return torch.ne(_bits(a), _bits(b), out=out)


def _count(flags: torch.Tensor) -> int:
    """How many entries of a 1-D bool tensor are True."""
    return int(np.count_nonzero(flags.numpy()) if HOST_NUMPY and flags.device.type == "cpu" else flags.count_nonzero())


def _positions(flags: torch.Tensor) -> torch.Tensor:
    """Flat positions of the True entries of a 1-D bool tensor, ascending, int64."""
    if HOST_NUMPY and flags.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(flags.numpy()))
    return flags.nonzero().view(-1)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bit i of byte j is mask[8 j + i] (zero-padded to whole bytes)."""
    if HOST_NUMPY and mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    bits = torch.cat([mask, mask.new_zeros((-mask.numel()) % 8)])
    return (bits.view(-1, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8, device=mask.device)).sum(1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of _pack_bits, as bool (padding included)."""
    if HOST_NUMPY and packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), bitorder="little").view(np.bool_))
    bits = (packed.view(-1, 1) >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
    return bits.view(-1).view(torch.bool)
