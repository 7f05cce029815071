"""Position-sensitive integer checksum of a tensor's bit pattern, identical on CPU and GPU.

Used by the patch path: the sender stamps each touched tensor with the checksum of its post-update
value (in the receiver's dtype); the receiver recomputes it after applying and refuses a mismatch.

Why integers and why 16-bit lanes: a float reduction would depend on summation order, which differs
between devices and kernels. Here the bits are read as signed 16-bit lanes (|lane| < 2**15) and weighted
by their position in a slab (<= 2**20), so each slab's sum stays below 2**55 and is exact in int64 in any
order. Slab sums are then folded modulo a prime with a per-slab weight. This detects lost, reordered,
misplaced or corrupted values; it is not a cryptographic hash.
"""

import torch

_SLAB = 1 << 20
_PRIME = 2**31 - 1
_weights: dict[torch.device, torch.Tensor] = {}  # 8 MiB per device, built once


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """0-dim int64 tensor on t.device; no host synchronization."""
    lanes = t.detach().reshape(-1)
    lanes = lanes.view(torch.uint8) if lanes.element_size() == 1 else lanes.view(torch.int16)
    weights = _weights.get(t.device)
    if weights is None:
        weights = _weights[t.device] = torch.arange(1, _SLAB + 1, dtype=torch.int64, device=t.device)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for slab_index, start in enumerate(range(0, lanes.numel(), _SLAB)):
        slab = lanes[start:start + _SLAB]
        slab_sum = (slab.to(torch.int64) * weights[:slab.numel()]).sum()
        total = (total + torch.remainder(slab_sum, _PRIME) * (slab_index + 1)) % _PRIME
    return total
