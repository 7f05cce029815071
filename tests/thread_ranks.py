"""W simulated ranks in one process: each rank a thread, and the dist.comm calls they make (rank, world_size,
all_reduce, all_gather, broadcast) replaced by a fake that does with every thread's tensor what torch.distributed does
with every rank's. Multi-rank checks of dist/ in milliseconds, where gloo processes take seconds (slow tests)."""

import threading

import pytest
import torch

from dist import comm

WAIT_S = 30.0   # a barrier or a join that waits this long is a deadlock (a rank skipped a collective), not slowness


class ThreadRanks:
    """The collectives of dist.comm for `world_size` threads of one process (rank per thread)."""

    def __init__(self, world_size: int):
        self.size, self.local = world_size, threading.local()
        self.barrier = threading.Barrier(world_size, timeout=WAIT_S)
        self.contributed: list[torch.Tensor | None] = [None] * world_size

    def rank(self) -> int:
        return self.local.rank

    def world_size(self) -> int:
        return self.size

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Copies of every rank's tensor, by rank, once all have called (each must share `tensor`'s shape and dtype)."""
        try:
            self.contributed[self.rank()] = tensor.clone()
            self.barrier.wait()                                   # every rank's tensor is in
            every = [t.clone() for t in self.contributed]
            self.barrier.wait()                                   # every rank has read them: the next call may write
        except BaseException:
            self.barrier.abort()                                  # the other ranks fail now instead of timing out
            raise
        assert all(t.shape == tensor.shape and t.dtype == tensor.dtype for t in every), "ranks' tensors differ"
        return every

    def all_reduce(self, tensor: torch.Tensor, purpose: str, async_op: bool = False):
        """comm.all_reduce's contract: the sum over ranks (in rank order) written into `tensor` in place (its dtype and
        shape, which every rank must share), and `tensor` returned."""
        assert not async_op and isinstance(purpose, str) and tensor.is_contiguous()
        every = self._exchange(tensor)
        total = every[0]
        for other in every[1:]:
            total += other
        tensor.copy_(total)
        return tensor

    def all_gather(self, tensor: torch.Tensor, purpose: str) -> torch.Tensor:
        """comm.all_gather's contract: every rank's tensor stacked along a new first dimension, by rank."""
        return torch.stack(self._exchange(tensor))

    def broadcast(self, tensor: torch.Tensor, purpose: str, src: int = 0) -> torch.Tensor:
        """comm.broadcast's contract: rank `src`'s tensor written into `tensor` in place."""
        return tensor.copy_(self._exchange(tensor)[src])


def run_threads(monkeypatch, world_size: int, body) -> list:
    """`body(rank)` on `world_size` threads sharing one fake process group; their results by rank. An exception in a
    thread is raised here; a thread still running after WAIT_S fails the test."""
    ranks = ThreadRanks(world_size)
    for name in ("rank", "world_size", "all_reduce", "all_gather", "broadcast"):
        monkeypatch.setattr(comm, name, getattr(ranks, name))
    monkeypatch.setattr(comm, "_DEVICE", torch.device("cpu"))
    results, errors = [None] * world_size, [None] * world_size

    def target(rank):
        ranks.local.rank = rank
        try:
            results[rank] = body(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread below
            errors[rank] = exc
            ranks.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT_S + 5)
    if any(t.is_alive() for t in threads):
        ranks.barrier.abort()
        pytest.fail(f"a simulated rank still ran after {WAIT_S + 5} s: deadlocked")
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                 next((e for e in errors if e is not None), None))
    if first is not None:
        raise first
    return results
