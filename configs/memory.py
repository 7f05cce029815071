"""Sizes the env allocates from the config alone, checked against the memory the device has before anything is
built: the tracking motion library is sized by --env.num-motions, and one too large for the machine was killed by the
kernel's OOM killer (exit status 137, no message) or failed inside torch.rand, far from the flag to lower."""

import torch

from dist.errors import UsageError
from dist.setup import launch_int
from envs.motions import AdaptiveMotionSampler, MotionLibrary
from envs.tracking import Tracking

MEMINFO = "/proc/meminfo"


def motion_bytes(num_motions: int) -> int:
    """Bytes one tracking env keeps for `num_motions` motions: the library and the sampler's counts (at least: the
    library's construction temporaries and the counts' copies at a save come on top)."""
    per_motion = MotionLibrary.bytes_per_motion(Tracking.num_joints) + AdaptiveMotionSampler.bytes_per_motion()
    return num_motions * per_motion


def available_memory(device_type: str) -> tuple[int, str] | None:
    """(bytes free for this rank's tensors, where that was read), or None where it cannot be read: no check then,
    since a guess could refuse a run that fits."""
    if device_type == "cuda":       # this rank's GPU, the one resolve_device picks
        index = launch_int("LOCAL_RANK", 0)
        try:
            return torch.cuda.mem_get_info(index)[0], f"free on cuda:{index} (torch.cuda.mem_get_info)"
        except (RuntimeError, AssertionError):    # no driver, or a torch without CUDA: the build says so itself
            return None
    try:
        with open(MEMINFO) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        value, unit = fields["MemAvailable"].split()
        return int(value) * {"kB": 1024}[unit], f"available on this host ({MEMINFO} MemAvailable)"
    except (OSError, KeyError, ValueError):
        return None


def check_env_memory(cfg, device_type: str) -> None:
    """Refuse a tracking motion library that cannot fit in the memory of its device, naming --env.num-motions."""
    if cfg.env.name != "tracking":
        return
    # Colocated, every rank of this host builds its own library in host memory; with rollout ranks only they do,
    # and which ranks of this host they are depends on the role split: counted once, as on a GPU (one per rank).
    copies = launch_int("LOCAL_WORLD_SIZE", 1, low=1) if device_type == "cpu" and not cfg.rollout.ranks else 1
    need = motion_bytes(cfg.env.num_motions) * copies
    available = available_memory(device_type)
    if available is not None and need > available[0]:
        per_rank = f" x {copies} ranks on this host" if copies > 1 else ""
        raise UsageError(f"--env.num-motions {cfg.env.num_motions}: the tracking motion library and sampler need at "
                         f"least {need / 2**30:.1f} GiB ({motion_bytes(1)} bytes a motion{per_rank}), more than the "
                         f"{available[0] / 2**30:.1f} GiB {available[1]}; use fewer motions")
