"""configs/resume.py and a checkpoint's saved config: the checkpoint a refusal names, why a taken setting is listed,
saved values that are not even a sequence, the in-place resume command's absolute run directory, a newer version's
top-level switch as it would be typed, a saved float setting that is a bool, an empty saved string shown as typed
(''), a fixed-length tuple annotation, the env seed of a checkpoint written before `env_seed` was saved, and which
settings the cross-rank settings checksum leaves out. Checkpoints of earlier versions: a saved value this version
refuses gives way to the flag typed to replace it, or to this run's value when the run does not read the flag; a
must-match setting newer than the checkpoint is compared with its default; rewards normalized before the reward clip
existed continue unclipped."""

import os
import shlex
from types import SimpleNamespace

import pytest
import torch

from configs import preset
from configs import same_settings
from configs.config import FLOAT32_MAX
from configs.resume import continue_saved_config, fits_type, resume_command, shared_env_seed
from configs.same_settings import settings_digest
from dist.errors import UsageError
from ppo.normalizer import RewardNormalizer
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
                                      ("env__launcher_args", "--headless"), ("resume", "/node1/runs/model_2.pt")])
def test_the_settings_checksum_leaves_out_only_what_may_differ_between_nodes(per_node, monkeypatch):
    """Ranks compare settings_digest at start-up: a node with its own --dist.timeout-s, --log.root, --resume (the same
    checkpoint at its own path: agree_on_checkpoint compares what was loaded) or --env.launcher-args must not stop the
    run (docs/running.md), while a setting every rank computes with (--ppo.num-epochs) must.
    Mutant: --resume dropped from PER_NODE."""
    monkeypatch.setattr(same_settings, "source_digest", lambda: 12345)     # the code is the same on both "nodes"
    field, value = per_node
    base = settings_digest(cfg_with())
    assert cfg_with(**{field: value}) != cfg_with()
    assert settings_digest(cfg_with(**{field: value})) == base
    assert settings_digest(cfg_with(ppo__num_epochs=cfg_with().ppo.num_epochs + 1)) != base


@pytest.mark.parametrize("section, field, flag", [("ppo", "clip_param", "--ppo.clip-param"),
                                                  ("ppo", "learning_rate", "--ppo.learning-rate"),
                                                  ("env", "episode_length_s", "--env.episode-length-s")])
def test_a_saved_float_setting_that_is_a_bool_is_refused_naming_the_flag(section, field, flag):
    """JSON's true is not a number a float field takes (torch would clip at 1.0 without a word): refused as the
    checkpoint's, naming the flag to pass and the value (shown as a switch, `--ppo.clip-param`, it went unsaid); the
    same setting saved as an int or a float continues."""
    with pytest.raises(UsageError, match=f"^the checkpoint's run has {flag} True, which this version does not accept "
                                         f"\\(float\\); pass {flag} to choose$"):
        continue_saved_config(preset("tracking"), {section: {field: True}}, frozenset())
    for value in (3, 0.25):
        cfg = preset("tracking")
        continue_saved_config(cfg, {section: {field: value}}, frozenset())
        assert getattr(getattr(cfg, section), field) == value


def test_an_empty_saved_string_is_shown_as_it_would_be_typed():
    """The mujoco preset's --env.task Hopper-v4 against a checkpoint's run without a task: kept as `--env.task ''`
    (a bare `--env.task ` reads as a flag without its value); typed over, the change names it the same way."""
    cfg = preset("mujoco")
    _, kept = continue_saved_config(cfg, {"env": {"name": "gymnasium", "task": ""}}, frozenset())
    assert "--env.task ''" in kept and cfg.env.task == ""
    cfg = preset("mujoco")
    changed, _ = continue_saved_config(cfg, {"env": {"name": "gymnasium", "task": ""}}, frozenset({"--env.task"}))
    assert changed == ["--env.task Hopper-v4 (the checkpoint's run: --env.task '')"]


def test_a_fixed_length_tuple_annotation_takes_exactly_its_elements():
    """No field has one yet; when one does, a saved value with an element more or less does not fit."""
    assert fits_type((1, "a"), tuple[int, str])
    assert not fits_type((1, "a", 2), tuple[int, str]) and not fits_type((1,), tuple[int, str])
    assert fits_type((1, 2, 3), tuple[int, ...]) and fits_type((), tuple[int, ...])


