"""Process-group set-up from torchrun's environment; a plain `python train.py` is world size 1."""

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from dist import comm


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    backend: str          # "nccl", "gloo", or "none" for a single process
    device: torch.device


def init_distributed(backend: str = "auto", device: str = "auto") -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK); one device per local rank.

    backend/device "auto": NCCL and cuda:LOCAL_RANK when CUDA is available, else gloo and CPU. Without
    torchrun's variables this is world size 1 and no process group is created.
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("--dist.device cuda was asked for but torch sees no CUDA device; use --dist.device cpu")
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK {local_rank} has no GPU: only {torch.cuda.device_count()} visible; "
                         f"start at most that many processes per node (--nproc-per-node)")
    dev = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not use_cuda:
        raise ValueError("--dist.backend nccl needs CUDA devices; use --dist.backend gloo on CPU")
    if world_size > 1:
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, device_id=dev if use_cuda else None)
    else:
        backend = "none"
    comm.set_device(dev if backend == "nccl" else torch.device("cpu"))
    return DistInfo(rank, local_rank, world_size, backend, dev)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) with this rank's seed (base seed + rank)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
