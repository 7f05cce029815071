"""An embedded env's rollout storage or tracking motion library larger than the memory it would be built in
(configs/memory.py, through validate_device): refused in one line naming the env count's flag or --env.num-motions,
against the host's MemAvailable (each colocated rank builds its own) or the rank's free GPU memory, and not guessed
where the memory cannot be read. The bytes a motion and an env keep are measured from small real objects, not computed
as configs/memory.py does."""

import os

import pytest
import torch

from configs import memory, preset, validate_device
from dist.errors import UsageError
from envs import CartPole
from envs.motions import AdaptiveMotionSampler, MotionLibrary
from envs.tracking import Tracking
from ppo.storage import RolloutStorage
from test_cli_adversarial import assert_one_line_error
from test_config_errors import run_cli


def kept_bytes_per_motion() -> int:
    """Measured, not computed as configs/memory.py does: every tensor a small library and its sampler keep."""
    library = MotionLibrary(10, Tracking.num_joints, seed=0, device=torch.device("cpu"))
    sampler = AdaptiveMotionSampler(10, 0.2, torch.device("cpu"))
    tensors = [t for owner in (library, sampler) for t in vars(owner).values() if isinstance(t, torch.Tensor)]
    assert len(tensors) == 9          # difficulty freq amp phase bias duration sines; two counts
    return sum(t.numel() * t.element_size() for t in tensors) // 10


def kept_bytes_per_env(env_class, num_steps: int) -> int:
    """Measured: every tensor a RolloutStorage of 10 envs keeps, for the widths a real env of the class reports."""
    env = env_class(2, torch.device("cpu"), 0, 0) if env_class is Tracking else env_class(2, torch.device("cpu"), 0)
    storage = RolloutStorage(num_steps, 10, env.obs_dims, env.num_actions, torch.device("cpu"))
    tensors = [t for t in vars(storage).values() if isinstance(t, torch.Tensor)]
    assert len(tensors) == 3          # the packed buffer, rewards, dones
    return sum(t.numel() * t.element_size() for t in tensors) // 10


def meminfo(tmp_path, available_bytes: int) -> str:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_bytes // 1024} kB\nCached: 0 kB\n")
    return str(path)


def refusal_then_fit(tmp_path, monkeypatch, cfg, ranks: int, need: int) -> str:
    """validate_device's refusal with 1 KiB less than `need` available (its message, returned), then none with `need`
    exactly; and the message's "more than ..." part is checked here, for both."""
    monkeypatch.setattr(memory, "MEMINFO", meminfo(tmp_path, need - 1024))
    with pytest.raises(UsageError) as exc:
        validate_device(cfg, ranks, "cpu")
    assert (f"more than the {(need - 1024) // 1024 * 1024 / 2**30:.1f} GiB available on this host ({memory.MEMINFO} "
            "MemAvailable); ") in str(exc.value)
    monkeypatch.setattr(memory, "MEMINFO", meminfo(tmp_path, need))          # just fits
    validate_device(cfg, ranks, "cpu")
    return str(exc.value)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_motion_library_larger_than_the_host_memory_is_refused_naming_num_motions(tmp_path, monkeypatch, ranks):
    """`tracking --env.num-motions 100000000` was killed by the OOM killer (exit 137, nothing said).
    Mutant: validate_device without check_env_memory -> nothing is raised."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))   # colocated: each rank of the host builds its own library
    cfg = preset("tracking")
    cfg.env.num_motions = 10**8
    storage = kept_bytes_per_env(Tracking, cfg.ppo.num_steps) * cfg.env.num_envs
    need = (kept_bytes_per_motion() * 10**8 + storage) * ranks
    said = refusal_then_fit(tmp_path, monkeypatch, cfg, ranks, need)
    assert said.startswith(
        f"--env.num-motions 100000000: the tracking motion library and sampler need at least {need / 2**30:.1f} GiB "
        f"({kept_bytes_per_motion()} bytes a motion{' x 2 ranks on this host' if ranks == 2 else ''}, the rollout "
        "storage included), more than ") and said.endswith("; use fewer motions"), said


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


@pytest.mark.parametrize("name, env_class, ranks", [("tracking", Tracking, 1), ("tracking", Tracking, 2),
                                                   ("cartpole", CartPole, 2)])
def test_a_rollout_storage_larger_than_the_host_memory_is_refused_naming_the_env_count(tmp_path, monkeypatch, name,
                                                                                       env_class, ranks):
    """`tracking --env.num-envs 1000000000` was killed by the OOM killer (exit 137, nothing said) while the motion
    library check passed. Mutants: the storage left out of `need` -> nothing is raised; the copies per host left out
    -> the 2-rank cases pass; `if library > storage` as `if library` -> the tracking cases name --env.num-motions."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    cfg = preset(name)
    cfg.env.num_envs, cfg.ppo.num_steps = 10**6, 48
    per_env = kept_bytes_per_env(env_class, 48)
    library = kept_bytes_per_motion() * cfg.env.num_motions if name == "tracking" else 0
    need = (per_env * 10**6 + library) * ranks
    said = refusal_then_fit(tmp_path, monkeypatch, cfg, ranks, need)
    assert said.startswith(
        f"--env.num-envs 1000000: the rollout storage of 1000000 envs x 48 steps needs at least {need / 2**30:.1f} "
        f"GiB ({per_env} bytes an env{' x 2 ranks on this host' if ranks == 2 else ''}"
        f"{', the motion library included' if library else ''}), more than ") and \
        said.endswith("; use fewer envs (or fewer --ppo.num-steps)"), said


def test_a_global_env_count_too_large_is_named_as_typed_and_rollout_ranks_count_one_storage(tmp_path, monkeypatch):
    """--env.global-num-envs is the flag to fix when it set the count (its value, not the per-rank share); with
    rollout ranks one rank's storage is counted, whatever the host's rank count.
    Mutants: the message naming --env.num-envs always -> the first match fails; copies counted with rollout ranks ->
    the second call raises."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = preset("cartpole")
    cfg.env.global_num_envs, cfg.env.num_envs = 2 * 10**6, 10**6       # as resolve_num_envs splits it on 2 ranks
    need = kept_bytes_per_env(CartPole, cfg.ppo.num_steps) * 10**6
    monkeypatch.setattr(memory, "MEMINFO", meminfo(tmp_path, need))
    with pytest.raises(UsageError, match=r"^--env\.global-num-envs 2000000: the rollout storage of 1000000 envs x 32 "
                                         r"steps .* x 2 ranks on this host\), more than"):
        validate_device(cfg, 2, "cpu")
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.rollout.ranks = 10**6, 1
    validate_device(cfg, 2, "cpu")


def test_cli_refuses_an_env_count_no_machine_holds_in_one_line(tmp_path):
    """The audit's command: a billion tracking envs need ~13 TB of rollout storage; refused before anything is
    built or written. Mutant: check_env_memory returning for tracking -> no error (a real run: the OOM killer)."""
    root = tmp_path / "runs"
    out = run_cli("tracking", "--env.num-envs", str(10**9), "--dry-run", "--log.root", str(root))
    assert_one_line_error(out, f"error: --env.num-envs {10**9}: the rollout storage of {10**9} envs x 24 steps needs "
                               "at least ")
    assert not os.path.exists(root)
