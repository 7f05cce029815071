"""Which run and checkpoint a resume starts from (configs.resume.resolve_resume): a torchrun restart, `--resume
auto` (the newest run of this --env.name, and of a typed --env.task, its env read from the newest start by number), a
run directory given by hand, and a restart whose first attempt made no run directory."""

import json
import os

import pytest

from test_checkpoint_rules import _touch


def test_resolve_resume_restarts_auto_and_first_attempts(tmp_path, monkeypatch):
    """resolve_resume's three ways in: a torchrun restart (restart count > 0) continues the directory holding
    its run id from its latest checkpoint, or from the start (not from a literal "auto") when the first attempt
    died before its first checkpoint; a first attempt never continues another job's directory even when the run
    id matches (torchrun's default run id is the same "none" for every job); `auto` takes the newest run's latest
    checkpoint and is an error when there is none."""
    from types import SimpleNamespace
    from configs.resume import resolve_resume
    from dist.errors import UsageError
    old, new = tmp_path / "2024-01-01_00-00-00", tmp_path / "2024-01-02_00-00-00"
    _touch(old / "model_4.pt", mtime=1_000_000)
    (old / "run_id").write_text("none")
    new.mkdir()
    (new / "run_id").write_text("job-7")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resolve_resume(SimpleNamespace(resume="auto"), str(tmp_path)) == ("", str(new))
    assert resolve_resume(SimpleNamespace(resume="/x/model_3.pt"), str(tmp_path)) == ("/x/model_3.pt", str(new))
    _touch(new / "model_2.pt", mtime=2_000_000)
    assert resolve_resume(SimpleNamespace(resume=""), str(tmp_path)) == (str(new / "model_2.pt"), str(new))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resolve_resume(SimpleNamespace(resume=""), str(tmp_path)) == ("", None)
    assert resolve_resume(SimpleNamespace(resume="auto"), str(tmp_path)) == (str(new / "model_2.pt"), str(new))
    with pytest.raises(UsageError, match="--resume auto: no checkpoint under"):
        resolve_resume(SimpleNamespace(resume="auto"), str(tmp_path / "elsewhere"))
    # A run directory (what a stopped run prints) is that run, in place, from its newest checkpoint, even when
    # another run of the experiment is newer (a sweep): here the older one.
    _touch(old / "model_10.pt", mtime=1_000_000)
    assert resolve_resume(SimpleNamespace(resume=str(old)), str(tmp_path)) == (str(old / "model_10.pt"), str(old))
    with pytest.raises(UsageError, match=r"--resume '.*elsewhere' is a directory without a model_<iteration>.pt "):
        (tmp_path / "elsewhere").mkdir()
        resolve_resume(SimpleNamespace(resume=str(tmp_path / "elsewhere")), str(tmp_path))


def test_resume_auto_with_a_typed_task_takes_the_newest_run_of_that_task(tmp_path, monkeypatch):
    """The mujoco preset's runs of every task share one experiment: `--env.task HalfCheetah-v4 --resume auto` took
    the newest run of any task (a Hopper one, refused as another task). Runs saved before config_<k>.json existed
    (no file) are taken as any task."""
    from types import SimpleNamespace
    from configs.resume import resolve_resume
    from dist.errors import UsageError
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    cheetah, hopper, unknown = (tmp_path / f"2026-01-0{day}_00-00-00" for day in (1, 2, 3))
    for run, task, mtime in ((cheetah, "HalfCheetah-v4", 1_000_000), (hopper, "Hopper-v4", 2_000_000)):
        _touch(run / "model_5.pt", mtime=mtime)
        (run / "config_0.json").write_text(json.dumps({"config": {"env": {"task": "Swimmer-v4"}}}))
        (run / "config_5.json").write_text(json.dumps({"config": {"env": {"task": task}}}))   # the newest start
    auto = SimpleNamespace(resume="auto")
    assert resolve_resume(auto, str(tmp_path), "HalfCheetah-v4") == (str(cheetah / "model_5.pt"), str(cheetah))
    assert resolve_resume(auto, str(tmp_path), "Hopper-v4") == (str(hopper / "model_5.pt"), str(hopper))
    assert resolve_resume(auto, str(tmp_path)) == (str(hopper / "model_5.pt"), str(hopper))      # not typed: newest
    with pytest.raises(UsageError) as exc:
        resolve_resume(auto, str(tmp_path), "Walker2d-v4")
    assert str(exc.value).startswith(f"--resume auto: no checkpoint of --env.task Walker2d-v4 under {str(tmp_path)!r} "
                                     f"(the last-saved run there, {str(hopper)!r}, is of --env.task Hopper-v4); ")
    _touch(unknown / "model_1.pt", mtime=3_000_000)
    assert resolve_resume(auto, str(tmp_path), "Walker2d-v4") == (str(unknown / "model_1.pt"), str(unknown))


