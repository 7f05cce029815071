"""Paths given on the command line that cannot work, refused in one line naming what to fix rather than what failed
later: a checkpoint path with a trailing slash (--resume, export's CKPT), an export --out that is a dangling symbolic
link, a --log.experiment longer than the file system's own name limit (before --resume auto looks for a checkpoint),
and a --log.root too long for the run directories under it."""

import os

import pytest

from configs import validate
from configs.resume import resolve_resume
from configs.typed_flags import experiment_dir
from dist.checkpoint_read import checked_checkpoint
from dist.errors import UsageError
from dist.log_root import check_writable_root
from ppo import export
from test_config_errors import cfg_with
from test_export import checkpoint


def test_log_root_path_limit_counts_64_bytes_for_the_run_and_refuses_at_path_max(tmp_path):
    """PATH_MAX counts the terminating NUL: a root of PATH_MAX - 64 bytes is refused, one byte shorter is taken."""
    path_max = os.pathconf(str(tmp_path), "PC_PATH_MAX")

    def root_of(length):
        parts, left = [str(tmp_path)], length - len(str(tmp_path))
        while left > 0:
            n = min(200, left - 1) if left > 1 else 1
            parts.append("d" * n)
            left -= n + 1
        return "/".join(parts)
    assert len(root_of(path_max - 64)) == path_max - 64 and len(root_of(path_max - 65)) == path_max - 65
    check_writable_root(root_of(path_max - 65), write=False)
    with pytest.raises(UsageError, match="longer than the file system takes"):
        check_writable_root(root_of(path_max - 64), write=False)


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
