"""configs/resume.py and a checkpoint's saved config: the checkpoint a refusal names, why a taken setting is listed,
saved values that are not even a sequence, the in-place resume command's absolute run directory, a newer version's
top-level switch as it would be typed, the env seed of a checkpoint written before `env_seed` was saved, and which
settings the cross-rank settings checksum leaves out."""

import os
import shlex
from types import SimpleNamespace

import pytest

from configs import preset
from configs import resume
from configs.config import FLOAT32_MAX
from configs.resume import continue_saved_config, fits_type, resume_command, settings_digest, shared_env_seed
from dist.errors import UsageError
from tests.test_config_errors import cfg_with


def test_a_saved_value_this_version_refuses_names_the_checkpoint_file_it_came_from():
    """With `checkpoint` given (train.py passes the --resume path), the refusal of a saved value leads with
    `--resume 'PATH': `, so a user resuming one of several runs knows which file holds it."""
    with pytest.raises(UsageError, match=r"^--resume 'runs/a/model_2\.pt': the checkpoint's run has --ppo\.clip-param "
                                         r"True, which this version does not accept \(float\); pass --ppo\.clip-param "
                                         r"to choose$"):
        continue_saved_config(preset("tracking"), {"ppo": {"clip_param": True}}, frozenset(), "runs/a/model_2.pt")


def test_a_recorded_reward_clip_is_listed_as_the_checkpoint_s_without_the_predates_the_flag_reason():
    """BEFORE's reason ("predates the flag", no clip) is for a checkpoint that has no --ppo.reward-clip: one that
    records a clip of 5 continues it, and the start-up lists it as the checkpoint's value, not as a missing flag."""
    cfg = preset("tracking")
    assert cfg.ppo.reward_clip != 5.0                             # else nothing would be listed at all
    _, kept = continue_saved_config(cfg, {"env": {"name": "tracking"},
                                          "ppo": {"normalize_rewards": True, "reward_clip": 5.0}}, frozenset())
    assert cfg.ppo.reward_clip == 5.0
    assert "--ppo.reward-clip 5.0" in kept
    assert not any("predates" in setting for setting in kept), kept
    assert not any(str(FLOAT32_MAX) in setting for setting in kept), kept


@pytest.mark.parametrize("saved", [128, ""])
def test_a_saved_sequence_setting_that_is_not_a_sequence_is_refused_as_the_checkpoint_s(saved):
    """--policy.actor-hidden saved as a bare number (a hand-edited config) is refused in one line naming the flag,
    not a TypeError from len(); saved as "" it is not an empty tuple of ints (a string is not a tuple)."""
    assert not fits_type(saved, tuple[int, ...])
    assert fits_type((), tuple[int, ...]) and fits_type((64,), tuple[int, ...])      # what does fit
    cfg = preset("tracking")
    shown = "--policy.actor-hidden " + (str(saved) if saved != "" else "''")
    with pytest.raises(UsageError, match=rf"^the checkpoint's run has {shown}, which this version does not accept "):
        continue_saved_config(cfg, {"env": {"name": "tracking"}, "policy": {"actor_hidden": saved}}, frozenset())
    assert cfg.policy.actor_hidden == preset("tracking").policy.actor_hidden


def test_the_resume_command_names_the_run_directory_by_its_absolute_path(tmp_path, monkeypatch):
    """A run under a relative --log.root prints its in-place resume command; it is run from wherever the user is
    then, so the directory is absolute (resolved against the working directory of the run that printed it)."""
    monkeypatch.chdir(tmp_path)
    run_dir = os.path.join("logs", "tracking", "2026-12-01_00-00-00")
    expected_dir = os.path.join(os.getcwd(), "logs", "tracking", "2026-12-01_00-00-00")
    command = resume_command(["tracking", "--resume", "auto", "--seed", "3"], run_dir)
    assert command == shlex.join(["train.py", "tracking", "--seed", "3", "--resume", expected_dir])


def test_a_newer_version_s_top_level_switch_is_listed_as_it_would_be_typed():
    """A saved top-level setting this version does not know is dropped and listed: a switch is shown as its
    command-line form, `--no-NAME` when off and `--NAME` when on (not `.no---NAME`)."""
    saved = {"env": {"name": "tracking"}, "old_switch": False, "new_switch": True, "new_count": 3}
    _, kept = continue_saved_config(preset("tracking"), saved, frozenset())
    assert "--no-old-switch (not known to this version: dropped)" in kept
    assert "--new-switch (not known to this version: dropped)" in kept
    assert "--new-count 3 (not known to this version: dropped)" in kept


def test_a_checkpoint_without_env_seed_keeps_its_run_s_seed_for_the_shared_env():
    """A checkpoint saved before `env_seed` existed built its motions from its run's --seed: a resume with another
    --seed keeps that one; a saved env_seed wins over both, and a new run (no checkpoint) uses --seed."""
    cfg = SimpleNamespace(seed=7)
    assert shared_env_seed(cfg, {"config": {"seed": 3}}) == 3
    assert shared_env_seed(cfg, {"config": {"seed": 3}, "env_seed": 5}) == 5
    assert shared_env_seed(cfg, {"config": {}}) == 7
    assert shared_env_seed(cfg, None) == 7


@pytest.mark.parametrize("per_node", [("dist__timeout_s", 30.0), ("log__root", "/elsewhere"),
                                      ("env__launcher_args", "--headless")])
def test_the_settings_checksum_leaves_out_only_what_may_differ_between_nodes(per_node, monkeypatch):
    """Ranks compare settings_digest at start-up: a node with its own --dist.timeout-s, --log.root or
    --env.launcher-args must not stop the run, while a setting every rank computes with (--ppo.num-epochs) must."""
    monkeypatch.setattr(resume, "source_digest", lambda: 12345)     # the code is the same on both "nodes"
    field, value = per_node
    base = settings_digest(cfg_with())
    assert getattr(cfg_with(), field.split("__")[0]).__dict__[field.split("__")[1]] != value
    assert settings_digest(cfg_with(**{field: value})) == base
    assert settings_digest(cfg_with(ppo__num_epochs=cfg_with().ppo.num_epochs + 1)) != base
