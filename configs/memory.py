"""Sizes an embedded env's run allocates from the config alone, checked against the memory the device has before
anything is built: the rollout storage (sized by the env count and --ppo.num-steps) and the tracking motion library
(by --env.num-motions). Too large for the machine, either was killed by the kernel's OOM killer (exit status 137, no
message) or failed inside torch, far from the flag to lower. The simulators' sizes are known only once built."""

import torch

from dist.errors import UsageError
from dist.setup import launch_int
from envs.cartpole import CartPole
from envs.motions import AdaptiveMotionSampler, MotionLibrary
from envs.tracking import Tracking
from ppo.storage import storage_bytes

MEMINFO = "/proc/meminfo"
EMBEDDED = {"tracking": Tracking, "cartpole": CartPole}


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


def check_env_memory(cfg, device_type: str, env_count_flag: str) -> None:
    """Refuse an embedded env whose rollout storage and motion library (tracking) cannot fit in the memory of its
    device, naming the larger one's flag: `env_count_flag` (the one that set the env count) or --env.num-motions."""
    env = EMBEDDED.get(cfg.env.name)
    if env is None:
        return
    # Colocated, every rank of this host builds its own env and storage in host memory; with rollout ranks only they
    # do, and which ranks of this host they are depends on the role split: counted once, as on a GPU (one per rank).
    copies = launch_int("LOCAL_WORLD_SIZE", 1, low=1) if device_type == "cpu" and not cfg.rollout.ranks else 1
    library = motion_bytes(cfg.env.num_motions) if env is Tracking else 0
    per_env = storage_bytes(cfg.ppo.num_steps, 1, env.observation_dims(), env.num_actions)
    storage = per_env * cfg.env.num_envs
    need = (library + storage) * copies
    available = available_memory(device_type)
    if available is None or need <= available[0]:
        return
    per_rank = f" x {copies} ranks on this host" if copies > 1 else ""
    more = f"more than the {available[0] / 2**30:.1f} GiB {available[1]}"
    if library > storage:
        raise UsageError(f"--env.num-motions {cfg.env.num_motions}: the tracking motion library and sampler need at "
                         f"least {need / 2**30:.1f} GiB ({motion_bytes(1)} bytes a motion{per_rank}, the rollout "
                         f"storage included), {more}; use fewer motions")
    raise UsageError(f"{env_count_flag} {cfg.env.global_num_envs or cfg.env.num_envs}: the rollout storage of "
                     f"{cfg.env.num_envs} envs x {cfg.ppo.num_steps} steps needs at least {need / 2**30:.1f} GiB "
                     f"({per_env} bytes an env{per_rank}{', the motion library included' if library else ''}), "
                     f"{more}; use fewer envs (or fewer --ppo.num-steps)")
