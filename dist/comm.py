"""Thin wrappers around torch.distributed collectives that count every call and byte by purpose.

Every collective the learner issues goes through here with a `purpose` (gradients, advantages, kl,
normalizer, sampler, metrics, params, checksum, checkpoint), so the start-up sync plan can be checked
against what actually crossed ranks (`LEDGER`). With world size 1 (or no process group) each wrapper
is a no-op that returns its input: the single-process run is the same code path.
"""

from collections import defaultdict

import torch
import torch.distributed as dist

# purpose -> [calls, bytes]; bytes = payload of this rank's tensor (what one call moves per rank).
LEDGER: dict[str, list[int]] = defaultdict(lambda: [0, 0])
# Where collective tensors must live: cuda:LOCAL_RANK under NCCL, cpu under gloo. Set by dist.setup.
_DEVICE = torch.device("cpu")


def set_device(device: torch.device) -> None:
    global _DEVICE
    _DEVICE = torch.device(device)


def device() -> torch.device:
    return _DEVICE


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _count(purpose: str, tensor: torch.Tensor) -> None:
    entry = LEDGER[purpose]
    entry[0] += 1
    entry[1] += tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, purpose: str, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of `tensor` over all ranks with op "sum", "avg" (NCCL only), "max" or "min".

    Returns a work handle when `async_op` (None in a single process), else the tensor.
    """
    if world_size() == 1:
        return None if async_op else tensor
    _count(purpose, tensor)
    reduce_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
                 "min": dist.ReduceOp.MIN}[op]
    work = dist.all_reduce(tensor, op=reduce_op, async_op=async_op)
    return work if async_op else tensor


def broadcast(tensor: torch.Tensor, purpose: str, src: int = 0) -> torch.Tensor:
    """In-place broadcast of `tensor` from rank `src` to all ranks."""
    if world_size() == 1:
        return tensor
    _count(purpose, tensor)
    dist.broadcast(tensor, src=src)
    return tensor


def all_gather(tensor: torch.Tensor, purpose: str) -> torch.Tensor:
    """Every rank's `tensor`, stacked along a new first dim [world_size, ...]."""
    if world_size() == 1:
        return tensor.unsqueeze(0)
    _count(purpose, tensor)
    out = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(out, tensor)
    return torch.stack(out)


def all_gather_object(obj, purpose: str) -> list:
    """Every rank's `obj` (pickled). Only for rare, small, non-tensor state such as RNG states at a checkpoint."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    LEDGER[purpose][0] += 1
    return out


def reset_ledger() -> None:
    LEDGER.clear()
