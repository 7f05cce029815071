"""One exact checksum of tensors' bytes, identical on every device and rank; updatable from changed elements.

The bytes are read as signed 8-bit lanes and laid out as rows of ROW lanes. Lane s of row r has the weight
W[s] * H[r] (two independent weight sets, so two 31-bit checksums in one int64). W (24 bits) and H (31 bits)
are pseudo-random (splitmix64 of the position under fixed seeds), so a shifted or permuted write does not
line up with the original the way linear position weights do.

Exact on any device and in any summation order; row sums are folded modulo the prime P in int64. On an
AVX-512 host the rows are one int8 matrix product with int32 sums (torch._int_mm, ~10 GB/s): each W is split
into four 6-bit digits (W = D0 + 64 D1 + 4096 D2 + 262144 D3), so a digit's row sum stays under
128 * 63 * 2**14 < 2**31, and the digits are recombined in int64. (6 bits, not 7: without VNNI oneDNN's int8
kernels add pairs of products in saturating int16, 2 * 255 * 63 < 2**15; 7-bit digits came out wrong there.)
Elsewhere (GPUs, other CPUs) a row sum is a float64 matrix-vector product per block of rows: |lane| <= 128
times W < 2**24 over 2**14 lanes stays below 2**53.

Because the checksum is linear in the lanes, changing elements at known positions from `old` to `new`
changes it by sum((new - old) * weight) mod P: `update_checksum` needs only the changed elements.
"""

import threading

import numpy as np
import torch

P = 2**31 - 1
ROW_BITS = 14
ROW = 1 << ROW_BITS      # lanes (bytes) per row
BLOCK = 32               # rows per float64 product on the host: a 4 MiB buffer, reused, stays in cache
DEVICE_BLOCK = 256       # on a GPU: a 32 MiB buffer, 8x fewer kernel launches
DIGITS = 4               # 6-bit digits per 24-bit lane weight (host int8 product)
# torch._int_mm runs oneDNN's int8 kernels: per 40 MB, 4.2 ms with AVX-512 but 25 ms held to AVX2 (float64 blocks:
# 15 ms), and a scalar loop (50x slower) without oneDNN or with torch.backends.mkldnn.enabled = False. So the int8
# product only on AVX-512, with oneDNN on. The tests compare both paths.
HOST_INT8 = torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
_SEEDS = (0x5EED0001, 0x5EED0002)
_tables: dict = {}       # (what, device) -> tensor, built once (H grows on demand)
_scratch = threading.local()  # per-thread float64 buffers: a receiving thread and the caller may both checksum


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer (uint64 arithmetic wraps in numpy by definition)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def weights(count: int, bits: int, offset: int = 0) -> np.ndarray:
    """[count, 2] int64 pseudo-random weights in [1, 2**bits) (and below P), positions offset.. offset+count."""
    pos = np.arange(offset, offset + count, dtype=np.uint64)
    cols = [(_splitmix64(pos ^ np.uint64(seed << 32)) >> np.uint64(64 - bits)).astype(np.int64) for seed in _SEEDS]
    out = np.stack(cols, axis=1) % P
    out[out == 0] = 1
    return out


def _lane_weights(device, dtype) -> torch.Tensor:
    key = ("W", str(device), dtype)
    if key not in _tables:
        # [2, ROW]: w @ block.T is one fast BLAS call (block @ w with two columns is several times slower)
        _tables[key] = torch.from_numpy(weights(ROW, 24).T.copy()).to(device=device, dtype=dtype)
    return _tables[key]


def _lane_digits() -> torch.Tensor:
    """[ROW, 2 * DIGITS] int8: column 4k + j is digit j (6 bits) of the lane weights of seed k."""
    if "digits" not in _tables:
        w = _host_tables()[0]
        _tables["digits"] = torch.from_numpy(np.stack(
            [(w[:, k] >> (6 * j)) & 63 for k in range(2) for j in range(DIGITS)], axis=1).astype(np.int8))
    return _tables["digits"]


def _lane_weights_by_column(device) -> torch.Tensor:
    """[ROW, 2] int64: the lane weights laid out for gathering by lane column."""
    key = ("W by column", str(device))
    if key not in _tables:
        _tables[key] = _lane_weights(device, torch.int64).t().contiguous()
    return _tables[key]


def _row_weights(rows: int, device) -> torch.Tensor:
    key = ("H", str(device))
    table = _tables.get(key)
    if table is None or table.shape[0] < rows:
        size = 1 << max(10, (rows - 1).bit_length())
        table = _tables[key] = torch.from_numpy(weights(size, 31, offset=1 << 40)).to(device)
    return table


def _host_tables() -> tuple[np.ndarray, np.ndarray]:
    """The lane weights [ROW, 2] and the first row's weights [2], as numpy int64 (one-row host checksums)."""
    if "host" not in _tables:
        _tables["host"] = (weights(ROW, 24), _row_weights(1, torch.device("cpu"))[0].numpy())
    return _tables["host"]


def lanes(t: torch.Tensor) -> torch.Tensor:
    """The 1-D signed 8-bit lanes of a tensor's bytes (no copy for contiguous tensors)."""
    return t.detach().reshape(-1).view(torch.int8)


def _combine(parts: torch.Tensor) -> torch.Tensor:
    """[2] residues mod P -> one int64 (high * 2**31 + low)."""
    return parts[0] * 2**31 + parts[1]


