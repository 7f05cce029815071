"""Rollout ranks under failure and over long runs: a failing learner exits with its one-line error (no abort from
a weight-serving thread still inside gloo), a bug in a weight-serving thread ends the job at once, and the learner
does not keep every decision it ever sent."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from dist import comm
from dist.batches import BatchReceiver, BatchSender, Layout
from tests.multirank import run_processes, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Rank 0 (the learner) fails at iteration 1; rank 1 (the rollout rank) takes 2 s to exit after it notices, as a
# rollout rank busy collecting would. An exit handler registered before the learner's WeightServer starts runs
# after the WeightServer's own (last in, first out): it records which serving threads are still alive once the
# interpreter is about to finalize; a thread still blocked in gloo then aborts the process when it wakes.
SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading, time
    sys.path.insert(0, {root!r})
    import tyro
    import train, rollout_ranks
    from configs import cli_presets
    from dist.errors import RunError

    if os.environ["RANK"] == "0":
        def report():
            alive = [t.name for t in threading.enumerate() if t.name.startswith("weights-to-rank") and t.is_alive()]
            print(f"serving threads alive at exit: {{alive}}", flush=True)
        atexit.register(report)
        receive = rollout_ranks.LearnerTeam.receive
        def failing(self, iteration):
            if iteration == 1:
                time.sleep(1)          # the rollout rank has its weights by now: the thread waits for a request
                raise {error}("injected learner failure")
            return receive(self, iteration)
        rollout_ranks.LearnerTeam.receive = failing
    else:
        shutdown = train.shutdown
        def slow_shutdown():
            time.sleep(2)
            shutdown()
        train.shutdown = slow_shutdown
    sys.argv = ["train.py", *sys.argv[1:]]
    sys.exit(train.cli(tyro.extras.overridable_config_cli(cli_presets(sys.argv[1:]))))
""")


def learner_and_rollout_rank(script, tmp_path) -> tuple[list, list]:
    """Run `script` as rank 0 (the learner) and rank 1 (its rollout rank) of a cartpole job with --dist.timeout-s
    3600; return their exit codes and outputs. Waiting out that timeout fails the 60 s bound."""
    codes, outputs = run_processes([sys.executable, str(script), "cartpole", "--max-iterations", "100", "--log.root",
                                    str(tmp_path), "--rollout.ranks", "1", "--dist.timeout-s", "3600"], 2, ROOT, 60,
                                   stderr=subprocess.STDOUT)
    return codes, [out for out, _ in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("error", ["RunError", "ZeroDivisionError"])
def test_a_failing_learner_exits_with_its_error_not_an_abort(tmp_path, error):
    """A run-time failure, and an unexpected exception (a bug): its traceback, then the same one line and the same
    teardown; the rollout rank fails at once, on the closed connection, not after --dist.timeout-s (3600 s here:
    waiting it out fails the test's 60 s bound; an unexpected exception used to leave the process group up, so it
    did)."""
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT.format(root=ROOT, error=error))
    codes, outputs = learner_and_rollout_rank(script, tmp_path)
    learner = outputs[0]
    assert "serving threads alive at exit: []" in learner, learner
    assert codes[0] == 1 and "terminate called" not in learner, learner
    errors = [line for line in learner.splitlines() if line.startswith(("error:", "[syncppo] serving weights"))]
    expected = "error: injected learner failure" if error == "RunError" else \
        "error: unexpected ZeroDivisionError (traceback above): injected learner failure"
    assert errors == [expected], learner          # one line, the learner's own
    assert ("Traceback" in learner) == (error != "RunError"), learner
    assert codes[1] == 1 and "learner rank 0 died or stalled" in outputs[1], outputs[1]
    assert re.search(r"Connection (closed|reset) by peer", outputs[1]), outputs[1]   # a peer gone, not a timeout


SERVING_BUG = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    import tyro
    import train
    from configs import cli_presets
    from sync.patch import PatchSyncer

    if os.environ["RANK"] == "0":
        sync = PatchSyncer.sync
        def failing(self, state, version):
            if version == 3:
                raise ZeroDivisionError("injected serving failure")
            return sync(self, state, version)
        PatchSyncer.sync = failing
    sys.argv = ["train.py", *sys.argv[1:]]
    sys.exit(train.cli(tyro.extras.overridable_config_cli(cli_presets(sys.argv[1:]))))