def test_resume_auto_takes_the_newest_run_of_this_env_and_task(tmp_path, monkeypatch):
    """resolve_resume's `env` (train.main passes its --env.name): a run of another env is passed over; a run whose
    newest config_<k>.json is missing, has no env section or one that is not a mapping counts as any env; with a
    typed --env.task as well both must fit, and the error names the task (the narrower of the two), and the env of
    the newest run it passed over (h83's audit: "no checkpoint" read as an empty folder).
    Mutant: the refusal without `there` -> the isaaclab refusal's text ends early."""
    from types import SimpleNamespace
    from configs.resume import resolve_resume
    from dist.errors import UsageError
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    mujoco, gym, odd = (tmp_path / f"2026-01-0{day}_00-00-00" for day in (1, 2, 3))
    for run, env, mtime in ((mujoco, {"name": "mujoco", "task": "Hopper-v4"}, 1_000_000),
                            (gym, {"name": "gymnasium", "task": "Hopper-v4"}, 2_000_000)):
        _touch(run / "model_5.pt", mtime=mtime)
        (run / "config_5.json").write_text(json.dumps({"config": {"env": env}}))
    auto, root = SimpleNamespace(resume="auto"), str(tmp_path)
    assert resolve_resume(auto, root, env="mujoco") == (str(mujoco / "model_5.pt"), str(mujoco))
    assert resolve_resume(auto, root, "Hopper-v4", "mujoco") == (str(mujoco / "model_5.pt"), str(mujoco))
    assert resolve_resume(auto, root, "Hopper-v4", "gymnasium") == (str(gym / "model_5.pt"), str(gym))
    with pytest.raises(UsageError, match=r"^--resume auto: no checkpoint of --env.task Walker2d-v4 under "):
        resolve_resume(auto, root, "Walker2d-v4", "gymnasium")
    with pytest.raises(UsageError) as exc:       # says whose runs the folder holds (it read as an empty one)
        resolve_resume(auto, root, env="isaaclab")
    assert str(exc.value).startswith(f"--resume auto: no checkpoint of --env.name isaaclab under {root!r} (the "
                                     f"last-saved run there, {str(gym)!r}, is of --env.name gymnasium); ")
    _touch(odd / "model_1.pt", mtime=3_000_000)
    for config in ({"config": {"env": ["mujoco"]}}, {"config": {}}, None):    # not a mapping, no env, no file
        if config is not None:
            (odd / "config_1.json").write_text(json.dumps(config))
        else:
            (odd / "config_1.json").unlink()
        assert resolve_resume(auto, root, "Walker2d-v4", "isaaclab") == (str(odd / "model_1.pt"), str(odd)), config


