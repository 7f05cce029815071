"""More typed flags that have no effect (configs/typed_flags.py), and three messages that named the wrong thing to
fix: a checkpoint path with a trailing slash, an export --out that is a dangling symbolic link, and --resume auto
with a --log.experiment too long to exist."""

import os

import pytest
import torch

from configs import validate
from configs.resume import resolve_resume
from configs.typed_flags import check_typed_flags, experiment_dir
from dist.checkpoint_read import checked_checkpoint
from dist.errors import UsageError
from ppo import export
from ppo.gae import compute_gae
from ppo.kl_schedule import adaptive_lr
from test_config_errors import cfg_with, run_cli
from test_export import checkpoint


def test_lam_typed_with_gamma_0_is_refused_since_gae_multiplies_it_by_gamma():
    """Mutant: the --ppo.lam rule removed from requirement() -> check_typed_flags raises nothing."""
    rewards, values, dones = torch.randn(5, 3), torch.randn(5, 3), torch.zeros(5, 3)
    last = torch.randn(3)
    a, _ = compute_gae(rewards, values, dones, last, gamma=0.0, lam=0.95)
    b, _ = compute_gae(rewards, values, dones, last, gamma=0.0, lam=0.0)
    assert torch.equal(a, b)                        # the premise: lambda is unread in value with gamma 0
    with pytest.raises(UsageError) as exc:
        check_typed_flags(cfg_with(ppo__gamma=0.0), frozenset({"--ppo.lam", "--ppo.gamma"}))
    assert str(exc.value) == ("--ppo.lam applies only with --ppo.gamma above 0 (the run uses 0: each advantage is its "
                              "own step's TD error, lambda times 0)")
    check_typed_flags(cfg_with(ppo__gamma=0.5), frozenset({"--ppo.lam"}))
    check_typed_flags(cfg_with(ppo__gamma=0.0), frozenset({"--ppo.gamma"}))     # the preset's lam: not typed


def test_cli_refuses_lam_with_gamma_0_in_one_line(tmp_path):
    """Mutant: the --ppo.lam rule removed -> the dry run succeeds (exit 0) and prints the plan."""
    out = run_cli("cartpole", "--ppo.gamma", "0", "--ppo.lam=0.9", "--dry-run", "--log.root", str(tmp_path / "runs"))
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: --ppo.lam applies only with --ppo.gamma above 0 ") \
        and out.stderr.count("\n") == 1, out.stderr
    assert out.stdout == "" and not (tmp_path / "runs").exists()


def test_desired_kl_typed_with_equal_lr_bounds_is_refused_since_the_lr_cannot_move():
    """Mutant: the --ppo.desired-kl bounds rule removed from requirement() -> check_typed_flags raises nothing."""
    for kl in (0.0, 1e-6, 0.05, 10.0):              # the premise: whatever the KL and its target, the LR is the bound
        for desired in (1e-3, 0.01, 1.0):
            assert adaptive_lr(1e-3, kl, desired, 1e-3, 1e-3) == 1e-3
    same = {"ppo__lr_min": 1e-3, "ppo__lr_max": 1e-3, "ppo__learning_rate": 1e-3}
    with pytest.raises(UsageError) as exc:
        validate(cfg_with(**same), 1, frozenset({"--ppo.desired-kl"}))
    assert str(exc.value) == ("--ppo.desired-kl applies only with --ppo.lr-min below --ppo.lr-max (the run uses 0.001 "
                              "for both: the adaptive LR cannot move)")
    validate(cfg_with(**same), 1, frozenset({"--ppo.lr-min", "--ppo.lr-max"}))   # a constant LR is fine, untyped KL
    validate(cfg_with(ppo__lr_min=1e-3), 1, frozenset({"--ppo.desired-kl"}))
    with pytest.raises(UsageError, match=r"^--ppo\.desired-kl applies only with --ppo\.schedule adaptive"):
        check_typed_flags(cfg_with(ppo__schedule="fixed", **same), frozenset({"--ppo.desired-kl"}))   # that first


