"""Parameter (and buffer) broadcast from rank 0, coalesced into one tensor per dtype."""

import torch

from . import comm
from .plan import PlanRow


def _by_dtype(module: torch.nn.Module) -> dict[torch.dtype, list[torch.Tensor]]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in [*module.parameters(), *module.buffers()]:
        by_dtype.setdefault(t.dtype, []).append(t)
    return by_dtype


def broadcast_plan_rows(module: torch.nn.Module) -> list[PlanRow]:
    """The sync-plan row of broadcast_module at start-up: one call per dtype, in order."""
    sizes = [sum(t.numel() * t.element_size() for t in group) for group in _by_dtype(module).values()]
    return [PlanRow("params", "broadcast from rank 0", "broadcast", "setup", sizes)]


def broadcast_module(module: torch.nn.Module) -> None:
    """Make every rank's parameters and buffers equal to rank 0's.

    Crosses ranks: one broadcast per dtype present (e.g. float32 params + float64 normalizer
    statistics = 2 calls), at start-up and after a checkpoint load; never in the training loop.
    """
    for group in _by_dtype(module).values():
        flat = torch.cat([t.detach().reshape(-1) for t in group]).to(comm.device())
        comm.broadcast(flat, "params", src=0)
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
