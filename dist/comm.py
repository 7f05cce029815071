"""Thin wrappers around torch.distributed collectives that count every call and byte by purpose.

Every collective the learner issues goes through here with a `purpose` (gradients, with the KL riding in
them; advantages, normalizer, buffers, sampler, metrics, params, checksum, checkpoint, resume; and the
point-to-point messages of rollout ranks and sync/), so the start-up sync plan can be checked
against what actually crossed ranks (`LEDGER`). With world size 1 (or no process group) each wrapper
is a no-op that returns its input: the single-process run is the same code path.

A collective that fails (a peer died, or stalled past the process group's timeout) raises
`CollectiveError` naming the collective and its purpose, so a hung or crashed job says where it was; a
point-to-point message also names the rank it was sent to or received from as the one that died or stalled.
"""

import contextlib
import threading
from collections import defaultdict, deque

import torch
import torch.distributed as torch_dist

# purpose -> [calls, bytes]; bytes = payload of this rank's tensor (what one call moves per rank). A learner's
# weight-serving threads (rollout_weights.py) count into it while its main thread reads it, and a thread may add a
# purpose mid-read: change it only under _COUNTING (`ledger_add`) and read it whole through `ledger_snapshot`.
LEDGER: dict[str, list[int]] = defaultdict(lambda: [0, 0])
_COUNTING = threading.Lock()
# Where collective tensors must live: cuda:LOCAL_RANK under NCCL, cpu under gloo; one process keeps them on its own
# device (no collective runs, so nothing need cross to the host). Set by dist.setup; None until set (a copy of this
# file in another project, where dist.setup is not): `device()` then follows the process group's backend.
_DEVICE: torch.device | None = None
# The group every collective below runs in: the whole world, or with rollout ranks the learners' group on a learner
# and the rollout ranks' group on a rollout rank (the sampler-count sum): neither joins the other's. Set by
# `use_group`.
_GROUP = None

# The tensors of the latest collectives, referenced until dist.setup.shutdown has destroyed the process groups. Before
# torch 2.8 (pytorch/pytorch#154976) a gloo group's destructor joins its worker threads while holding the GIL, and a
# worker that drops the last reference to a collective's tensor needs the GIL to free it: destroy_process_group then
# deadlocked, in 3 of 150 two-rank exits on torch 2.5.1 (docs/running.md). A worker frees a work right after it
# completes, so the latest few are the ones it can still hold at shutdown.
RECENT: deque = deque(maxlen=16)


class CollectiveError(RuntimeError):
    """A collective or point-to-point message failed or timed out; the message names its purpose."""


def set_device(device: torch.device) -> None:
    global _DEVICE
    _DEVICE = torch.device(device)


def device() -> torch.device:
    """Where a tensor staged for a collective goes (dist.stats moves its float64 sums there): what `set_device` set;
    unset, the current CUDA device under an NCCL group (NCCL refuses host tensors: a copy of dist/stats.py failed its
    first all-reduce there, named as a dead peer), else the host."""
    if _DEVICE is not None:
        return _DEVICE
    if torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_backend(_GROUP) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def use_group(group) -> None:
    """Run every collective of this module in `group` (None = the default group of all ranks)."""
    global _GROUP
    _GROUP = group


def rank() -> int:
    """This process's rank among those taking part in this module's collectives (0 without a process group)."""
    return torch_dist.get_rank(_GROUP) if torch_dist.is_available() and torch_dist.is_initialized() else 0


def world_size() -> int:
    """Ranks taking part in this module's collectives (1 without a process group)."""
    return torch_dist.get_world_size(_GROUP) if torch_dist.is_available() and torch_dist.is_initialized() else 1


def ledger_add(purpose: str, calls: int, nbytes: int) -> None:
    """Count `calls` calls moving `nbytes` bytes in all under `purpose` (negative: take them back)."""
    with _COUNTING:
        entry = LEDGER[purpose]
        entry[0] += calls
        entry[1] += nbytes


