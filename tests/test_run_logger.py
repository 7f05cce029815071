"""ppo/logger.py's RunLogger: threading.excepthook wrapped once however many loggers are made, and the console's kl
column as wide without a KL as with one; the console line (iteration count, formats, ETA) against a fake clock, `-`
for non-finite metrics, every tag of a `log` call written at its step (read back with TensorBoard's
EventAccumulator), a run directory that does not exist yet, a full disk under TensorBoard's writer thread, warnings
for non-finite scalars and skipped update steps, and the wait past the newest earlier event file (fake clock, no
sleeping). Expected values are computed here by hand, never by the code under test."""

import math
import os
import textwrap
import threading

import pytest

from dist.errors import RunError
from ppo import logger as logger_module
from ppo.logger import RunLogger, leave_writer_oserrors, wait_past_earlier_event_files
from tests.forked_python import run_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_second_run_logger_does_not_wrap_the_thread_hook_again(tmp_path, monkeypatch):
    """Each RunLogger (a bench, tests, a retried start) must leave threading.excepthook wrapped once: a wrapper per
    logger chains hooks without end.

    Mutant: the `leaves_writer_oserrors` guard dropped, or the marker set to False."""
    def original(args):
        raise AssertionError("not called here")
    monkeypatch.setattr(threading, "excepthook", original)
    loggers = [RunLogger(str(tmp_path / "run"), max_iterations=5, start_iteration=0, steps_per_iteration=4)]
    wrapped = threading.excepthook
    loggers.append(RunLogger(str(tmp_path / "other"), max_iterations=5, start_iteration=0, steps_per_iteration=4))
    for logger in loggers:
        logger.close()
    assert wrapped is not original and threading.excepthook is wrapped


def test_the_kl_column_is_as_wide_without_a_kl(tmp_path, capsys):
    """No KL (no update step taken) prints `-` right-aligned in the 6 columns of a KL such as 0.2500.

    Mutant: _fmt(scalars.get('Policy/kl'), 5, '.4f')."""
    logger = RunLogger(str(tmp_path / "run"), max_iterations=5, start_iteration=0, steps_per_iteration=4)
    line = {"Perf/total_fps": 1.0, "Loss/learning_rate": 1e-3}
    logger.print_line(0, {**line, "Policy/kl": 0.25})
    logger.print_line(1, line)
    logger.close()
    with_kl, without = [out for out in capsys.readouterr().out.splitlines() if out.startswith("it ")]
    assert "  kl 0.2500  lr 1.0e-03  " in with_kl
    assert "  kl      -  lr 1.0e-03  " in without


class FakeClock:
    """Stands in for the `time` module of ppo/logger.py: `time()` reads `now`, `sleep(s)` advances it."""

    def __init__(self, now: float):
        self.now, self.sleeps = now, []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += 0.25