def test_a_checkpoint_path_with_a_trailing_slash_is_named_as_a_file_not_a_missing_path(tmp_path):
    """Mutant: the trailing-slash checks removed from checked_checkpoint and export -> "does not exist" and "no such
    checkpoint file"."""
    ckpt = tmp_path / "model_10.pt"
    ckpt.write_bytes(b"not read")
    with pytest.raises(UsageError) as exc:
        checked_checkpoint(f"{ckpt}/")
    assert str(exc.value) == (f"--resume '{ckpt}/' ends in a slash, but '{ckpt}' is a file, not a folder; drop the "
                              f"trailing slash")
    with pytest.raises(ValueError) as exc:
        export.export(f"{ckpt}/")
    assert str(exc.value) == (f"CKPT '{ckpt}/' ends in a slash, but '{ckpt}' is a file, not a folder; drop the "
                              f"trailing slash")
    with pytest.raises(UsageError, match=r"does not exist; pass an existing"):    # a real missing path still is
        checked_checkpoint(str(tmp_path / "model_20.pt/"))


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("ckpt"), "cartpole")


@pytest.mark.parametrize("below", ["", "sub"])
def test_export_to_a_dangling_symbolic_link_says_so(tmp_path, real_checkpoint, below):
    """Mutant: the dangling_link check removed from export -> "--out '...' cannot be an output folder (File exists)",
    or "(No such file or directory)" below the link: makedirs' error, naming neither the link nor its target."""
    ckpt = real_checkpoint
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "missing")
    out = os.path.join(str(link), below) if below else str(link)
    with pytest.raises(ValueError) as exc:
        export.export(ckpt, out)
    at = f": '{link}'" if below else ""
    assert str(exc.value) == (f"--out {out!r}{at} is a symbolic link whose target does not exist (or that loops); "
                              f"create its target, or pass --out with another folder")
    assert not (tmp_path / "missing").exists()


def test_resume_auto_names_an_experiment_too_long_to_exist_before_looking_for_a_checkpoint(tmp_path):
    """Mutant: check_experiment_name's call removed from resolve_resume -> "--resume auto: no checkpoint of
    --env.name tracking under ...", which a longer wait or another --log.root cannot fix."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")      # 255 on most file systems
    cfg = cfg_with(resume="auto", log__root=str(tmp_path), log__experiment="x" * (limit + 1))
    with pytest.raises(UsageError) as exc:
        resolve_resume(cfg, experiment_dir(cfg), None, cfg.env.name)
    assert str(exc.value) == (f"--log.experiment is {limit + 1} bytes long; a directory name can have at most {limit}: "
                              f"use a shorter name")
    cfg = cfg_with(resume="auto", log__root=str(tmp_path), log__experiment="x" * limit)
    with pytest.raises(UsageError, match=r"^--resume auto: no checkpoint of --env\.name tracking under "):
        resolve_resume(cfg, experiment_dir(cfg), None, cfg.env.name)


def test_the_name_limit_is_the_file_systems_own(tmp_path, monkeypatch):
    """eCryptfs takes 143 bytes a name: a 200-byte --log.experiment passed the fixed 255 and failed at the mkdir.
    Mutant: the limit fixed at 255 again -> validate raises nothing."""
    asked = []
    monkeypatch.setattr(os, "pathconf", lambda path, name: asked.append((path, name)) or 143)
    with pytest.raises(UsageError, match=r"^--log\.experiment is 200 bytes long; .* at most 143: use a shorter name$"):
        validate(cfg_with(log__root=str(tmp_path / "runs"), log__experiment="x" * 200))
    assert asked == [(str(tmp_path), "PC_NAME_MAX")]          # where the directory would go: its nearest ancestor
    validate(cfg_with(log__root=str(tmp_path / "runs"), log__experiment="x" * 143))
