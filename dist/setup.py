"""Process set-up: the process group from torchrun's environment (a plain `python train.py` is world size
1), the device, seeds and, on CPU, the host allocator."""

import ctypes
import gc
import os
import random
import threading
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as torch_dist

from dist import comm
from dist.errors import RunError, UsageError, one_line


@dataclass
class DistInfo:
    rank: int
    world_size: int
    backend: str          # "nccl", "gloo", or "none" for a single process
    device: torch.device


def launch_int(name: str, default: int, low: int = 0) -> int:
    """An integer that torchrun sets in the environment (RANK, WORLD_SIZE, LOCAL_RANK, ...), `default` when unset."""
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.strip().isdecimal() or int(value) < low:
        alone = ", or unset it to run one process" if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") else ""
        raise UsageError(f"environment variable {name}={value!r} is not an integer >= {low}: torchrun sets it; "
                         f"launch with torchrun{alone}")
    return int(value)


def launch_rank_and_world() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) from torchrun's environment, (0, 1) without it; checked."""
    rank, world_size = launch_int("RANK", 0), launch_int("WORLD_SIZE", 1, low=1)
    if rank >= world_size:
        given = f"WORLD_SIZE={world_size}" if "WORLD_SIZE" in os.environ else "WORLD_SIZE unset (1)"
        raise UsageError(f"environment variables RANK={rank} and {given}: a rank must be below the world size "
                         f"(torchrun sets both; launch with torchrun)")
    return rank, world_size


def resolve_device(device: str = "auto") -> torch.device:
    """cuda:LOCAL_RANK or cpu, checked before any process group or env exists (no communication)."""
    local_rank = launch_int("LOCAL_RANK", 0)
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise UsageError("--dist.device cuda was asked for but torch sees no CUDA device; use --dist.device cpu")
    local_world = launch_int("LOCAL_WORLD_SIZE", local_rank + 1, low=1)
    if use_cuda and local_world > torch.cuda.device_count():
        raise UsageError(f"--nproc-per-node {local_world} starts more ranks than the {torch.cuda.device_count()} "
                         f"visible GPU(s); start at most that many processes per node")
    return torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")


WAIT_NOTICE_S = 10.0     # a rendezvous longer than this says what it waits for


