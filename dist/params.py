"""Parameter (and buffer) broadcast from rank 0, coalesced into one tensor per dtype."""

import torch

from dist import comm


def broadcast_module(module: torch.nn.Module, tensors: list[torch.Tensor] | None = None) -> None:
    """Make every rank's parameters and buffers equal to rank 0's.

    Crosses ranks: one broadcast per dtype present (e.g. float32 params + float64 normalizer
    statistics = 2 calls), at start-up and after a checkpoint load; never in the training loop.
    """
    tensors = tensors if tensors is not None else [*module.parameters(), *module.buffers()]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group]).to(comm.device())
        comm.broadcast(flat, "params", src=0)
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