def ledger_snapshot() -> dict[str, tuple[int, int]]:
    """purpose -> (calls, bytes) as of one moment, safe to take while other threads count."""
    with _COUNTING:
        return {purpose: (calls, nbytes) for purpose, (calls, nbytes) in LEDGER.items()}


def _count(purpose: str, tensor: torch.Tensor) -> None:
    ledger_add(purpose, 1, tensor.numel() * tensor.element_size())


@contextlib.contextmanager
def _named(kind: str, purpose: str, peer: int | None = None):
    """Any backend failure inside becomes a CollectiveError naming the call and its purpose; for a point-to-point
    message, `peer` (the global rank sent to or received from) is the rank blamed: gloo fails such a message on its
    own connection to that rank alone (another rank's death leaves it waiting). A collective's peer is unknown here:
    gloo's first line, kept in the message, gives the address of the connection that closed."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - every backend failure becomes the same named error
        # (dist/errors.first_line, written out: this file is copied into other projects with plan.py alone)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # gloo's words for a peer whose process is gone: no timeout was waited out, so the timeout is not the lead
        closed = any(words in first_line for words in ("Connection closed by peer", "Connection reset by peer"))
        # Other failures are not blamed on a peer: a tensor the backend cannot take (NCCL given a host tensor says
        # "No backend type associated with device type cpu") is this rank's, and the first line says which.
        timed_out = "timed out" in first_line.lower() or "timeout" in first_line.lower()
        who = "a peer rank" if peer is None else f"rank {peer}"
        why = (f"{who} died (its connection closed)" if closed else
               f"{who} died or stalled past the process group's timeout (init_process_group(timeout=...); "
               "syncppo's train.py: --dist.timeout-s)"
               if timed_out else "the backend refused or failed it")
        raise CollectiveError(f"{kind} for {purpose!r} failed on rank {torch_dist.get_rank()}: {why} ({first_line})"
                              ) from exc


class _Work:
    """An async work handle whose wait() names the purpose when it fails."""

    def __init__(self, work, kind: str, purpose: str, peer: int | None = None):
        self.work, self.kind, self.purpose, self.peer = work, kind, purpose, peer

    def wait(self):
        with _named(self.kind, self.purpose, self.peer):
            return self.work.wait()


def all_reduce(tensor: torch.Tensor, purpose: str, async_op: bool = False):
    """In-place sum of `tensor` over all ranks (every cross-rank statistic here is built from sums).

    Crosses ranks once per call: `tensor`, summed over the group, for the caller's `purpose` (counted in LEDGER);
    nothing with one rank. Returns a work handle when `async_op` (None in a single process), else the tensor.
    """
    if world_size() == 1:
        return None if async_op else tensor
    _count(purpose, tensor)
    RECENT.append(tensor)
    with _named("all_reduce", purpose):
        work = torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM, group=_GROUP, async_op=async_op)
    return _Work(work, "all_reduce", purpose) if async_op else tensor


def broadcast(tensor: torch.Tensor, purpose: str, src: int = 0) -> torch.Tensor:
    """In-place broadcast of `tensor` from global rank `src` (a member of the group) to all ranks.

    Crosses ranks once per call: `src`'s `tensor` to every rank, for the caller's `purpose` (counted in LEDGER);
    nothing with one rank."""
    if world_size() == 1:
        return tensor
    _count(purpose, tensor)
    RECENT.append(tensor)
    with _named("broadcast", purpose):
        torch_dist.broadcast(tensor, src=src, group=_GROUP)
    return tensor


def all_gather(tensor: torch.Tensor, purpose: str) -> torch.Tensor:
    """Every rank's `tensor`, stacked along a new first dim [world_size, ...].

    Crosses ranks once per call: each rank's `tensor` to every rank, for the caller's `purpose` (counted in
    LEDGER); nothing with one rank."""
    if world_size() == 1:
        return tensor.unsqueeze(0)
    _count(purpose, tensor)
    out = [torch.empty_like(tensor) for _ in range(world_size())]
    RECENT.append((tensor, out))
    with _named("all_gather", purpose):
        torch_dist.all_gather(out, tensor, group=_GROUP)
    return torch.stack(out)


def gather(tensor: torch.Tensor, purpose: str, dst: int = 0) -> torch.Tensor | None:
    """Every rank's `tensor`, stacked along a new first dim [world_size, ...], on global rank `dst`; None elsewhere.

    Crosses ranks once per call: each rank's `tensor` to `dst` alone, for the caller's `purpose` (counted in LEDGER
    as all_gather counts: this rank's tensor); nothing with one rank. For results one rank uses (it writes the log
    or the checkpoint): the other ranks receive nothing, where an all-gather would bring each of them W tensors."""
    if world_size() == 1:
        return tensor.unsqueeze(0)
    _count(purpose, tensor)
    out = torch.empty((world_size(), *tensor.shape), dtype=tensor.dtype, device=tensor.device) \
        if torch_dist.get_rank() == dst else None
    rows = list(out.unbind(0)) if out is not None else None
    RECENT.append((tensor, rows))
    with _named("gather", purpose):
        torch_dist.gather(tensor, rows, dst=dst, group=_GROUP)
    return out


def reset_ledger() -> None:
    with _COUNTING:
        LEDGER.clear()


# Point-to-point messages (rollout batches, weight sync), counted like the collectives:
# the sender counts what it sends, each receiver what it receives, under the caller's purpose.

def send(tensor: torch.Tensor, purpose: str, dst: int, group=None) -> None:
    """Blocking send of `tensor` to global rank `dst`. Crosses ranks once per call: `tensor`, this rank -> `dst`,
    for the caller's `purpose` (counted in LEDGER)."""
    _count(purpose, tensor)
    with _named("send", purpose, dst):
        torch_dist.send(tensor, dst=dst, group=group)