""")


@pytest.mark.slow
def test_a_bug_in_the_weight_serving_thread_ends_the_job_at_once(tmp_path):
    """The rollout rank waits for the weights and the learner for the batch that needs them: nothing ended either
    wait before --dist.timeout-s (3600 s here; the test's bound is 60 s). The learner now ends with the thread's
    traceback and one line, and its rollout rank fails on the closed connection."""
    script = tmp_path / "serving_bug.py"
    script.write_text(SERVING_BUG.format(root=ROOT))
    codes, (learner, rollout) = learner_and_rollout_rank(script, tmp_path)
    errors = [line for line in learner.splitlines() if line.startswith("error:")]
    assert errors == ["error: serving weights to rank 1 failed: unexpected ZeroDivisionError: injected serving "
                      "failure"], learner
    assert codes[0] == 1 and "Traceback" in learner, learner
    assert codes[1] == 1 and "learner rank 0 died or stalled" in rollout, rollout
    assert re.search(r"Connection (closed|reset) by peer", rollout), rollout


# Rank 1 (the rollout rank) fails in its env's step at iteration 2. Rank 0 (the learner) waits, before it tears its
# process group down, until its weight-serving thread is out of its receive (failed on the closed connection): the
# thread's failure then comes while the learner still has its group, as it may in any run.
ROLLOUT_STEP_FAILS = textwrap.dedent("""
    import os, sys, threading
    sys.path.insert(0, {root!r})
    import tyro
    import train
    from configs import cli_presets

    if os.environ["RANK"] == "1":
        import envs.cartpole
        step, steps = envs.cartpole.CartPole.step, []
        def failing(self, actions):
            steps.append(1)
            if len(steps) == 2 * 32 + 5:            # in the third batch of 32 steps
                raise RuntimeError("injected env failure")
            return step(self, actions)
        envs.cartpole.CartPole.step = failing
    else:
        shutdown = train.shutdown
        def after_the_serving_thread():
            for thread in threading.enumerate():
                if thread.name.startswith("weights-to-rank"):
                    thread.join(30)
            shutdown()
        train.shutdown = after_the_serving_thread
    sys.argv = ["train.py", *sys.argv[1:]]
    sys.exit(train.cli(tyro.extras.overridable_config_cli(cli_presets(sys.argv[1:]))))
""")


@pytest.mark.slow
def test_a_failed_rollout_rank_is_one_line_on_its_learner(tmp_path):
    """A run-time failure is one line from the rank that met it (docs/fault_tolerance.md): the learner's names the
    rollout rank that is gone and why it thinks so. Its weight-serving thread, failing on the same closed
    connection, printed a second line (`[syncppo] serving weights to rank 1 failed: ...`). The receive that failed names
    rank 1 too (dist/comm.py: a point-to-point message's peer).

    Mutant: `_named("irecv", purpose)` / `_Work(..., "irecv", purpose)` without the peer in dist/comm.py's irecv."""
    script = tmp_path / "step_fails.py"
    script.write_text(ROLLOUT_STEP_FAILS.format(root=ROOT))
    codes, (learner, rollout) = learner_and_rollout_rank(script, tmp_path)
    assert codes == [1, 1], learner + rollout
    assert "error: unexpected RuntimeError (traceback above): injected env failure" in rollout, rollout
    said = [line for line in learner.splitlines() if "rank 1" in line or "error" in line.lower()]
    assert len(said) == 1, "\n".join(said)
    assert said[0].startswith("error: rollout rank 1 died or stalled: ") and \
        "failed on rank 0: rank 1 died (its connection closed) (" in said[0], learner     # the peer, not "a peer rank"
    assert "Traceback" not in learner, learner


# A Ctrl-C during start-up: the rollout rank has its stop handlers and takes the SIGINT as a stop request; the learner,
# still starting, gets a KeyboardInterrupt (here at its first receive, before it reads the rollout rank's flag).
INTERRUPTED_AT_START = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import tyro
    import train, rollout_ranks
    from configs import cli_presets

    if os.environ["RANK"] == "0":
        def interrupted(self, iteration):
            raise KeyboardInterrupt
        rollout_ranks.LearnerTeam.receive = interrupted
    else:
        class Interrupted(rollout_ranks.StopRequests):
            def __init__(self, watch_launcher):
                super().__init__(watch_launcher)
                self._on_signal(signal.SIGINT, None)      # what the handler does with the SIGINT torchrun forwards
        rollout_ranks.StopRequests = Interrupted
    sys.argv = ["train.py", *sys.argv[1:]]
    sys.exit(train.cli(tyro.extras.overridable_config_cli(cli_presets(sys.argv[1:]))))
""")


@pytest.mark.slow
def test_a_ctrl_c_at_start_up_is_an_interrupt_on_the_rollout_rank_not_its_learners_death(tmp_path):
    """A Ctrl-C that found the learner still starting and its rollout rank already collecting: the learner says it
    was interrupted, and so does the rollout rank, whose receive failed on the connection the learner closed. It said
    `error: learner rank 0 died or stalled ...` (about 1 run in 10 of a Ctrl-C at start-up under torchrun).
    Mutant: drop the `except comm.CollectiveError` clause of run_rollout_rank's loop (rollout_ranks.py)."""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED_AT_START.format(root=ROOT))
    codes, (learner, rollout) = learner_and_rollout_rank(script, tmp_path)
    said = "error: interrupted by Ctrl-C outside the training loop: nothing saved since the last checkpoint"
    assert codes == [130, 130], learner + rollout
    assert said in learner.splitlines(), learner
    assert said in rollout.splitlines() and "died or stalled" not in rollout, rollout


# A rank killed while it writes its error file for torchrun: a failed run restores the default handlers, so torchrun's
# SIGTERM (sent once a peer failed, e.g. a rollout rank that saw its learner killed) ends it mid-write.
KILLED_WHILE_TELLING = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, {root!r})
    from dist.errors import tell_torchrun
    if {kill}:
        def dump(obj, f):
            f.write('{{"message": "err')
            f.flush()
            os.kill(os.getpid(), signal.SIGTERM)
        json.dump = dump
    tell_torchrun("error: learner rank 0 died or stalled")
""")


@pytest.mark.parametrize("killed", [True, False])
def test_torchrun_can_read_the_error_file_of_a_rank_killed_while_writing_it(tmp_path, killed):
    """torchrun parses the error file of every failed rank; a truncated one crashed it with a JSONDecodeError
    traceback in place of its failure summary (seen at a learner's kill -9: its rollout rank's line and torchrun's
    SIGTERM came together). Now the file is complete or absent (the summary then says `error_file: <N/A>`)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    error_file = tmp_path / "error.json"
    proc = subprocess.run([sys.executable, "-c", KILLED_WHILE_TELLING.format(root=ROOT, kill=killed)],
                          env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}, timeout=60)
    assert proc.returncode == (-15 if killed else 0)
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=proc.returncode, error_file=str(error_file))
    if killed:        # what torchrun says of a rank that wrote no file
        assert failure.message.startswith("Signal 15 (SIGTERM) received") and failure.error_file == "<N/A>"
    else:
        assert failure.message == "error: learner rank 0 died or stalled" and failure.error_file == str(error_file)
        assert [p.name for p in tmp_path.iterdir()] == ["error.json"]     # nothing left aside


