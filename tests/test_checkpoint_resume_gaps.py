"""Rules of configs/resume.py, dist/checkpoint.py and ppo/restore.py that a mutation audit found unpinned: a saved
float setting that is a bool is refused like a saved int that is one; an empty saved string is shown as typed ('');
a fixed-length tuple annotation counts its elements; a save to a bare file name fsyncs the working directory;
continuing a run removes checkpoint temporaries only; a restored reward normalizer takes the checkpoint's merged
return statistics but keeps its own per-env running returns (rule `local`: the envs restart their episodes)."""

import os

import pytest
import torch

from configs import preset
from configs.resume import continue_saved_config, fits_type
from dist.checkpoint import remove_stale_temporaries, rng_states, save_checkpoint
from dist.errors import UsageError
from ppo.normalizer import RewardNormalizer
from ppo.restore import restore, resumed_lr
from tests.test_step_restore_rules import CPU, N, _built, _checkpoint, _roles, _run


@pytest.mark.parametrize("section, field, flag", [("ppo", "clip_param", "--ppo.clip-param"),
                                                  ("ppo", "learning_rate", "--ppo.learning-rate"),
                                                  ("env", "episode_length_s", "--env.episode-length-s")])
def test_a_saved_float_setting_that_is_a_bool_is_refused_naming_the_flag(section, field, flag):
    """JSON's true is not a number a float field takes (torch would clip at 1.0 without a word): refused as the
    checkpoint's, naming the flag to pass; the same setting saved as an int or a float continues."""
    with pytest.raises(UsageError, match=f"^the checkpoint's run has {flag}, which this version does not accept "
                                         f"\\(float\\); pass {flag} to choose$"):
        continue_saved_config(preset("tracking"), {section: {field: True}}, frozenset())
    for value in (3, 0.25):
        cfg = preset("tracking")
        continue_saved_config(cfg, {section: {field: value}}, frozenset())
        assert getattr(getattr(cfg, section), field) == value


def test_a_restored_reward_normalizer_keeps_its_running_returns_and_takes_the_saved_statistics():
    """The checkpoint's count, mean, M2 and std (rule `merge`) are restored; the per-env discounted returns (rule
    `local`) stay the fresh run's zeros, as its envs restart their episodes rather than continue the saved ones."""
    saved_norm = RewardNormalizer(N, 0.99, 10.0)
    saved_norm.returns.fill_(7.0)
    saved_norm.count.fill_(12.0)
    saved_norm.mean64.fill_(2.5)
    saved_norm.m2.fill_(30.0)
    saved_norm.std.fill_(1.5)
    built = _built(reward_normalizer=True)
    built["reward_normalizer"] = saved_norm
    saved = _checkpoint(built, [rng_states()])
    fresh = _built(reward_normalizer=True)
    restore(saved, "c.pt", fresh, None, _roles(), CPU, _run())
    norm = fresh["reward_normalizer"]
    assert torch.equal(norm.returns, torch.zeros(N))
    assert (norm.count.item(), norm.mean64.tolist(), norm.m2.tolist(), norm.std.item()) == (12.0, [2.5], [30.0], 1.5)


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


def test_a_save_to_a_bare_file_name_lands_in_the_working_directory(tmp_path, monkeypatch):
    """The directory entry to fsync after the rename is the working directory's: dirname('model_1.pt') is ''."""
    monkeypatch.chdir(tmp_path)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real_fsync(fd)))
    save_checkpoint("model_1.pt", {"iteration": 1})
    assert os.listdir(tmp_path) == ["model_1.pt"]
    assert torch.load(tmp_path / "model_1.pt", weights_only=True)["iteration"] == 1
    assert synced[-1] == os.stat(tmp_path).st_ino