def tb_scalars(run_dir: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_console_line_counts_formats_and_eta_by_hand(tmp_path, monkeypatch, capsys):
    clock = FakeClock(1000.0)
    monkeypatch.setattr(logger_module, "time", clock)
    logger = RunLogger(str(tmp_path), max_iterations=10, start_iteration=2, steps_per_iteration=4)  # from model_2.pt
    clock.now = 1120.0
    # Iteration index 5 is the 6th of 10 and the 4th of this process: 120 s / 4 x 4 left = 120 s = 2.0 min.
    logger.print_line(5, {"Perf/total_fps": 1234.4, "Train/mean_reward": 3.5, "Train/mean_episode_length": 20.0,
                          "Policy/kl": 0.0123, "Loss/learning_rate": 3e-4})
    logger.close()
    assert capsys.readouterr().out == ("it     6/10       1234 steps/s  reward     3.50  ep_len   20.0  "
                                       "kl 0.0123  lr 3.0e-04  ETA   2.0 min\n")


def test_console_line_prints_a_dash_for_a_non_finite_metric(tmp_path, capsys):
    logger = RunLogger(str(tmp_path), 10, 0, 4)
    logger.print_line(0, {"Perf/total_fps": 1.0, "Policy/kl": 0.0, "Loss/learning_rate": 1e-3,
                          "Train/mean_reward": float("nan"), "Train/mean_episode_length": float("inf")})
    logger.close()
    line = capsys.readouterr().out
    assert "reward        -  ep_len      -" in line and "nan" not in line and "inf" not in line


def test_every_tag_of_a_log_call_is_written_at_its_step_in_a_new_run_directory(tmp_path):
    run_dir = str(tmp_path / "cartpole" / "2026-01-01_12-00-00")        # does not exist yet: a fresh run
    logger = RunLogger(run_dir, max_iterations=5, start_iteration=0, steps_per_iteration=4)
    logger.log({"Train/mean_reward": 1.5, "Policy/kl": 0.25, "Loss/learning_rate": 0.125}, step=1)
    logger.log({"Train/mean_reward": 2.5, "Policy/kl": 0.5, "Loss/learning_rate": 0.0625}, step=2)
    logger.close()
    assert tb_scalars(run_dir, "Train/mean_reward") == [(1, 1.5), (2, 2.5)]
    assert tb_scalars(run_dir, "Policy/kl") == [(1, 0.25), (2, 0.5)]
    assert tb_scalars(run_dir, "Loss/learning_rate") == [(1, 0.125), (2, 0.0625)]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")    # the writer thread is silent
@pytest.mark.parametrize("when", ["start", "log"])
def test_a_full_disk_under_tensorboard_is_a_one_line_error_naming_the_run_directory(tmp_path, monkeypatch, when):
    """TensorBoard writes from a thread of its own; the OSError it meets (a --log.root disk that filled up, at the
    start or mid-run) is re-raised by the next write or flush, and cli() reported it as a bug: `error: unexpected
    OSError (traceback above): [Errno 28] No space left on device`, with no path."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    def disk_full(self, data):
        raise OSError(28, "No space left on device")
    run_dir = str(tmp_path / "run")
    threads_before = set(threading.enumerate())
    if when == "log":
        logger = RunLogger(run_dir, max_iterations=5, start_iteration=0, steps_per_iteration=4)
    monkeypatch.setattr(RecordWriter, "write", disk_full)
    with pytest.raises(RunError, match=f"could not write TensorBoard events in {run_dir}: No space left on device; "):
        if when == "start":
            RunLogger(run_dir, max_iterations=5, start_iteration=0, steps_per_iteration=4)
        else:
            logger.log({"Policy/kl": 0.25}, step=1)
    # Joined here: a traceback of the writer thread would be this test's (an error, above), not a later test's.
    for thread in set(threading.enumerate()) - threads_before:
        thread.join(timeout=30)


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("error, fix", [(OSError(30, "Read-only file system"), "make {d} writable again"),
                                        (OSError(28, "No space left on device"), "free space on that disk")])
def test_a_tensorboard_write_error_says_what_to_fix_by_its_cause_and_names_the_last_checkpoint(tmp_path, monkeypatch,
                                                                                              error, fix):
    """TensorBoard's write error advised freeing space whatever the cause, and named no checkpoint ('(if any)').

    Mutant: RunLogger.writing's message without write_error_advice's errno (always 'free space ...') fails the
    read-only case; without the last checkpoint, both."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    def failing(self, data):
        raise error
    run_dir = tmp_path / "run"
    threads_before = set(threading.enumerate())
    logger = RunLogger(str(run_dir), max_iterations=5, start_iteration=0, steps_per_iteration=4)
    (run_dir / "model_5.pt").write_bytes(b"")
    monkeypatch.setattr(RecordWriter, "write", failing)
    with pytest.raises(RunError) as info:
        logger.log({"Policy/kl": 0.25}, step=6)
    assert str(info.value).startswith(f"could not write TensorBoard events in {run_dir}: {error.strerror}; "
                                      f"{fix.format(d=run_dir)}")
    assert str(info.value).endswith(f", then resume from the last checkpoint, {run_dir / 'model_5.pt'}")
    for thread in set(threading.enumerate()) - threads_before:
        thread.join(timeout=30)


def test_only_the_writer_thread_s_oserror_is_left_to_the_next_write():
    """Any other thread's failure, and any other error of the writer thread, still reaches the hook it wraps."""
    seen, writer = [], type("_AsyncWriterThread", (threading.Thread,), {})()
    calls = [(OSError(28, "full"), writer), (ValueError("bug"), writer), (OSError(5, "io"), threading.Thread())]
    for error, thread in calls:
        leave_writer_oserrors(seen.append)(threading.ExceptHookArgs((type(error), error, None, thread)))
    assert [args.exc_value for args in seen] == [calls[1][0], calls[2][0]]


def test_a_non_finite_scalar_is_written_as_is_and_said_once_per_tag(tmp_path, capsys):
    """A NaN in an env's log value (one rank's sum poisons the all-reduced mean) used to reach TensorBoard silently,
    where the curve just stops drawing: now one warning per tag, and the value is still written."""
    run_dir = str(tmp_path / "run")
    logger = RunLogger(run_dir, max_iterations=5, start_iteration=0, steps_per_iteration=4)
    logger.log({"Episode/torque": float("nan"), "Policy/kl": 0.25}, step=1)
    logger.log({"Episode/torque": float("nan"), "Policy/kl": float("inf")}, step=2)
    logger.log({"Episode/torque": 1.5, "Policy/kl": 0.5}, step=3)
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in out] == ["[syncppo] warning: Episode/torque is nan at iteration 1",
                                                     "[syncppo] warning: Policy/kl is inf at iteration 2"]
    torque = tb_scalars(run_dir, "Episode/torque")
    assert [step for step, _ in torque] == [1, 2, 3] and math.isnan(torque[0][1]) and torque[2][1] == 1.5


