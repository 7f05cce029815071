"""train.cli's handling of a failure: the exit status, the one line on stderr (an unexpected exception's traceback
and first words, out of memory naming the sizes to lower) and the same line in torchrun's error file, dated so that
torchrun names the rank that failed first; the process group and run directories released; a usage error said once
per node (first_on_node: local rank 0, or an unreadable one)."""

import json
import sys
import time

import pytest
import torch

import train
from configs.config import Config
from dist import comm
from dist.errors import RunError, UsageError, tell_torchrun
from dist.stop import SecondInterrupt


@pytest.mark.parametrize("local_rank, first", [(None, True), ("0", True), (" 0 ", True), ("1", False), ("x", True),
                                               ("-1", True)])
def test_first_on_node_is_local_rank_0_or_an_unreadable_one(monkeypatch, local_rank, first):
    """Unset means one process (local rank 0); a value main() will refuse counts as first, so the refusal is said."""
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert train.first_on_node() is first


def _failing_cli(monkeypatch, capsys, failure, local_rank="0"):
    """train.cli around a main() that raises `failure`: (status, stderr, what was torn down and told to torchrun)."""
    events = []

    def main(cfg, typed):
        if failure is not None:
            raise failure
    monkeypatch.setattr(train, "main", main)
    monkeypatch.setattr(train, "shutdown", lambda: events.append("shutdown"))
    monkeypatch.setattr(train, "release_run_dirs", lambda: events.append("release"))
    monkeypatch.setattr(train, "tell_torchrun", lambda message, after_peer=False:
                        events.append(("torchrun", message, "after peer") if after_peer else ("torchrun", message)))
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(sys, "last_value", None, raising=False)
    monkeypatch.setattr(sys, "last_exc", None, raising=False)
    code = train.cli(Config())
    return code, capsys.readouterr().err, events


@pytest.mark.parametrize("failure, code, said", [
    (UsageError("--ppo.clip-param must be > 0"), 2, "error: --ppo.clip-param must be > 0"),
    (RunError("could not write x: No space left"), 1, "error: could not write x: No space left"),
    (comm.CollectiveError("all_reduce for 'metrics' failed on rank 1"), 1,
     "error: all_reduce for 'metrics' failed on rank 1"),
    (KeyboardInterrupt(), 130, "error: interrupted by Ctrl-C outside the training loop: nothing saved since the last "
                               "checkpoint"),
    (SecondInterrupt(), 130, "error: interrupted by a second Ctrl-C: nothing saved since the last checkpoint"),
], ids=["usage", "run", "collective", "ctrl-c", "second-ctrl-c"])
def test_cli_gives_each_failure_its_status_and_one_line_and_tears_down(monkeypatch, capsys, failure, code, said):
    """Status 2 for bad input, 1 for a run-time failure, 130 for Ctrl-C; one line on stderr, the same line for
    torchrun's error file (dated after the peer's failure when a collective failed), the process group and run
    directories released, the failure recorded as uncaught."""
    status, err, events = _failing_cli(monkeypatch, capsys, failure)
    assert (status, err) == (code, said + "\n")
    told = ("torchrun", said) + (("after peer",) if isinstance(failure, comm.CollectiveError) else ())
    assert events == [told, "shutdown", "release"]
    # Recorded as the status the process ends with (what Isaac Lab's exit handler hands Kit), the failure its context.
    assert isinstance(sys.last_value, SystemExit) and sys.last_value.code == code
    assert sys.last_value.__context__ is failure and sys.last_exc is sys.last_value


def test_cli_prints_an_unexpected_exception_s_traceback_and_its_first_line(monkeypatch, capsys):
    """A bug: its traceback, then 'unexpected <type> (traceback above): <first line of its message>', status 1."""
    status, err, events = _failing_cli(monkeypatch, capsys, ZeroDivisionError("float division by zero\nmore"))
    said = "error: unexpected ZeroDivisionError (traceback above): float division by zero"
    assert status == 1 and err.startswith("Traceback (most recent call last):")
    assert err.endswith("ZeroDivisionError: float division by zero\nmore\n" + said + "\n")
    assert events == [("torchrun", said), "shutdown", "release"]


@pytest.mark.parametrize("failure, said", [
    (AssertionError(), "error: unexpected AssertionError (traceback above)"),
    (KeyError(""), "error: unexpected KeyError (traceback above): ''"),
    (RuntimeError("\n  gloo detail\nmore"), "error: unexpected RuntimeError (traceback above): gloo detail"),
])
def test_an_unexpected_exception_s_line_is_its_first_words_or_its_type_alone(monkeypatch, capsys, failure, said):
    """A bare `assert` has no message: the line ends at its type, not ': ' (was 'AssertionError (traceback above): ');
    a message whose first line is blank shows its first words (was ': ' and nothing).
    Mutant: str(exc).splitlines()[0] for the first line -> the blank-first-line case shows nothing."""
    status, err, events = _failing_cli(monkeypatch, capsys, failure)
    assert status == 1 and err.endswith("\n" + said + "\n")
    assert events == [("torchrun", said), "shutdown", "release"]