def test_continuing_a_run_removes_checkpoint_temporaries_and_nothing_else(tmp_path):
    """Only model_<k>.pt.tmp-* are a killed save's: a user's notes.tmp and another tool's temporary stay."""
    names = ["model_4.pt.tmp-11-aaaaaaaa", "notes.tmp", "config_4.json.tmp-1-bbbbbbbb", "model_2.pt"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert remove_stale_temporaries(str(tmp_path)) == [str(tmp_path / names[0])]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])


@pytest.mark.parametrize("key", ["model", "optimizer", "env", "config"])
def test_each_entry_restore_loads_as_a_dict_is_refused_by_name_when_it_is_not_one(tmp_path, key):
    """restore passes 'model', 'optimizer' and 'env' to load_state_dict and reads 'config' by key: a list there is
    one UsageError naming the entry when the file is read, not a TypeError from inside a load_state_dict."""
    from dist.checkpoint_read import load_checkpoint
    from tests.test_checkpoint_rules import _minimal_checkpoint
    path = str(tmp_path / "model_2.pt")
    save_checkpoint(path, _minimal_checkpoint(**{key: [1.0]}))
    with pytest.raises(UsageError, match=f"^--resume '{path}' is damaged \\(its '{key}' is a list, not a dict\\); "
                                         f"resume from another checkpoint$"):
        load_checkpoint(path)


@pytest.mark.parametrize("restored, said", [(1e-3, ""), (3e-4, " (the checkpoint's LR was 0.0003)")])
def test_a_fixed_schedule_resume_names_the_checkpoint_s_lr_only_where_it_differs(restored, said):
    """--ppo.schedule fixed runs at --ppo.learning-rate 1e-3 whatever the checkpoint's LR; the line adds that LR only
    when it was another one (an adaptive LR 3e-4 under the fixed run's own --ppo.learning-rate, say)."""
    cfg = _run(ppo__schedule="fixed", ppo__learning_rate=1e-3, max_iterations=8)
    lr, line = resumed_lr(cfg, {"ppo": {"learning_rate": 1e-3, "schedule": "fixed"}}, restored, 2)
    assert lr == 1e-3 and line == "--ppo.schedule fixed: the LR is --ppo.learning-rate 0.001" + said


def test_a_checkpoint_of_another_syncppo_format_version_says_so(tmp_path):
    """A v2 file (a later version's) read by this v1 reader: the message names both formats and the way out (the
    version that wrote it), not "not a syncppo checkpoint"."""
    from dist.checkpoint_read import load_checkpoint
    from tests.test_checkpoint_rules import _minimal_checkpoint
    path = str(tmp_path / "model_2.pt")
    save_checkpoint(path, _minimal_checkpoint())
    state = torch.load(path, weights_only=True)
    assert state["format"] == "syncppo-checkpoint-v1"
    torch.save({**state, "format": "syncppo-checkpoint-v2"}, path)
    with pytest.raises(UsageError, match=f"^--resume '{path}' was written by another syncppo version \\(format "
                                         f"'syncppo-checkpoint-v2'; this one reads 'syncppo-checkpoint-v1'\\): "
                                         f"resume it with the version that wrote it$"):
        load_checkpoint(path)


def test_a_resume_path_that_is_a_dangling_link_is_called_one_not_missing(tmp_path):
    """os.path.exists follows links: a link to a deleted checkpoint reads as missing, which would send the user
    looking for the link itself; the message says it is there and where the trouble is."""
    from dist.checkpoint_read import load_checkpoint
    link = tmp_path / "model_2.pt"
    link.symlink_to(tmp_path / "deleted.pt")
    with pytest.raises(UsageError, match=f"^--resume '{link}' is a symbolic link whose target does not exist \\(or "
                                         f"that loops\\); pass an existing model_<iteration>.pt file"):
        load_checkpoint(str(link))
    with pytest.raises(UsageError, match=f"^--resume '{tmp_path / 'gone.pt'}' does not exist; pass an existing "):
        load_checkpoint(str(tmp_path / "gone.pt"))
