"""Cross-rank check that replicas really are identical: an exact, order-sensitive checksum."""

import torch

from dist import comm


CHUNK = 1 << 20   # bytes per step: bounds the int64 temporaries (8 MB) whatever the model size


def checksum(tensors) -> torch.Tensor:
    """An int64 checksum of the exact bytes of `tensors`, computed where they live.

    Each byte is weighted by its position within a 1 MB chunk (so swapped values are caught too);
    every chunk sum is an exact integer below 2**48, and 2**15 chunks fit in int64 without overflow.
    """
    weights = None
    total = None
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if weights is None:
            weights = torch.arange(1, CHUNK + 1, dtype=torch.int64, device=raw.device)
            total = torch.zeros((), dtype=torch.int64, device=raw.device)
        for start in range(0, raw.numel(), CHUNK):
            chunk = raw[start:start + CHUNK].to(torch.int64)
            total += (chunk * weights[:chunk.numel()]).sum()
    return total


def verify_replicas(module: torch.nn.Module, what: str = "parameters") -> None:
    """Raise, naming the ranks that differ from rank 0, if parameters are not bit-identical everywhere.

    Crosses ranks: one all-gather of a single int64 per rank. Called every --dist.verify-every
    iterations and after every checkpoint load.
    """
    local = checksum(module.parameters()).reshape(1).to(comm.device())
    gathered = comm.all_gather(local, "checksum").cpu().flatten()
    diverged = [r for r in range(gathered.numel()) if gathered[r] != gathered[0]]
    if diverged:
        raise RuntimeError(f"{what} diverged across ranks: rank(s) {diverged} differ from rank 0 "
                           f"(checksums {gathered.tolist()}); something updated one replica without the others")