def test_a_saved_value_this_version_refuses_is_replaced_by_typing_the_flag_or_left_when_the_run_does_not_read_it():
    """Checkpoints of 25 commits of 2026-11-30 saved --rollout.recompute as None/True/False (now auto, on or off).
    On a run with rollout ranks the refusal lists the accepted values, and typing the flag it names resumes (it used
    to be refused the same way whatever was typed). A colocated run does not read the flag, and typing it there is
    refused as unread: the saved value is left at this run's, and the start-up says so. Before, neither could resume."""
    def with_rollout_ranks():
        cfg = preset("tracking")
        cfg.rollout.ranks = 1                                     # a launch setting: this command line's
        return cfg
    with pytest.raises(UsageError, match=r"^the checkpoint's run has --rollout.recompute None, which this version "
                                         r"does not accept \(one of auto, on, off\); pass --rollout.recompute to "
                                         r"choose$"):
        continue_saved_config(with_rollout_ranks(), {"rollout": {"recompute": None}}, frozenset())
    cfg = with_rollout_ranks()
    cfg.rollout.recompute = "on"                                  # as typed: --rollout.recompute on
    changed, _ = continue_saved_config(cfg, {"rollout": {"recompute": None}}, frozenset({"--rollout.recompute"}))
    assert cfg.rollout.recompute == "on"
    assert changed == ["--rollout.recompute on (the checkpoint's run: --rollout.recompute None)"]
    cfg = preset("tracking")                                      # colocated
    _, kept = continue_saved_config(cfg, {"rollout": {"recompute": True, "mode": "async"}}, frozenset())
    assert cfg.rollout.recompute == "auto" and cfg.rollout.mode == "async"
    assert ("--rollout.recompute True (not accepted by this version, not read by this run: left at "
            "--rollout.recompute auto)") in kept


@pytest.mark.parametrize("section, field, flag, refused", [
    ("ppo", "normalize_rewards", "--ppo.normalize-rewards", "--ppo.no-normalize-rewards"),
    ("policy", "orthogonal_init", "--policy.orthogonal-init", "--policy.no-orthogonal-init")])
def test_a_must_match_setting_newer_than_the_checkpoint_is_compared_with_its_default(section, field, flag, refused):
    """A checkpoint written before the setting existed ran with its default (False here). Typed otherwise, the resume
    is refused naming the flag, as for a checkpoint that records it; before, the check skipped it: a typed
    --ppo.normalize-rewards then failed later calling the file damaged, and --policy.orthogonal-init was listed as a
    change and had no effect. Left at the default, the checkpoint fits."""
    from configs.resume import check_resume_fits
    saved = {"config": {"env": {"name": "tracking", "num_envs": 512, "num_motions": 64}, section: {}}, "iteration": 5}
    cfg = preset("tracking")
    assert getattr(getattr(cfg, section), field) is False
    assert check_resume_fits(saved, cfg, "ckpt.pt", restarted=False) is True
    setattr(getattr(cfg, section), field, True)
    with pytest.raises(UsageError, match=f"^{flag} does not match the checkpoint's {refused} \\('ckpt.pt'\\); leave "
                                         f"the flag out to keep the checkpoint's$"):
        check_resume_fits(saved, cfg, "ckpt.pt", restarted=False)


def test_rewards_normalized_before_the_reward_clip_existed_continue_unclipped_and_the_start_up_says_so():
    """Checkpoints from before --ppo.reward-clip (942d2f1, 2026-11-30: a 2-rank run of 1e8f1c5 with
    --ppo.normalize-rewards, say) normalized rewards without clipping them. Their resume continues so (the largest
    float32 clip, which validate accepts) and lists it with the reason; it clipped at 10 unannounced, the default
    taken as what the run had done. A typed clip applies; a run that did not normalize rewards takes the default."""
    from configs import validate
    from configs.config import FLOAT32_MAX
    saved = {"env": {"name": "tracking"}, "ppo": {"normalize_rewards": True}}
    cfg = preset("tracking")
    _, kept = continue_saved_config(cfg, saved, frozenset())
    assert cfg.ppo.normalize_rewards and cfg.ppo.reward_clip == FLOAT32_MAX
    assert (f"--ppo.reward-clip {FLOAT32_MAX} (the checkpoint's run predates the flag and did not clip its "
            f"normalized rewards: no clip; pass --ppo.reward-clip to clip)") in kept
    validate(cfg, 2, frozenset())
    norm = RewardNormalizer(1, 0.99, cfg.ppo.reward_clip)
    assert norm(torch.tensor([1e6]), torch.tensor([False])).item() == pytest.approx(1e6 / (1.0 + 1e-8))
    cfg = preset("tracking")
    cfg.ppo.reward_clip = 5.0                                     # as typed: --ppo.reward-clip 5
    continue_saved_config(cfg, saved, frozenset({"--ppo.reward-clip"}))
    assert cfg.ppo.reward_clip == 5.0
    cfg = preset("tracking")
    _, kept = continue_saved_config(cfg, {"env": {"name": "tracking"}, "ppo": {"normalize_rewards": False}},
                                    frozenset())
    assert cfg.ppo.reward_clip == 10.0 and not any("reward-clip" in setting for setting in kept)