def decisions_kept(rank, world_size, depth, iterations):
    """A learner and its rollout rank exchange `iterations` batches and decisions, the rollout rank reading each
    decision `depth - 1` iterations late (as in async mode); the learner reports how many sent decisions it keeps."""
    group = torch.distributed.new_group([0, 1])
    layout = Layout({"x": ((3,), torch.float32), "flags": ((1,), torch.float64)})
    if rank == 0:
        receiver = BatchReceiver([1], group, layout, 0, depth, 0, iterations, torch.device("cpu"))
        kept, seen = [], []
        for _ in range(iterations):
            seen.append(receiver.take()[0]["x"][0].item())
            receiver.decide(False, False)
            kept.append(len(receiver.decisions))
        receiver.close()
        return kept, seen
    sender = BatchSender(0, group, layout, 0, torch.device("cpu"))
    read = 0
    for k in range(iterations):
        while read < k - (depth - 1):
            assert sender.decision() == (False, False)
            read += 1
        sender.send({"x": torch.full((3,), float(k)), "flags": torch.zeros(1, dtype=torch.float64)})
    while read < iterations:
        sender.decision()
        read += 1
    return comm.LEDGER["control"][0]


@pytest.mark.slow
def test_the_learner_keeps_only_the_decisions_not_yet_read():
    for depth in (1, 3):
        (kept, seen), reads = run_ranks(decisions_kept, 2, args=(depth, 12))
        assert seen == [float(k) for k in range(12)] and reads == 12
        # decision i is read before batch i + depth is sent, so at most `depth` of them can still be unread; and the
        # learner waits for none of those (a wait for a decision not yet read stalls it until the rollout rank reads)
        assert kept == [min(i + 1, depth) for i in range(12)], (depth, kept)
