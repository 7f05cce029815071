"""Parameter (and buffer) broadcast from rank 0, coalesced into one tensor per dtype."""

import torch

from . import comm
from .plan import PlanRow
from .verify import names_plan_row, same_names_everywhere


def _by_dtype(module: torch.nn.Module) -> dict[torch.dtype, list[torch.Tensor]]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in [*module.parameters(), *module.buffers()]:
        by_dtype.setdefault(t.dtype, []).append(t)
    return by_dtype


def _layout(module: torch.nn.Module) -> list[str]:
    return [f"{n} {tuple(t.shape)} {t.dtype}" for n, t in [*module.named_parameters(), *module.named_buffers()]]


def broadcast_plan_rows(module: torch.nn.Module) -> list[PlanRow]:
    """The sync-plan rows of broadcast_module at start-up: the layout check, then one call per dtype, in order."""
    sizes = [sum(t.numel() * t.element_size() for t in group) for group in _by_dtype(module).values()]
    return [names_plan_row("shapes"), PlanRow("params", "broadcast from rank 0", "broadcast", "setup", sizes)]


def broadcast_module(module: torch.nn.Module) -> None:
    """Make every rank's parameters and buffers equal to rank 0's.

    Crosses ranks: first one all-gather of an int64 checksum of every tensor's name, shape and dtype, because
    gloo broadcasts a rank 0 tensor of another size into a rank's buffer without an error (a rank whose env has
    other sizes would train on garbage); then one broadcast per dtype present (e.g. float32 params + float64
    normalizer statistics = 2 calls). At start-up and after a checkpoint load; never in the training loop.
    """
    layout = _layout(module)
    same_names_everywhere(layout, "shapes", "the model's parameters and buffers (name, shape, dtype) differ",
                          f"every rank must build the same model; this rank's: {'; '.join(layout)}")
    for group in _by_dtype(module).values():
        flat = torch.cat([t.detach().reshape(-1) for t in group]).to(comm.device())
        comm.broadcast(flat, "params", src=0)
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
