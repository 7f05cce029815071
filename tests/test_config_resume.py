"""What a resume takes from the checkpoint's config and what it refuses (configs/resume.py): settings that must
match (--env.task), this launch's own settings (--ppo.capture-step, --log.experiment), the typed flags it lists as
changed, the start config of a run read for its env, and an old run that --resume auto picked for another env or
task, named with the way out."""

import dataclasses

import pytest

from configs import preset
from configs.resume import check_resume_fits, continue_saved_config, saved_env
from dist.errors import UsageError


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
