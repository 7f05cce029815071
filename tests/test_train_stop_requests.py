"""train.main on a stop request (dist/stop.py): a signal saves and ends the run after that iteration and says how
to continue it, one in the last iteration is a finished run, the launcher gone ends it without saving, a signal to
one rank of two stops both, and a finished run gives the signal handlers back. The requests are scripted (FlagAt),
except where a real signal handler is checked."""

import glob
import os
import re
import signal

import pytest
import torch

import train
from dist.stop import STOP_KEYS, StopRequests
from tests.multirank import run_ranks
from tests.test_train import small_tracking


class FlagAt:
    """StopRequests as this rank would see it when `key` (a signal, or the launcher gone) comes up during iteration
    `at` (1-based) and not before: train.main's only reads of it are local_flags once per iteration, the handlers'
    restore at the end, and gone_message (StopRequests' own, on this rank's launcher as the flag says it)."""

    def __init__(self, at, key="Control/stop_signal"):
        self.at, self.key, self.calls = at, key, 0

    def __call__(self, watch_launcher):      # stands in for the class: train.main builds one
        return self

    def local_flags(self, device):
        self.calls += 1
        one = torch.ones((), device=device)
        return {k: (one * (k == self.key and self.calls == self.at), one) for k in STOP_KEYS}

    def restore_default_handlers(self):
        pass

    def launcher_gone(self):
        return self.key == "Control/launcher_gone" and self.calls >= self.at

    gone_message = StopRequests.gone_message


def checkpoints(root):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "tracking", "*", "model_*.pt")))


def test_a_stop_request_saves_and_ends_the_run_after_that_iteration(tmp_path, monkeypatch, capsys):
    """A signal during iteration 1 of 4 (--log.save-every 2): model_1.pt is saved for it, the run says so with the
    command that continues it, and no iteration after it runs or saves."""
    monkeypatch.setattr(train, "StopRequests", FlagAt(1))
    train.main(small_tracking(tmp_path, iterations=4))
    out = capsys.readouterr().out
    assert checkpoints(tmp_path) == ["model_1.pt"]
    said = r"stopped on request \(SIGINT/SIGTERM\) after iteration (\d+); saved \S+model_(\d+).pt; continue it"
    assert re.findall(said, out) == [("1", "1")]


def test_a_stopped_run_prints_the_line_of_its_last_iteration_whatever_print_every(tmp_path, monkeypatch, capsys):
    """--log.print-every 10 and a stop during iteration 3: the console shows iteration 3, the one saved (it showed
    none: TensorBoard had the values, the console not; h85's audit). Mutant: the console line's condition without
    `or stop_signal` -> no line."""
    monkeypatch.setattr(train, "StopRequests", FlagAt(3))
    cfg = small_tracking(tmp_path, iterations=20)
    cfg.log.print_every = 10
    train.main(cfg)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("it ")]
    assert [line.split()[1] for line in lines] == ["3/20"], lines



@pytest.mark.parametrize("under_torchrun", [False, True])
def test_the_stop_line_says_to_keep_torchrun_s_options_only_under_torchrun(tmp_path, monkeypatch, capsys,
                                                                           under_torchrun):
    """docs/fault_tolerance.md: under torchrun the command to continue adds "under the same torchrun options" (its
    --nproc-per-node and the like are not in train.py's argv); a plain python run's line does not.
    Mutant: the stop line without " (under the same torchrun options)" (or with it whatever the launcher)."""
    monkeypatch.setattr(train, "StopRequests", FlagAt(1))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    if under_torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setattr("sys.argv", ["train.py", "tracking", "--seed", "3"])
    train.main(small_tracking(tmp_path, iterations=4))
    run_dir = os.path.dirname(glob.glob(os.path.join(tmp_path, "tracking", "*", "model_1.pt"))[0])
    options = " (under the same torchrun options)" if under_torchrun else ""
    said = [line for line in capsys.readouterr().out.splitlines() if "stopped on request" in line]
    assert said == [f"[syncppo] stopped on request (SIGINT/SIGTERM) after iteration 1; saved {run_dir}/model_1.pt; "
                    f"continue it in place{options} with: train.py tracking --seed 3 --resume {run_dir}"]

def test_a_stop_request_in_the_last_iteration_is_a_finished_run_not_one_to_continue(tmp_path, monkeypatch, capsys):
    """A signal during the last of 3 iterations: the final checkpoint is saved as always, and the run, complete,
    does not say it stopped on request nor offer a command to continue it (there is nothing left to train)."""
    monkeypatch.setattr(train, "StopRequests", FlagAt(3))
    train.main(small_tracking(tmp_path, iterations=3))
    out = capsys.readouterr().out
    assert checkpoints(tmp_path) == ["model_2.pt", "model_3.pt"]
    assert "stopped on request" not in out and "continue it in place" not in out


def test_a_launcher_gone_ends_the_run_after_that_iteration_without_saving(tmp_path, monkeypatch):
    """The launcher gone during iteration 2 of 4 (saves every 2): the run fails with RunError naming iteration 2
    and writes no checkpoint for it, nor runs iteration 3; model_2.pt, which a save would have written, is absent."""
    monkeypatch.setattr(train, "StopRequests", FlagAt(2, "Control/launcher_gone"))
    with pytest.raises(train.RunError, match=r"^the launcher \(torchrun\) is gone: stopped after iteration 2 "
                                             r"without saving; the last periodic checkpoint is kept$"):
        train.main(small_tracking(tmp_path, iterations=4))
    assert checkpoints(tmp_path) == []


def stop_on_one_rank_body(rank, world_size, cfg):
    """train.main where only rank 1 gets a signal, during iteration 1."""
    if rank == 1:
        train.StopRequests = FlagAt(1)           # this rank's process only
    cfg.dist.device = "cpu"
    train.main(cfg)


@pytest.mark.slow
def test_a_signal_to_one_rank_of_two_stops_both_after_that_iteration(tmp_path):
    """A signal reaches one rank of two (a SIGTERM to one process): the flag's mean over the ranks is 1/2, and any
    rank's flag must stop the whole job after that iteration with its save. Read as a majority (> 0.5) the job ran
    on to --max-iterations; the torchrun signal test caught that only by waiting out its time limit."""
    run_ranks(stop_on_one_rank_body, 2, args=(small_tracking(tmp_path, iterations=4),))
    assert checkpoints(tmp_path) == ["model_1.pt"]


def test_a_finished_run_gives_the_signals_back(tmp_path):
    """Mutant: main() returning with its stop-request handlers still installed. A program that trains and then goes on
    (a sweep, a notebook) must get Ctrl-C back as KeyboardInterrupt and SIGTERM as the default end, not a stop request
    noted for an iteration that never comes."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)          # something else, so that the test sees them set back
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        train.main(small_tracking(tmp_path, iterations=1))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