def test_cli_says_an_allocation_the_device_cannot_serve_as_out_of_memory_naming_the_sizes(monkeypatch, capsys):
    """torch's CPU allocator raises a plain RuntimeError (here a real one, 2**62 bytes); it is not a bug but sizes
    too large (validation's memory estimate is a lower bound, so a size it passes can still fail here): status 1,
    the traceback, and a line naming the flags."""
    with pytest.raises(RuntimeError) as allocation:
        torch.empty(2**62, dtype=torch.uint8)
    status, err, _ = _failing_cli(monkeypatch, capsys, allocation.value)
    first = str(allocation.value).splitlines()[0]
    assert status == 1 and err.startswith("Traceback (most recent call last):")
    assert err.endswith(f"error: out of memory (traceback above: where): {first}; this run's sizes need more memory "
                        "than the device has: lower --env.num-envs, --ppo.num-steps, --policy.actor-hidden/"
                        "critic-hidden or the env's own sizes (tracking: --env.num-motions)\n")
    assert train.out_of_memory(MemoryError()) and not train.out_of_memory(RuntimeError("can't allocate a name"))


def test_a_size_past_what_a_storage_can_count_is_out_of_memory_too(monkeypatch, capsys):
    """--env.num-envs 2**62 passes validation; the first buffer's size then overflows before any allocator sees it
    (a plain RuntimeError with other words): that is sizes too large as well, not a bug."""
    with pytest.raises(RuntimeError) as overflow:
        torch.empty(2**62, 4)
    status, err, _ = _failing_cli(monkeypatch, capsys, overflow.value)
    assert status == 1 and "error: out of memory (traceback above: where): Storage size calculation overflowed" in err
    assert "lower --env.num-envs" in err.splitlines()[-1]


def test_a_cuda_allocation_failure_is_out_of_memory_without_torch_s_device_generic_class(monkeypatch):
    """torch.OutOfMemoryError (device-generic, torch.cuda's class under a second name) came after torch 2.4, which
    requirements allow (2.4 or 2.5: accounts differ): where it is missing, checking for it raised AttributeError while
    a failure was being reported."""
    monkeypatch.delattr(torch, "OutOfMemoryError")
    assert train.out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not train.out_of_memory(RuntimeError("a bug"))


@pytest.mark.parametrize("failure, local_rank, said", [
    (UsageError("--seed bad"), "0", True), (UsageError("--seed bad"), "1", False),
    (UsageError("--env.task bad", say_here=True), "1", True),
    (UsageError("--env.task bad", say_here=False), "0", False),
    (RunError("disk full"), "1", True)])
def test_cli_says_a_usage_error_once_per_node_unless_it_names_who_says_it(monkeypatch, capsys, failure, local_rank,
                                                                         said):
    """Every rank meets the same bad flag: local rank 0 says it; an error only some ranks meet says `say_here`; a
    run-time failure is said by every rank that meets it. torchrun's error file gets it either way."""
    status, err, events = _failing_cli(monkeypatch, capsys, failure, local_rank)
    assert bool(err) is said and events[0] == ("torchrun", f"error: {failure}")


def test_cli_returns_0_after_a_run_and_tears_nothing_down_itself(monkeypatch, capsys):
    """main() shuts its own process group down; cli adds nothing after a run that ended well."""
    assert _failing_cli(monkeypatch, capsys, None) == (0, "", [])


def test_torchrun_names_the_rank_that_failed_first_not_the_one_that_saw_it_die(tmp_path, monkeypatch):
    """torchrun's root cause is the failure with the smallest whole-second timestamp, a tie going to the rank it
    recorded first: a rollout rank that only saw its learner die was named in 5 of 8 learner failures. Its error,
    a failed collective, is now dated a second later (torch's own ChildFailedError picks the root cause here)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    monkeypatch.setattr(time, "time", lambda: 1_000_000.7)       # both in one second
    failures = {}
    for rank, message, after_peer in ((1, "error: learner rank 0 died or stalled", True),   # recorded first
                                      (0, "error: could not write x: No space left", False)):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error_{rank}.json"))
        tell_torchrun(message, after_peer=after_peer)
        failures[rank] = ProcessFailure(local_rank=rank, pid=rank + 1, exitcode=1,
                                        error_file=str(tmp_path / f"error_{rank}.json"))
    rank, first = ChildFailedError("train.py", failures).get_first_failure()
    assert (rank, first.message, first.timestamp) == (0, "error: could not write x: No space left", 1_000_000)
    assert failures[1].timestamp == 1_000_001
    # by default (any other failure) the error is dated when it happened
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error_2.json"))
    tell_torchrun("error: could not write y")
    assert json.loads((tmp_path / "error_2.json").read_text()) == {"message": "error: could not write y",
                                                                   "timestamp": 1_000_000}


@pytest.mark.parametrize("preset, default", [("tracking", 400), ("cartpole", 100)])
def test_a_mistyped_flag_is_matched_in_the_named_preset_alone(preset, default):
    """`train.py tracking --max-iteration 3` listed the close match once per preset, each with that preset's default
    (19 lines for one letter; h83's audit); the parser is offered the named preset alone (configs.cli_presets), and
    every preset when the first word is not one. Mutant: cli_presets returning every preset -> four defaults."""
    from tests.test_config_errors import run_cli
    out = run_cli(preset, "--max-iteration", "3")
    said = out.stdout + out.stderr
    assert out.returncode == 2 and "--max-iterations INT" in said, said
    assert said.count("(default: ") == 1 and f"(default: {default})" in said, said
    listed = run_cli("walker")
    assert listed.returncode == 2 and "cartpole, tracking, mujoco, isaaclab" in listed.stdout + listed.stderr
