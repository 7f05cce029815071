"""Rules of configs/resume.py, dist/checkpoint.py and ppo/restore.py that a mutation audit found unpinned: a saved
float setting that is a bool is refused like a saved int that is one; an empty saved string is shown as typed ('');
a fixed-length tuple annotation counts its elements; a save to a bare file name fsyncs the working directory;
continuing a run removes checkpoint temporaries only; a restored reward normalizer takes the checkpoint's merged
return statistics but keeps its own per-env running returns (rule `local`: the envs restart their episodes).
Checkpoints of earlier versions: a saved value this version refuses gives way to the flag typed to replace it, or to
this run's value when the run does not read the flag; a must-match setting newer than the checkpoint is compared
with its default."""

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
    checkpoint's, naming the flag to pass and the value (shown as a switch, `--ppo.clip-param`, it went unsaid); the
    same setting saved as an int or a float continues."""
    with pytest.raises(UsageError, match=f"^the checkpoint's run has {flag} True, which this version does not accept "
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


def test_a_restart_whose_first_attempt_made_no_run_directory_starts_as_a_first_attempt_would(tmp_path, monkeypatch):
    """A torchrun restart (count 1) of a job whose first attempt died before creating its run directory: no
    directory holds its run id, so --resume is resolved as on a first attempt (a fresh run, a checkpoint file in a
    new directory, or auto's newest run), never a directory of None."""
    from types import SimpleNamespace
    from configs.resume import resolve_resume
    other = tmp_path / "2024-01-01_00-00-00"
    other.mkdir()
    (other / "run_id").write_text("job-6")
    (other / "model_4.pt").write_bytes(b"x")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resolve_resume(SimpleNamespace(resume=""), str(tmp_path)) == ("", None)
    assert resolve_resume(SimpleNamespace(resume="/x/model_3.pt"), str(tmp_path)) == ("/x/model_3.pt", None)
    assert resolve_resume(SimpleNamespace(resume="auto"), str(tmp_path)) == (str(other / "model_4.pt"), str(other))


def test_a_file_that_fails_its_crc_is_called_damaged_before_any_entry_is_judged(tmp_path):
    """The CRC-32s come first: a flipped bit can turn any entry into nonsense, so a file that fails them is called
    damaged (and the member named), not judged by the entry it happens to garble (a bool iteration here)."""
    from dist.checkpoint_read import load_checkpoint
    from tests.test_bad_input import flip_a_byte_of_tensor_data
    from tests.test_checkpoint_rules import _minimal_checkpoint
    path = tmp_path / "model_2.pt"
    save_checkpoint(str(path), _minimal_checkpoint(iteration=True, model={"w": torch.ones(64)}))
    flip_a_byte_of_tensor_data(path)
    with pytest.raises(UsageError, match=r"^--resume .* is damaged \(archive/data/\d+ does not match its CRC-32\); "
                                         r"resume from another checkpoint$"):
        load_checkpoint(str(path))


def test_a_file_system_without_locks_is_said_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """flock failing for want of locks (ENOLCK on some network mounts), not because another run holds the lock:
    one line says what is at risk, and the directory is used (and still recorded as this run's)."""
    import errno
    from dist import checkpoint

    def no_locks(f, flags):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(checkpoint.fcntl, "flock", no_locks)
    try:
        checkpoint.lock_run_dir(str(tmp_path))
        assert capsys.readouterr().out == (f"[syncppo] cannot lock {tmp_path} ({os.strerror(errno.ENOLCK)}): two runs "
                                           f"continuing it at once would overwrite each other's checkpoints\n")
        assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on ")
    finally:
        checkpoint.release_run_dirs()


def test_resume_auto_reads_the_env_of_the_run_s_newest_start_by_number_not_by_name(tmp_path):
    """config_9.json and config_10.json: the start at iteration 10 is the newest, though '9' sorts after '10'."""
    import json
    from configs.resume import saved_env
    for start, task in ((9, "Hopper-v4"), (10, "Walker2d-v4")):
        (tmp_path / f"config_{start}.json").write_text(json.dumps({"config": {"env": {"name": "gymnasium",
                                                                                         "task": task}}}))
    assert saved_env(str(tmp_path)) == {"name": "gymnasium", "task": "Walker2d-v4"}


def test_an_env_state_without_a_key_the_env_reads_is_one_usage_error_naming_the_env():
    """An env's load_state_dict reads its entries by key: one missing (another env's state, an older version's) is
    the KeyError restore turns into its one-line refusal, like a model or optimizer that does not fit; the state
    that fits is loaded into the env."""
    class KeyedEnv:
        generator = torch.Generator()

        def state_dict(self):
            return {"counts": torch.zeros(3)}

        def load_state_dict(self, state):
            self.counts = state["counts"]
    built = {**_built(), "env": KeyedEnv()}
    saved = _checkpoint(built, [rng_states(built["env"])], env={"visits": torch.zeros(3)})
    with pytest.raises(UsageError, match=r"^--resume 'c\.pt': its env does not fit this run \(other env or "
                                         r"--policy\.\* sizes\?\): .*counts"):
        restore(saved, "c.pt", {**_built(), "env": KeyedEnv()}, None, _roles(), CPU, _run())
    env = KeyedEnv()
    restore({**saved, "env": {"counts": torch.tensor([1.0, 2.0, 3.0])}}, "c.pt", {**_built(), "env": env}, None,
            _roles(), CPU, _run())
    assert env.counts.tolist() == [1.0, 2.0, 3.0]          # the sampler counts the checkpoint holds


@pytest.mark.parametrize("key", ["model", "optimizer", "iteration", "learning_rate", "env", "config", "rng"])
def test_a_checkpoint_without_any_entry_a_save_always_writes_is_refused_naming_it(tmp_path, key):
    """dist/checkpoint.py writes the model and optimizer states, the iteration, the LR, the env's state, the config
    and the RNG states every time: a file without one is truncated or another tool's, even where resume would not
    read it (the LR: the optimizer's param groups hold it)."""
    from dist.checkpoint_read import load_checkpoint
    from tests.test_checkpoint_rules import _minimal_checkpoint
    path = str(tmp_path / "model_2.pt")
    state = _minimal_checkpoint()
    del state[key]
    save_checkpoint(path, state)
    with pytest.raises(UsageError, match=f"^--resume '{path}' is missing \\['{key}'\\]; the file is truncated"):
        load_checkpoint(path)


# ---- checkpoints of earlier versions (an audit resumed checkpoints written by 8 earlier commits) ----------------

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
