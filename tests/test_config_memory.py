"""A tracking motion library larger than the memory it would be built in (configs/memory.py, through
validate_device): refused in one line naming --env.num-motions, against the host's MemAvailable (each colocated rank
builds its own) or the rank's free GPU memory, and not guessed where the memory cannot be read. The bytes a motion
keeps are measured from a small library, not computed as configs/memory.py does."""

import os

import pytest
import torch

from configs import memory, preset, validate_device
from dist.errors import UsageError
from envs.motions import AdaptiveMotionSampler, MotionLibrary
from envs.tracking import Tracking
from test_cli_adversarial import assert_one_line_error
from test_config_errors import run_cli


def kept_bytes_per_motion() -> int:
    """Measured, not computed as configs/memory.py does: every tensor a small library and its sampler keep."""
    library = MotionLibrary(10, Tracking.num_joints, seed=0, device=torch.device("cpu"))
    sampler = AdaptiveMotionSampler(10, 0.2, torch.device("cpu"))
    tensors = [t for owner in (library, sampler) for t in vars(owner).values() if isinstance(t, torch.Tensor)]
    assert len(tensors) == 9          # difficulty freq amp phase bias duration sines; two counts
    return sum(t.numel() * t.element_size() for t in tensors) // 10


def meminfo(tmp_path, available_bytes: int) -> str:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_bytes // 1024} kB\nCached: 0 kB\n")
    return str(path)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_motion_library_larger_than_the_host_memory_is_refused_naming_num_motions(tmp_path, monkeypatch, ranks):
    """`tracking --env.num-motions 100000000` was killed by the OOM killer (exit 137, nothing said).
    Mutant: validate_device without check_env_memory -> nothing is raised."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))   # colocated: each rank of the host builds its own library
    need = kept_bytes_per_motion() * 10**8 * ranks
    cfg = preset("tracking")
    cfg.env.num_motions = 10**8
    monkeypatch.setattr(memory, "MEMINFO", meminfo(tmp_path, need - 1024))
    with pytest.raises(UsageError) as exc:
        validate_device(cfg, ranks, "cpu")
    assert str(exc.value) == (
        f"--env.num-motions 100000000: the tracking motion library and sampler need at least {need / 2**30:.1f} GiB "
        f"({kept_bytes_per_motion()} bytes a motion{' x 2 ranks on this host' if ranks == 2 else ''}), more than the "
        f"{(need - 1024) // 1024 * 1024 / 2**30:.1f} GiB available on this host ({memory.MEMINFO} MemAvailable); "
        "use fewer motions")
    monkeypatch.setattr(memory, "MEMINFO", meminfo(tmp_path, need))          # just fits
    validate_device(cfg, ranks, "cpu")


def test_a_motion_library_larger_than_the_gpu_memory_is_refused_and_unknown_memory_is_not_guessed(tmp_path,
                                                                                                   monkeypatch):
    """On a GPU the rank's own device memory counts; where /proc/meminfo cannot be read, nothing is refused.
    Mutant: available_memory returning 0 bytes for an unreadable /proc/meminfo -> the last call raises."""
    cfg = preset("tracking")
    cfg.env.num_motions = 10**6
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (10**6, 8 * 10**9))
    with pytest.raises(UsageError, match=r"^--env\.num-motions 1000000: .* more than the 0\.0 GiB free on cuda:0 "
                                         r"\(torch\.cuda\.mem_get_info\); use fewer motions$"):
        validate_device(cfg, 1, "cuda")
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "no such file"))
    cfg.env.num_motions = 10**15
    validate_device(cfg, 1, "cpu")


def test_cli_refuses_a_motion_library_no_machine_holds_in_one_line(tmp_path):
    """10**12 motions need ~500 TB: refused on any machine, before anything is built or written.
    Mutant: validate_device without check_env_memory -> the run builds the library (MemoryError or the OOM killer)."""
    root = tmp_path / "runs"
    out = run_cli("tracking", "--env.num-motions", str(10**12), "--dry-run", "--log.root", str(root))
    assert_one_line_error(out, f"error: --env.num-motions {10**12}: the tracking motion library and sampler need at "
                               f"least {10**12 * kept_bytes_per_motion() / 2**30:.1f} GiB")
    assert not os.path.exists(root)