def _split(checksum: torch.Tensor) -> torch.Tensor:
    return torch.stack([checksum // 2**31, checksum % 2**31])


def _host_row_sums(x: torch.Tensor) -> torch.Tensor:
    """[rows, 2] int64 weighted lane sums of the rows of `x` (int8, on the host): the full rows as one int8
    matrix product by the weights' digits, the last partial row in numpy."""
    full, tail = divmod(x.numel(), ROW)
    sums = []
    if full:
        digits = torch._int_mm(x[:full * ROW].view(full, ROW), _lane_digits()).to(torch.int64)
        sums.append((digits.view(full, 2, DIGITS) << torch.arange(0, 6 * DIGITS, 6)).sum(2))
    if tail:
        sums.append(torch.from_numpy(x[full * ROW:].numpy().astype(np.int64) @ _host_tables()[0][:tail]).view(1, 2))
    return torch.cat(sums)


def _device_row_sums(x: torch.Tensor) -> torch.Tensor:
    """[rows, 2] int64 weighted lane sums of the rows of `x` (int8, any device), in float64 blocks."""
    full, tail = divmod(x.numel(), ROW)
    block_rows = BLOCK if x.device.type == "cpu" else DEVICE_BLOCK
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.device != x.device or buffer.shape[0] != block_rows:
        buffer = _scratch.buffer = torch.empty(block_rows, ROW, dtype=torch.float64, device=x.device)
    w = _lane_weights(x.device, torch.float64)
    sums = []
    for start in range(0, full, block_rows):
        rows = min(block_rows, full - start)
        block = buffer[:rows]
        block.copy_(x[start * ROW:(start + rows) * ROW].view(rows, ROW))
        sums.append((w @ block.t()).t())
    if tail:
        block = buffer[0, :tail]
        block.copy_(x[full * ROW:])
        sums.append((w[:, :tail] @ block).view(1, 2))
    return torch.cat(sums).to(torch.int64)


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """0-dim int64 checksum of `t`'s exact bits, on t.device; no host synchronization."""
    x = lanes(t)
    device = x.device
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=device)
    if device.type == "cpu" and x.numel() <= ROW:  # one row on the host (headers, tables): numpy is 3-4x faster
        w, h = _host_tables()
        parts = (x.numpy().astype(np.int64) @ w[:x.numel()]) % P * h % P
        return torch.tensor(int(parts[0]) * 2**31 + int(parts[1]))
    int8 = device.type == "cpu" and HOST_INT8 and torch.backends.mkldnn.enabled
    row_sums = _host_row_sums(x) if int8 else _device_row_sums(x)
    row_sums = torch.remainder(row_sums, P)
    folded = torch.remainder(row_sums * _row_weights(row_sums.shape[0], device)[:row_sums.shape[0]], P)
    return _combine(torch.remainder(folded.sum(0), P))


def update_checksum(checksum: torch.Tensor, index: torch.Tensor, old: torch.Tensor, new: torch.Tensor,
                    numel: int) -> torch.Tensor:
    """The checksum of a tensor of `numel` elements after those at flat positions `index` changed from `old`
    to `new`.

    Costs O(len(index) + numel / 2**14), not O(numel): the sender and the receiver of a sparse patch never
    rescan a tensor. `index` must not repeat a position (each change is counted once). No host sync: the
    per-row sums are sized from `numel`, not from the positions.
    """
    if index.numel() == 0:
        return checksum
    per = old.element_size()                                    # lanes per element, all in one row (8 | ROW)
    lane = index.to(torch.int64) * per                          # each changed lane's flat position
    if per > 1:
        lane = (lane.view(-1, 1) + torch.arange(per, device=index.device)).view(-1)
    diff = lanes(new).to(torch.int64) - lanes(old).to(torch.int64)
    terms = diff.view(-1, 1) * _lane_weights_by_column(index.device).index_select(0, lane & (ROW - 1))  # < 2**32
    rows = lane >> ROW_BITS
    num_rows = (numel * per + ROW - 1) >> ROW_BITS
    # Summed per row first (exact in int64: under 2**46), so the slow modulo runs once per row, not per change.
    per_row = torch.zeros(num_rows, 2, dtype=torch.int64, device=index.device).index_add_(0, rows, terms)
    delta = torch.remainder(torch.remainder(per_row, P) * _row_weights(num_rows, index.device)[:num_rows], P).sum(0)
    return _combine(torch.remainder(_split(checksum.to(index.device)) + delta, P))  # callers may keep it on the host


def checksum(tensors) -> torch.Tensor:
    """One int64 checksum of a sequence of tensors, order-sensitive: tensor i's checksum is weighted by a
    pseudo-random weight of i. Identical on every rank and device for identical bytes."""
    sums = [tensor_checksum(t) for t in tensors]
    if not sums:
        return torch.zeros((), dtype=torch.int64)
    device = sums[0].device
    w = _tables.get(("I", str(device)))
    if w is None or w.shape[0] < len(sums):
        w = _tables[("I", str(device))] = torch.from_numpy(weights(max(64, len(sums)), 31, offset=1 << 50)).to(device)
    return _combine(torch.remainder(
        torch.remainder(torch.stack([_split(c) for c in sums]) * w[:len(sums)], P).sum(0), P))