def init_distributed(backend: str = "auto", device: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK); one device per local rank.

    backend/device "auto": NCCL and cuda:LOCAL_RANK when CUDA is available, else gloo and CPU. Without
    torchrun's variables this is world size 1 and no process group is created. Every collective
    fails after `timeout_s` seconds without progress instead of hanging.

    Under torchrun restarts (`--max-restarts`), the launcher's key-value store still holds the keys
    of the previous round; the group's keys are therefore prefixed by TORCHELASTIC_RESTART_COUNT so a
    restarted gloo group never connects to a dead worker's old address.

    Crosses ranks once at start-up, with more than one rank: init_process_group's rendezvous through the
    launcher's store (addresses, no tensors, so nothing in the ledger). A rendezvous that fails (a rank that
    never came, a host that cannot be reached) is a RunError naming --dist.timeout-s, not a traceback.
    """
    rank, world_size = launch_rank_and_world()
    if world_size > 1 and not torch_dist.is_initialized():     # torchrun's agent store is reached there too
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise UsageError(f"WORLD_SIZE={world_size} without {' and '.join(missing)}: the ranks cannot find "
                             f"each other; launch with torchrun (it sets them), or set them to rank 0's host and a "
                             f"free port")
        if launch_int("MASTER_PORT", 0, low=1) > 65535:   # the store's ValueError would be a traceback
            raise UsageError(f"environment variable MASTER_PORT={os.environ['MASTER_PORT']!r} is not a TCP port "
                             f"(1-65535): set it to a free port of rank 0's host, or launch with torchrun (it sets it)")
    dev = resolve_device(device)
    use_cuda = dev.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(dev)
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not use_cuda:
        raise UsageError("--dist.backend nccl needs CUDA devices; use --dist.backend gloo on CPU")
    if world_size > 1:
        if not torch_dist.is_initialized():
            timeout = timedelta(seconds=timeout_s)
            # device_id binds the group to this GPU (NCCL's eager init); a gloo group stays unbound
            kwargs = {"backend": backend, "timeout": timeout, "device_id": dev if backend == "nccl" else None}
            where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            # Said once when the others are late (a node not started yet, RANK set by hand without torchrun): the
            # rendezvous is otherwise silent for up to --dist.timeout-s (600 s by default).
            notice = threading.Timer(WAIT_NOTICE_S, print, [f"[syncppo] rank {rank}: waiting for the other "
                                                            f"{world_size - 1} rank(s) at {where} (for up to "
                                                            f"--dist.timeout-s {timeout_s:g})"], {"flush": True})
            notice.daemon = True
            notice.start()
            try:
                if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                    store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], launch_int("MASTER_PORT", 0), world_size,
                                                is_master=False, timeout=timeout)
                    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                    kwargs.update(store=torch_dist.PrefixStore(f"syncppo/restart{restart}", store), rank=rank,
                                  world_size=world_size)
                torch_dist.init_process_group(**kwargs)
            except (torch_dist.DistError, RuntimeError) as error:   # a store or gloo's mesh that timed out: no bug
                if not isinstance(error, torch_dist.DistError) and "connectFullMesh" not in str(error):
                    raise
                why = one_line(error).rstrip(".")
                raise RunError(f"the {world_size} ranks did not all meet at {where} within --dist.timeout-s "
                               f"{timeout_s:g} ({why}); start every rank (torchrun --nnodes/--nproc-per-node), "
                               "check that rank 0's host and port are reachable, or raise --dist.timeout-s; a "
                               "rank that refused its input (another node's one line) never joins") from error
            finally:
                notice.cancel()
    else:
        backend = "none"
    # Where collectives stage their tensors: the rank's GPU under NCCL, the host under gloo; with one process (no
    # collective runs: each returns its input) where the run computes, since staged on the host a one-GPU run copied
    # its advantage statistics there and back twice per update, a device sync each way.
    comm.set_device(dev if backend in ("nccl", "none") else torch.device("cpu"))
    # A main() before this one in the process (tests, a notebook) left comm on its learner or rollout group,
    # destroyed or not: the collectives before the roles split (the resume agreement) must span every rank.
    comm.use_group(None)
    return DistInfo(rank, world_size, backend, dev)


KEEP_FREED = 1 << 30        # freed heap kept by the process instead of returned to the OS


def keep_freed_host_memory() -> bool:
    """On glibc, keep freed host memory in the process rather than returning it to the OS; returns whether
    glibc took the settings (False elsewhere: nothing changes there). No communication.

    A CPU update frees and allocates its activations (1-50 MB) again at every minibatch. By default
    glibc maps most of them fresh from the OS or trims them back, so each new one page-faults on first
    touch: 11-28 thousand faults per update at 512 envs x (128, 128), 1.8 million at 4096 envs x
    (512, 256, 128). Here every allocation comes from the heap (no mmap whatever its size: raising glibc's mmap
    threshold would stop at 32 MiB, under the large setting's 50 MB activations) and up to KEEP_FREED of freed
    heap is kept: faults per update drop to about 0 at both settings, and the large update took 13.9 -> 12.8 s
    (0.36 -> 0.34 s and 16.96 -> 15.43 s with the 32 MiB threshold before that, docs/benchmarks.md). What is
    computed does not change; the cost is a resident set that stays at its peak.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4    # glibc's malloc.h
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREED))


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank` in a run of --seed `seed`: an integer in [0, 2**32) drawn from numpy's SeedSequence of
    the pair, so two pairs share streams only by chance, 2**-32 a pair (seed + rank made them: rank 1 of --seed 0 was
    rank 0 of --seed 1, so a sweep's runs overlapped). Rollout rank L + j passes j, the colocated rank whose seeds it
    uses."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) with this rank's seed (rank_seed(--seed, rank))."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def shutdown() -> None:
    """Destroy the process groups while the interpreter is fully alive.

    gloo work objects still referenced at interpreter exit (e.g. from a reference cycle through a
    gradient hook) are destroyed after the groups' threads and can abort the process ("terminate
    called without an active exception"), so unreachable objects are collected first. The latest
    collectives' tensors (comm.RECENT) are let go only once the groups are gone: see comm.RECENT.
    """
    if torch_dist.is_initialized():
        gc.collect()
        torch_dist.destroy_process_group()
    comm.RECENT.clear()
