"""bench/fault_drills.py's report: what a drill kept on disk and the table of drills. No drill is run here."""

import sys

from tests.test_tools import load_bench


def test_fault_drills_last_checkpoint_is_the_highest_iteration(tmp_path):
    fd, run = load_bench("fault_drills"), tmp_path / "cartpole" / "run"
    run.mkdir(parents=True)
    for name in ("model_5.pt", "model_10.pt", "model_40.pt", "model_40.pt.tmp-1"):
        (run / name).write_bytes(b"")
    assert fd.kept(str(tmp_path)) == "1 run dir, 3 checkpoints (last model_40.pt), 1 temporaries"


def test_fault_drills_table_header_says_whose_exit_status(monkeypatch, capsys):
    """The exit status column is torchrun's (the launcher's), one row per drill under a 4-column rule.

    Mutant: the header's '(torchrun)' dropped; a column short in the rule."""
    fd = load_bench("fault_drills")
    monkeypatch.setattr(fd, "drill", lambda name, *a, **k: (name, 1, 2.5, "kept"))
    monkeypatch.setattr(sys, "argv", ["fault_drills.py"])
    fd.main()
    out = capsys.readouterr().out.splitlines()
    at = out.index("| drill | exit status (torchrun) | seconds to exit | kept |")
    assert out[at + 1:at + 3] == ["|---|---|---|---|", "| kill -9 one rank | 1 | 2.5 | kept |"]