def test_resume_auto_of_a_shared_experiment_continues_this_presets_run(tmp_path, capsys, monkeypatch):
    """End to end: a cartpole run, then a tracking run, one --log.experiment; cartpole --resume auto continues the
    cartpole run (it was refused: `--env.name cartpole does not match the checkpoint's --env.name tracking`)."""
    import train
    from configs import preset
    from configs.typed_flags import typed_flags
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    root, runs = str(tmp_path), {}
    for name in ("cartpole", "tracking"):
        cfg = preset(name)
        cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.max_iterations = 2, 2, 1, 1
        cfg.policy.actor_hidden = cfg.policy.critic_hidden = (8,)
        cfg.log.root, cfg.log.experiment, cfg.dist.device = root, "shared", "cpu"
        train.main(cfg)
        (runs[name],) = [d for d in os.listdir(os.path.join(root, "shared")) if d not in runs.values()]
    cfg = preset("cartpole")
    cfg.resume, cfg.max_iterations, cfg.dry_run, cfg.log.root, cfg.log.experiment = "auto", 2, True, root, "shared"
    capsys.readouterr()
    train.main(cfg, typed_flags(["cartpole", "--resume", "auto", "--max-iterations", "2", "--dry-run",
                                 "--log.root", root, "--log.experiment", "shared"]))
    path = os.path.join(root, "shared", runs["cartpole"], "model_1.pt")
    assert f"[syncppo] would resume {path} at iteration 1" in capsys.readouterr().out
    from types import SimpleNamespace
    from configs.resume import resolve_resume
    from dist.errors import UsageError
    with pytest.raises(UsageError, match=r"--resume auto: no checkpoint of --env.name gymnasium under "):
        resolve_resume(SimpleNamespace(resume="auto"), os.path.join(root, "shared"), env="gymnasium")


def test_a_damaged_newest_checkpoint_of_a_run_continued_in_place_says_how_to_continue_in_place(tmp_path, monkeypatch,
                                                                                                capsys):
    """--resume auto (or RUN_DIR) met a truncated newest checkpoint and said "use another one": passed by hand,
    another file starts a new run directory. Set aside, the resume continues in place from the newest one left."""
    import glob
    from pathlib import Path
    import train
    from dist.errors import UsageError
    from tests.test_config_errors import cfg_with
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    small = dict(env__num_envs=16, ppo__num_steps=8, log__root=str(tmp_path), log__save_every=1)
    train.main(cfg_with(max_iterations=2, **small))
    run_dir, = glob.glob(str(tmp_path / "tracking" / "*"))
    newest = os.path.join(run_dir, "model_2.pt")
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    with pytest.raises(UsageError, match=r"is a truncated or damaged checkpoint .* \(it is the newest checkpoint of "
                                         r".*, the run this resume continues in place: move it out of that "
                                         r"directory, and the resume continues from the newest one left\)$"):
        train.main(cfg_with(max_iterations=3, resume="auto", dry_run=True, **small))
    os.rename(newest, str(tmp_path / "damaged.pt"))
    capsys.readouterr()
    train.main(cfg_with(max_iterations=3, resume="auto", **small))
    assert f"resumed {os.path.join(run_dir, 'model_1.pt')} at iteration 1" in capsys.readouterr().out
    assert glob.glob(str(tmp_path / "tracking" / "*")) == [run_dir]                            # in place
    assert sorted(p.name for p in Path(run_dir).glob("model_*.pt")) == ["model_1.pt", "model_2.pt", "model_3.pt"]


def test_a_newest_checkpoint_gone_before_it_is_read_gets_no_advice_to_move_it(tmp_path):
    """load_checkpoint adds "move it out of that directory" to an error about the run's newest checkpoint only while
    the file is there: one deleted between the listing and the read (another process pruning old saves) says it does
    not exist, and nothing more."""
    from dist.checkpoint_read import load_checkpoint
    from dist.errors import UsageError
    path = str(tmp_path / "model_7.pt")
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path, run_dir=str(tmp_path))
    assert str(exc.value) == (f"--resume {path!r} does not exist; pass an existing model_<iteration>.pt file, a run "
                              f"directory, or auto")


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