def test_skipped_update_steps_are_said_once_and_counted_on_every_console_line(tmp_path, capsys):
    """An env whose rewards were 1e30 (finite, so accepted) made every gradient norm inf: each step was skipped and
    the run trained nothing, with nothing on the console. Now one warning at the first skip, `skipped k/n` after."""
    logger = RunLogger(str(tmp_path / "run"), max_iterations=5, start_iteration=0, steps_per_iteration=20)
    line = {"Perf/total_fps": 1.0, "Policy/kl": 0.0, "Loss/learning_rate": 1e-3}
    for step, skipped in ((1, 0.0), (2, 3.0), (3, 20.0)):
        logger.log({"Train/nonfinite_skipped_steps": skipped}, step)
        logger.print_line(step - 1, {**line, "Train/nonfinite_skipped_steps": skipped})
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in out if "warning" in line] == [
        "[syncppo] warning: 3 of 20 update steps at iteration 2 had a non-finite gradient norm and were skipped"]
    printed = [line.split(" min", 1)[1] for line in out if line.startswith("it ")]     # what follows the ETA
    assert printed == ["", "  skipped 3/20", "  skipped 20/20"]


def test_an_iteration_is_on_disk_when_log_returns_even_if_the_process_then_ends_abruptly(tmp_path):
    """A process that ends without closing the writer (os._exit after a weight-serving thread's bug, kill -9) keeps
    every logged iteration and its episode returns: the writer flushed only every 2 minutes, so it lost them."""
    script = tmp_path / "log_then_exit.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {REPO!r})
        from ppo.logger import RunLogger
        logger = RunLogger({str(tmp_path / "run")!r}, max_iterations=5, start_iteration=0, steps_per_iteration=4)
        logger.log({{"Train/mean_reward": 1.5}}, 1, [3.0, -1.25])
        logger.log({{"Train/mean_reward": 2.5}}, 2)
        os._exit(1)
    """))
    assert run_python([str(script)]).returncode == 1                # a process of its own: tests/forked_python.py
    assert tb_scalars(str(tmp_path / "run"), "Train/mean_reward") == [(1, 1.5), (2, 2.5)]
    assert tb_scalars(str(tmp_path / "run"), "Episode/return") == [(1, 3.0), (1, -1.25)]


T = 1_700_000_000


def test_wait_lasts_until_the_second_after_the_newest_event_file(tmp_path, monkeypatch):
    for name in (f"events.out.tfevents.{T - 5}.host.1.0",          # older attempt
                 f"events.out.tfevents.{T + 1}.host.2.0",          # newest: made in the second T + 1
                 "events.out.tfevents.corrupt",                    # no creation second: not an event file name
                 f"notevents.out.tfevents.{T + 9}.host.3.0",       # not an event file
                 f"model_{T + 9}.pt"):
        (tmp_path / name).write_bytes(b"")
    clock = FakeClock(T + 0.5)
    monkeypatch.setattr(logger_module, "time", clock)
    wait_past_earlier_event_files(str(tmp_path))
    assert clock.now == T + 2.0 and all(0 < s <= 0.1 for s in clock.sleeps)     # the first instant past T + 1


def test_no_wait_when_every_event_file_is_older_or_there_is_no_directory(tmp_path, monkeypatch):
    (tmp_path / f"events.out.tfevents.{T - 1}.host.1.0").write_bytes(b"")
    clock = FakeClock(T + 0.5)
    monkeypatch.setattr(logger_module, "time", clock)
    wait_past_earlier_event_files(str(tmp_path))
    wait_past_earlier_event_files(str(tmp_path / "missing"))
    assert clock.sleeps == [] and clock.now == T + 0.5
