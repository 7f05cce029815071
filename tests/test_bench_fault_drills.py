"""bench/fault_drills.py's report: what a drill kept on disk and the table of drills. No drill is run here."""

from tests.test_tools import load_bench


def test_fault_drills_last_checkpoint_is_the_highest_iteration(tmp_path):
    fd, run = load_bench("fault_drills"), tmp_path / "cartpole" / "run"
    run.mkdir(parents=True)
    for name in ("model_5.pt", "model_10.pt", "model_40.pt", "model_40.pt.tmp-1"):
        (run / name).write_bytes(b"")
    assert fd.kept(str(tmp_path)) == "1 run dir, 3 checkpoints (last model_40.pt), 1 temporaries"