def recv(tensor: torch.Tensor, purpose: str, src: int, group=None) -> torch.Tensor:
    """Blocking receive into `tensor` from global rank `src`. Crosses ranks once per call: one message, `src` ->
    this rank, for the caller's `purpose` (counted in LEDGER)."""
    _count(purpose, tensor)
    with _named("recv", purpose, src):
        torch_dist.recv(tensor, src=src, group=group)
    return tensor


def isend(tensor: torch.Tensor, purpose: str, dst: int, group=None):
    """Start sending `tensor` to global rank `dst`; returns the work to wait on (`tensor` must outlive it).
    Crosses ranks once per call: `tensor`, this rank -> `dst`, for the caller's `purpose` (counted in LEDGER)."""
    _count(purpose, tensor)
    with _named("isend", purpose, dst):
        return _Work(torch_dist.isend(tensor, dst=dst, group=group), "isend", purpose, dst)


def irecv(tensor: torch.Tensor, purpose: str, src: int, group=None):
    """Start receiving into `tensor` from global rank `src`; returns the work to wait on. Crosses ranks once per
    call: one message, `src` -> this rank, for the caller's `purpose` (counted in LEDGER)."""
    _count(purpose, tensor)
    with _named("irecv", purpose, src):
        return _Work(torch_dist.irecv(tensor, src=src, group=group), "irecv", purpose, src)


def recv_then_count(tensor: torch.Tensor, purpose_of, src: int, group=None) -> torch.Tensor:
    """Blocking receive into `tensor` from global rank `src`, counted under `purpose_of(tensor)`: for a header
    that names what it starts (a receiver draining queued updates counts them as the sender did). Crosses ranks
    once per call: one message, `src` -> this rank."""
    with _named("recv", "a message header", src):
        torch_dist.recv(tensor, src=src, group=group)
    _count(purpose_of(tensor), tensor)
    return tensor
