"""dist/checkpoint.py and a run directory: a save to a bare file name fsyncs the working directory, continuing a run
removes checkpoint temporaries only and says which, and a file system without locks is said once and the run goes on."""

import os

import pytest
import torch

from dist.checkpoint import remove_stale_temporaries, save_checkpoint
from dist.errors import RunError


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


def test_continuing_a_run_says_which_interrupted_save_it_removed(tmp_path, capsys):
    """docs/fault_tolerance.md: the next start in a run directory removes stale temporaries "and says so", one line
    per file, so a user who finds a file gone knows why; a run with none to remove says nothing of it.
    Mutant: open_run_dir removing the temporaries without the `removed PATH` line."""
    from dist.checkpoint import open_run_dir, release_run_dirs
    run = tmp_path / "2026-12-01_06-00-00"
    run.mkdir()
    for name in ("model_4.pt", "model_6.pt.tmp-12-0123abcd"):
        (run / name).write_bytes(b"x")
    try:
        open_run_dir(str(run), str(tmp_path), None)
        assert capsys.readouterr().out == (f"[syncppo] removed {run / 'model_6.pt.tmp-12-0123abcd'}, a checkpoint "
                                           f"whose save was interrupted\n")
        open_run_dir(str(run), str(tmp_path), None)      # held already, nothing left to remove
        assert capsys.readouterr().out == ""
    finally:
        release_run_dirs()


@pytest.mark.parametrize("error, fix", [
    (OSError(13, "Permission denied"), "make {d} writable again"),
    (OSError(30, "Read-only file system"), "make {d} writable again"),
    (OSError(28, "No space left on device"), "free space on that disk or point --log.root elsewhere")])
def test_a_failed_save_says_what_to_fix_by_its_cause_and_names_the_last_checkpoint(tmp_path, monkeypatch, error, fix):
    """A run directory made read-only mid-run (chmod -w, 2 ranks, a save every 5 iterations) failed its save of
    iteration 10 advising 'free space on that disk', with no word of which checkpoint still held the run.
    Mutant: the fix chosen without the errno (always 'free space ...') fails the EACCES and EROFS cases; the last
    checkpoint left out of the line fails all three."""
    save_checkpoint(str(tmp_path / "model_5.pt"), {"iteration": 5})

    def failing(obj, f):
        raise error
    monkeypatch.setattr(torch, "save", failing)
    path = str(tmp_path / "model_10.pt")
    with pytest.raises(RunError) as info:
        save_checkpoint(path, {"iteration": 10})
    assert str(info.value) == (f"could not write checkpoint {path}: {error.strerror}; {fix.format(d=tmp_path)}, "
                               f"then resume from the last checkpoint, {tmp_path / 'model_5.pt'}")
    assert os.listdir(tmp_path) == ["model_5.pt"]


def test_a_failed_first_save_says_no_checkpoint_holds_the_run(tmp_path, monkeypatch):
    """Mutant: `latest_checkpoint(...) or "none..."` without the fallback prints 'None' and fails."""
    def failing(obj, f):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(RunError, match=r"then resume from the last checkpoint, none: this run saved none yet$"):
        save_checkpoint(str(tmp_path / "model_1.pt"), {"iteration": 1})
