"""Thin wrappers around torch.distributed collectives that count every call and byte by purpose.

Every collective the learner issues goes through here with a `purpose` (gradients, advantages, kl,
normalizer, sampler, metrics, params, checksum, checkpoint), so the start-up sync plan can be checked
against what actually crossed ranks (`LEDGER`). With world size 1 (or no process group) each wrapper
is a no-op that returns its input: the single-process run is the same code path.

A collective that fails (a peer died, or stalled past the process group's timeout) raises
`CollectiveError` naming the collective and its purpose, so a hung or crashed job says where it was.
"""

from collections import defaultdict

import torch
import torch.distributed as torch_dist

# purpose -> [calls, bytes]; bytes = payload of this rank's tensor (what one call moves per rank).
LEDGER: dict[str, list[int]] = defaultdict(lambda: [0, 0])
# Where collective tensors must live: cuda:LOCAL_RANK under NCCL, cpu under gloo. Set by dist.setup.
_DEVICE = torch.device("cpu")
# The group every collective below runs in: the whole world, or the learners only when rollout ranks
# exist (they never join the learners' collectives). Set by `use_group`.
_GROUP = None


class CollectiveError(RuntimeError):
    """A collective or point-to-point message failed or timed out; the message names its purpose."""


def set_device(device: torch.device) -> None:
    global _DEVICE
    _DEVICE = torch.device(device)


def device() -> torch.device:
    return _DEVICE


def use_group(group) -> None:
    """Run every collective of this module in `group` (None = the default group of all ranks)."""
    global _GROUP
    _GROUP = group


def world_size() -> int:
    """Ranks taking part in this module's collectives (1 without a process group)."""
    return torch_dist.get_world_size(_GROUP) if torch_dist.is_available() and torch_dist.is_initialized() else 1


def _count(purpose: str, tensor: torch.Tensor) -> None:
    entry = LEDGER[purpose]
    entry[0] += 1
    entry[1] += tensor.numel() * tensor.element_size()


def _failed(kind: str, purpose: str, exc: Exception) -> CollectiveError:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CollectiveError(f"{kind} for {purpose!r} failed on rank {torch_dist.get_rank()}: a peer rank died or "
                           f"stalled past --dist.timeout-s ({first_line})")


class _Work:
    """An async work handle whose wait() names the purpose when it fails."""

    def __init__(self, work, kind: str, purpose: str):
        self.work, self.kind, self.purpose = work, kind, purpose

    def wait(self):
        try:
            return self.work.wait()
        except Exception as exc:  # noqa: BLE001 - every backend failure becomes the same named error
            raise _failed(self.kind, self.purpose, exc) from exc


def all_reduce(tensor: torch.Tensor, purpose: str, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of `tensor` over all ranks with op "sum", "avg" (NCCL only), "max" or "min".

    Returns a work handle when `async_op` (None in a single process), else the tensor.
    """
    if world_size() == 1:
        return None if async_op else tensor
    _count(purpose, tensor)
    reduce_op = {"sum": torch_dist.ReduceOp.SUM, "avg": torch_dist.ReduceOp.AVG, "max": torch_dist.ReduceOp.MAX,
                 "min": torch_dist.ReduceOp.MIN}[op]
    try:
        work = torch_dist.all_reduce(tensor, op=reduce_op, group=_GROUP, async_op=async_op)
    except Exception as exc:  # noqa: BLE001
        raise _failed("all_reduce", purpose, exc) from exc
    return _Work(work, "all_reduce", purpose) if async_op else tensor


def broadcast(tensor: torch.Tensor, purpose: str, src: int = 0) -> torch.Tensor:
    """In-place broadcast of `tensor` from global rank `src` (a member of the group) to all ranks."""
    if world_size() == 1:
        return tensor
    _count(purpose, tensor)
    try:
        torch_dist.broadcast(tensor, src=src, group=_GROUP)
    except Exception as exc:  # noqa: BLE001
        raise _failed("broadcast", purpose, exc) from exc
    return tensor


def all_gather(tensor: torch.Tensor, purpose: str) -> torch.Tensor:
    """Every rank's `tensor`, stacked along a new first dim [world_size, ...]."""
    if world_size() == 1:
        return tensor.unsqueeze(0)
    _count(purpose, tensor)
    out = [torch.empty_like(tensor) for _ in range(world_size())]
    try:
        torch_dist.all_gather(out, tensor, group=_GROUP)
    except Exception as exc:  # noqa: BLE001
        raise _failed("all_gather", purpose, exc) from exc
    return torch.stack(out)


def reset_ledger() -> None:
    LEDGER.clear()


# Point-to-point messages (weight sync between a trainer and rollout ranks), counted like the collectives:
# the sender counts what it sends, each receiver what it receives, under the caller's purpose.

def send(tensor: torch.Tensor, purpose: str, dst: int, group=None) -> None:
    """Blocking send of `tensor` to global rank `dst`."""
    _count(purpose, tensor)
    try:
        torch_dist.send(tensor, dst=dst, group=group)
    except Exception as exc:  # noqa: BLE001
        raise _failed("send", purpose, exc) from exc


def recv(tensor: torch.Tensor, purpose: str, src: int, group=None) -> torch.Tensor:
    """Blocking receive into `tensor` from global rank `src`."""
    _count(purpose, tensor)
    try:
        torch_dist.recv(tensor, src=src, group=group)
    except Exception as exc:  # noqa: BLE001
        raise _failed("recv", purpose, exc) from exc
    return tensor


def isend(tensor: torch.Tensor, purpose: str, dst: int, group=None):
    """Start sending `tensor` to global rank `dst`; returns the work to wait on (`tensor` must outlive it)."""
    _count(purpose, tensor)
    try:
        return _Work(torch_dist.isend(tensor, dst=dst, group=group), "isend", purpose)
    except Exception as exc:  # noqa: BLE001
        raise _failed("isend", purpose, exc) from exc


def irecv(tensor: torch.Tensor, purpose: str, src: int, group=None):
    """Start receiving into `tensor` from global rank `src`; returns the work to wait on."""
    _count(purpose, tensor)
    try:
        return _Work(torch_dist.irecv(tensor, src=src, group=group), "irecv", purpose)
    except Exception as exc:  # noqa: BLE001
        raise _failed("irecv", purpose, exc) from exc


def recv_then_count(tensor: torch.Tensor, purpose_of, src: int, group=None) -> torch.Tensor:
    """Blocking receive into `tensor` from global rank `src`, counted under `purpose_of(tensor)`: for a header
    that names what it starts (a receiver draining queued updates counts them as the sender did)."""
    try:
        torch_dist.recv(tensor, src=src, group=group)
    except Exception as exc:  # noqa: BLE001
        raise _failed("recv", "a message header", exc) from exc
    _count(purpose_of(tensor), tensor)
    return tensor
