"""Cross-rank check that replicas really are identical: an exact, order-sensitive checksum."""

import torch

from dist import comm


def checksum(tensors) -> torch.Tensor:
    """An int64 checksum of the exact bytes of `tensors` (position-weighted, so swaps are caught too)."""
    total = torch.zeros((), dtype=torch.int64)
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).to("cpu", torch.int64)
        weights = torch.arange(raw.numel(), dtype=torch.int64) % 65521 + 1
        total += (raw * weights).sum()
    return total


def verify_replicas(module: torch.nn.Module, what: str = "parameters") -> None:
    """Raise, naming the ranks that differ from rank 0, if parameters are not bit-identical everywhere.

    Crosses ranks: one all-gather of a single int64 per rank. Called every --dist.verify-every
    iterations and after every checkpoint load.
    """
    local = checksum(module.parameters()).to(comm.device())
    gathered = comm.all_gather(local, "checksum").cpu()
    diverged = [r for r in range(gathered.numel()) if gathered[r] != gathered[0]]
    if diverged:
        raise RuntimeError(f"{what} diverged across ranks: rank(s) {diverged} differ from rank 0 "
                           f"(checksums {gathered.tolist()}); something updated one replica without the others")
