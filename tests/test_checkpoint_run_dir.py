"""dist/checkpoint.py and a run directory: a save to a bare file name fsyncs the working directory, continuing a run
removes checkpoint temporaries only and says which, and a file system without locks is said once and the run goes on."""

import os

import torch

from dist.checkpoint import remove_stale_temporaries, save_checkpoint


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
