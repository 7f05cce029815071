"""ppo/logger.py's RunLogger: threading.excepthook wrapped once however many loggers are made, and the console's kl
column as wide without a KL as with one."""

import threading

from ppo.logger import RunLogger


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
