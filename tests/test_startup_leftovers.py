"""Four start-up refusals that were missing or came in the wrong order: a flag given twice (tyro kept the last, unsaid),
a tracking motion library larger than the memory (the OOM killer's exit 137, no message), --resume auto picking an
old run of another env (no way out named), and a typed flag the env never reads said only after --resume looked for
the run. Each is one line on stderr, exit status 2, before anything is built."""

import glob
import os
import re
import shutil

import pytest
import torch

import train
from configs import memory, preset, validate_device
from configs.resume import check_resume_fits
from configs.typed_flags import typed_flags
from dist.errors import UsageError
from envs.motions import AdaptiveMotionSampler, MotionLibrary
from envs.tracking import Tracking
from test_cli_adversarial import assert_one_line_error
from test_config_errors import run_cli, saved_run


# ---- 1. a flag given twice ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--seed", "1", "--seed", "2"], "--seed is given twice (1, then 2); keep one"),
    (["--seed=1", "--dry-run", "--seed", "2"], "--seed is given twice (1, then 2); keep one"),
    (["--policy.actor-hidden", "64", "64", "--policy.actor-hidden", "8"],
     "--policy.actor-hidden is given twice (64 64, then 8); keep one"),
    (["--ppo.num-epochs", "3", "--ppo.num_epochs", "4"],      # tyro takes both spellings of the field
     "--ppo.num-epochs is given twice (--ppo.num-epochs 3, then --ppo.num_epochs 4); keep one"),
    (["--ppo.normalize-rewards", "--ppo.no_normalize_rewards"],
     "--ppo.normalize-rewards is given twice (--ppo.normalize-rewards, then --ppo.no_normalize_rewards); keep one"),
    (["--log.experiment=", "--seed", "1", "--log.experiment", "x"],
     "--log.experiment is given twice ('', then x); keep one"),
    (["--seed", "1", "--seed", "1", "--seed", "3"], "--seed is given 3 times (1, 1, then 3); keep one"),
])
def test_a_flag_given_twice_is_named_with_every_value(argv, message):
    """Mutant: typed_flags without the repeat check -> no UsageError."""
    with pytest.raises(UsageError) as refused:
        typed_flags(["cartpole", *argv])
    assert str(refused.value) == message
    once = typed_flags(["cartpole", "--seed", "1", "--policy.actor-hidden", "64", "64", "--dry-run"])
    assert once == {"--seed", "--policy.actor-hidden", "--dry-run"}


def test_cli_refuses_a_flag_given_twice_before_anything_is_written(tmp_path):
    """`train.py cartpole --seed 1 --seed 2` trained with seed 2, unsaid.
    Mutant: cli's typed_flags(argv) outside its try -> a UsageError traceback, status 1."""
    root = tmp_path / "runs"
    out = run_cli("cartpole", "--seed", "1", "--dry-run", "--log.root", str(root), "--seed", "2")
    assert_one_line_error(out, "error: --seed is given twice (1, then 2); keep one")
    assert not os.path.exists(root)


# ---- 4. a typed flag the env never reads, before --resume looks for the run ----------------------------------------

def test_a_flag_of_another_env_is_refused_before_resume_auto_looks_for_a_run(tmp_path):
    """`cartpole --env.num-motions 5 --resume auto` with no run said "--resume auto: no checkpoint": fixed, the run
    would still refuse the flag. --env.name is a launch setting, never the checkpoint's: no checkpoint is needed.
    Mutant: typed_task without check_typed_flags of the env's flags -> the first line is resume's."""
    out = run_cli("cartpole", "--env.num-motions", "5", "--resume", "auto", "--log.root", str(tmp_path / "runs"))
    assert_one_line_error(out, "error: --env.num-motions applies only with --env.name tracking (the run uses cartpole)")
    assert not os.path.exists(tmp_path / "runs")


# ---- 3. --resume auto over a run from before config_<iteration>.json ------------------------------------------------

def old_shared_run(tmp_path) -> str:
    """A tracking run under --log.experiment shared (which the cartpole preset is given too) as versions before
    config_<iteration>.json wrote it: checkpoints alone, the env known only once one is loaded."""
    run_dir = os.path.dirname(saved_run(tmp_path / "trained"))
    old = str(tmp_path / "runs" / "shared" / "2026-01-01_00-00-00")
    shutil.copytree(run_dir, old)
    for path in glob.glob(os.path.join(old, "config_*.json")):
        os.remove(path)
    assert glob.glob(os.path.join(old, "model_*.pt")) and not glob.glob(os.path.join(old, "config_*.json"))
    return old


@pytest.mark.parametrize("typed", [frozenset({"--resume", "--log.experiment", "--log.root"}), None])
def test_resume_auto_refusing_an_old_run_of_another_env_names_it_and_the_way_out(tmp_path, typed):
    """From the command line (continue_saved_config) and from a program's config (check_resume_fits).
    Mutant: refuse_other_env called without picked_by_auto's text -> the message ends at "--env.name tracking"."""
    old = old_shared_run(tmp_path)
    cfg = preset("cartpole")
    cfg.resume, cfg.log.root, cfg.log.experiment = "auto", str(tmp_path / "runs"), "shared"
    with pytest.raises(UsageError) as exc:
        train.main(cfg, typed)
    assert re.fullmatch(
        r"--resume '.*/model_2\.pt': --env\.name cartpole does not match the checkpoint's --env\.name tracking: "
        r"resume it with the preset it was trained with \(train\.py PRESET\), or pass --env\.name tracking; "
        + re.escape(f"--resume auto picked {old!r}, the newest run under {os.path.dirname(old)!r}, which has no "
                    "config_<iteration>.json to say its env: pass --resume RUN_DIR with a run of --env.name cartpole, "
                    "or give each preset its own --log.experiment"), str(exc.value)), str(exc.value)


def test_resume_auto_refusing_an_old_run_of_another_task_names_it_and_the_way_out(tmp_path):
    """The mujoco preset's runs of every task share one experiment: a typed --env.task meets an old run of another.
    Mutant: check_resume_fits without picked_by_auto for --env.task -> the message ends at "the checkpoint's"."""
    cfg = preset("mujoco")
    cfg.resume, cfg.env.task = "auto", "Hopper-v4"
    path = str(tmp_path / "mujoco" / "2026-01-01_00-00-00" / "model_5.pt")
    state = {"config": {"env": {"name": "gymnasium", "task": "Walker2d-v4"}}, "iteration": 5}
    with pytest.raises(UsageError) as exc:
        check_resume_fits(state, cfg, path, restarted=False)
    assert str(exc.value).endswith(
        f"leave the flag out to keep the checkpoint's; --resume auto picked {os.path.dirname(path)!r}, the newest run "
        f"under {str(tmp_path / 'mujoco')!r}, which has no config_<iteration>.json to say its env: pass --resume "
        "RUN_DIR with a run of --env.task Hopper-v4, or give each task its own --log.experiment"), str(exc.value)
    cfg.resume = path                         # picked by hand: nothing to add
    with pytest.raises(UsageError, match=r"keep the checkpoint's$"):
        check_resume_fits(state, cfg, path, restarted=False)


# ---- 2. a tracking motion library larger than the memory -------------------------------------------------------------

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
