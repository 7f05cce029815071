"""What a resume takes from the checkpoint's config and what it refuses (configs/resume.py): settings that must
match (--env.task), this launch's own settings (--ppo.capture-step, --log.experiment), the typed flags it lists as
changed, the start config of a run read for its env, and an old run that --resume auto picked for another env or
task, named with the way out."""

import dataclasses
import glob
import os
import re
import shutil

import pytest

import train
from configs import preset
from configs.resume import check_resume_fits, continue_saved_config, saved_env
from dist.errors import UsageError
from test_config_errors import saved_run


def test_a_resume_refuses_another_env_task_naming_both():
    """Mutant: --env.task left out of MUST_MATCH. A Hopper-v4 checkpoint under --env.task HalfCheetah-v4 (other
    observation and action sizes) is refused before the build, naming the flag and the checkpoint's value."""
    cfg = preset("mujoco")
    saved = {"config": dataclasses.asdict(preset("mujoco")), "iteration": 5}      # a Hopper-v4 run's checkpoint
    assert check_resume_fits(saved, cfg, "ckpt.pt", restarted=False) is True
    cfg.env.task = "HalfCheetah-v4"
    with pytest.raises(UsageError, match=r"^--env.task HalfCheetah-v4 does not match the checkpoint's --env.task "
                                         r"Hopper-v4 \('ckpt.pt'\)"):
        check_resume_fits(saved, cfg, "ckpt.pt", restarted=False)


@pytest.mark.parametrize("section, field, theirs", [("ppo", "capture_step", True), ("log", "experiment", "old")])
def test_a_resume_keeps_this_launch_s_capture_step_and_experiment(section, field, theirs):
    """Mutants: --ppo.capture-step, --log.experiment left out of LAUNCH. How a step runs and where runs go are this
    command line's (the preset's here), not the checkpoint run's, even untyped."""
    cfg = preset("tracking")
    ours = getattr(getattr(cfg, section), field)
    assert ours != theirs
    saved = dataclasses.asdict(preset("tracking"))     # the checkpoint run's full config, one launch setting other
    saved[section][field] = theirs
    changed, kept = continue_saved_config(cfg, saved, frozenset())
    assert getattr(getattr(cfg, section), field) == ours and changed == [] and kept == []


def test_a_typed_flag_equal_to_the_checkpoint_s_value_is_not_listed_as_a_change():
    """Mutant: `elif ours != theirs` made `else`. --ppo.num-epochs 5 typed on a run that had 5 changes nothing; on a
    run that had 3 it is listed with the checkpoint's value."""
    saved = dataclasses.asdict(preset("tracking"))
    cfg = preset("tracking")
    assert continue_saved_config(cfg, saved, frozenset({"--ppo.num-epochs"})) == ([], [])
    saved["ppo"]["num_epochs"] = 3
    changed, kept = continue_saved_config(cfg, saved, frozenset({"--ppo.num-epochs"}))
    assert changed == ["--ppo.num-epochs 5 (the checkpoint's run: --ppo.num-epochs 3)"] and kept == []
    assert cfg.ppo.num_epochs == 5


@pytest.mark.parametrize("text", ["[]", '{"config": null}', '{"config": ["env"]}'])
def test_a_start_config_of_another_layout_reads_as_an_unknown_env(tmp_path, text):
    """Mutant: saved_env's except without TypeError. A config_<iteration>.json that is JSON but not a dict of dicts
    (subscripting a list with "config", or None with "env", is a TypeError) is an unknown env, {}, not a crash of
    --resume auto; a well-formed one is read."""
    (tmp_path / "config_3.json").write_text(text)
    assert saved_env(str(tmp_path)) == {}
    (tmp_path / "config_4.json").write_text('{"config": {"env": {"name": "cartpole"}}}')
    assert saved_env(str(tmp_path)) == {"name": "cartpole"}


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
    Mutant: refuse_other_env called without picked_by_auto's text -> the message ends at "(train.py tracking)"."""
    old = old_shared_run(tmp_path)
    cfg = preset("cartpole")
    cfg.resume, cfg.log.root, cfg.log.experiment = "auto", str(tmp_path / "runs"), "shared"
    with pytest.raises(UsageError) as exc:
        train.main(cfg, typed)
    assert re.fullmatch(
        r"--resume '.*/model_2\.pt': --env\.name cartpole does not match the checkpoint's --env\.name tracking: "
        r"resume it with the preset it was trained with \(train\.py tracking\); "
        + re.escape(f"--resume auto picked {old!r}, the run under {os.path.dirname(old)!r} whose checkpoint was "
                    "written last, which has no config_<iteration>.json to say its env: pass --resume RUN_DIR with a "
                    "run of --env.name cartpole, or give each preset its own --log.experiment"),
        str(exc.value)), str(exc.value)


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
        f"leave the flag out to keep the checkpoint's; --resume auto picked {os.path.dirname(path)!r}, the run "
        f"under {str(tmp_path / 'mujoco')!r} whose checkpoint was written last, which has no config_<iteration>.json "
        "to say its env: pass --resume RUN_DIR with a run of --env.task Hopper-v4, or give each task its own "
        "--log.experiment"), str(exc.value)
    cfg.resume = path                         # picked by hand: nothing to add
    with pytest.raises(UsageError, match=r"keep the checkpoint's$"):
        check_resume_fits(state, cfg, path, restarted=False)