def test_resume_auto_reads_the_env_of_the_run_s_newest_start_by_number_not_by_name(tmp_path):
    """config_9.json and config_10.json: the start at iteration 10 is the newest, though '9' sorts after '10'."""
    import json
    from configs.resume import saved_env
    for start, task in ((9, "Hopper-v4"), (10, "Walker2d-v4")):
        (tmp_path / f"config_{start}.json").write_text(json.dumps({"config": {"env": {"name": "gymnasium",
                                                                                         "task": task}}}))
    assert saved_env(str(tmp_path)) == {"name": "gymnasium", "task": "Walker2d-v4"}


def test_a_restart_continues_its_own_job_s_directory_when_an_earlier_job_reused_the_run_id(tmp_path, monkeypatch):
    """Every job of a sweep launched as docs/running.md shows (`--rdzv-id myrun`) has one run id. A restart took the
    first directory by name holding it: job B's worker killed at iteration 5 was continued in job A's finished-early
    run (another seed), which trained on in A's directory, and B's own run was left behind, exit status 0 (found
    with two real torchrun jobs). Now the directory whose run_id marker was written last: B's, or an older-named
    run that a later job with that id continued in place (`--resume auto` rewrote its marker).
    Mutant: find_run_dir returns the first marker by sorted name (its loop before the fix).
    Mutant: find_run_dir picks max(found) by path instead of by the marker's modification time."""
    from types import SimpleNamespace
    from configs.resume import resolve_resume
    job_a, job_b = tmp_path / "2026-01-01_00-00-00", tmp_path / "2026-01-02_00-00-00"
    for run, mtime in ((job_a, 1_000_000), (job_b, 2_000_000)):
        _touch(run / "model_4.pt", mtime=mtime)
        (run / "run_id").write_text("myrun")
        os.utime(run / "run_id", (mtime, mtime))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "myrun")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resolve_resume(SimpleNamespace(resume=""), str(tmp_path)) == (str(job_b / "model_4.pt"), str(job_b))
    os.utime(job_a / "run_id", (3_000_000, 3_000_000))    # job A's run continued later by a job of that id
    assert resolve_resume(SimpleNamespace(resume=""), str(tmp_path)) == (str(job_a / "model_4.pt"), str(job_a))


def test_a_typed_setting_that_does_not_fit_auto_s_pick_names_the_pick_and_resume_run_dir(tmp_path):
    """A sweep over --env.num-envs in one experiment: `--resume auto --env.num-envs 128` picked the newest run, the
    64-env arm, and the refusal said only "leave the flag out", which continues that other arm. It now also names the
    run auto picked and --resume RUN_DIR; a --resume of a file, and a torchrun restart, are told as before.
    Mutant: check_resume_fits without the `cfg.resume == "auto"` way out (before the fix).
    Mutant: that way out also on a torchrun restart (`and not restarted` dropped)."""
    from configs.resume import check_resume_fits
    from dist.errors import UsageError
    from test_checkpoint_rules import _saved, _tracking_cfg
    path = str(tmp_path / "tracking" / "2026-12-06_09-00-00" / "model_5.pt")
    cfg = _tracking_cfg(env__num_envs=128)
    cfg.resume = "auto"
    with pytest.raises(UsageError) as caught:
        check_resume_fits(_saved(), cfg, path, restarted=False)
    assert str(caught.value) == (
        f"--env.num-envs 128 does not match the checkpoint's --env.num-envs 512 per rank ({path!r}); leave the flag "
        f"out to keep the checkpoint's; --resume auto picked {os.path.dirname(path)!r}, the run under "
        f"{str(tmp_path / 'tracking')!r} whose checkpoint was written last: to continue a run of --env.num-envs 128, "
        "pass --resume with its run directory")
    for resume, restarted in ((path, False), ("auto", True)):
        cfg.resume = resume
        with pytest.raises(UsageError, match="leave the flag out to keep the checkpoint's$"):
            check_resume_fits(_saved(), cfg, path, restarted=restarted)
