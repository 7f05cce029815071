"""Rollout ranks at the edges of a run: weights that fail their integrity check, or an env that breaks the VecEnv
protocol at its first step, end a rollout rank with one line, the ledger reads whole while a weight-serving thread
counts, and a learner whose launcher is gone closes its team before it leaves (its rollout rank stops cleanly
instead of finding the groups torn down under it)."""

import threading
from collections import defaultdict

import pytest
import torch

from dist import comm
from tests.test_rollout_ranks import plain_ranks

# Rank 1 (the rollout rank) receives the frame of weights version {version} with its trailer's first checksum
# flipped, as a bit flipped on the way would leave it: sync/ refuses it with a SyncIntegrityError. Version -1 is
# patch's bootstrap at init (the whole initial weights, before any request); version 2 an update.
CORRUPT_VERSION = """
import os
import sync.wire
if os.environ["RANK"] == "1":
    sums = sync.wire.Frame.sums
    def corrupted(self):
        if self.version == {version} and self.trailer is not None:
            self.wait()
            self.trailer[0] ^= 1
        return sums(self)
    sync.wire.Frame.sums = corrupted
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind, version, what", [("patch", 2, "the weights (version 2)"),
                                                 ("bucket", 2, "the weights (version 2)"),
                                                 ("patch", -1, "the initial weights")])
def test_corrupted_weights_end_the_rollout_rank_with_one_line(tmp_path, kind, version, what):
    ranks = plain_ranks(tmp_path, "--rollout.sync", kind, prelude=CORRUPT_VERSION.format(version=version))
    try:
        codes = [job.finish(60) for job in ranks]
        learner, rollout = (job.output() for job in ranks)
        assert codes == [1, 1], learner + rollout
        errors = [line for line in rollout.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in rollout, rollout
        assert errors[0].startswith(f"error: {what} from learner rank 0 failed their integrity check: weight sync: "
                                    f"the checksums of frame version {version} failed their check (trailer corrupted, "
                                    f"or the sender failed while computing them: see its error). "
                                    f"A run-time failure"), rollout
        assert "--resume auto" in errors[0] and "resync()" not in errors[0]    # sync/'s hint is for its own callers
        # the learner fails with its own error for a rollout rank that is gone, without a traceback or an abort
        learner_errors = [line for line in learner.splitlines() if line.startswith("error:")]
        assert len(learner_errors) == 1, learner
        assert learner_errors[0].startswith("error: rollout rank 1 died or stalled"), learner
        assert "Traceback" not in learner and "terminate called" not in learner, learner
    finally:
        for job in ranks:
            job.kill_all()


class ContendedLock:
    """A lock that says (`waited`) when a thread found it taken."""

    def __init__(self, waited: threading.Event):
        self.lock, self.waited = threading.Lock(), waited

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            self.waited.set()
            self.lock.acquire()

    def __exit__(self, *exc_info):
        self.lock.release()


def read_while_a_purpose_is_added(read, monkeypatch):
    """`read()` the ledger while a thread counts a new purpose, the thread started once the read has taken one
    entry and the read resumed once the thread either counted or found the ledger's lock taken (no sleeps: the
    interleaving is forced). Returns what `read()` returned and the ledger afterwards."""
    progress = threading.Event()
    adder = threading.Thread(target=lambda: (comm._count("weight_request", torch.zeros(2, dtype=torch.int64)),
                                             progress.set()))

    class Ledger(defaultdict):
        def items(self):
            for n, item in enumerate(super().items()):
                yield item
                if n == 0 and adder.ident is None:      # the first read only
                    adder.start()
                    assert progress.wait(60), "the counting thread neither counted nor waited for the lock"

    monkeypatch.setattr(comm, "_COUNTING", ContendedLock(progress))
    monkeypatch.setattr(comm, "LEDGER", Ledger(lambda: [0, 0]))
    comm.ledger_add("batches", 2, 200)
    comm.ledger_add("control", 1, 16)
    try:
        seen = read()
    finally:
        if adder.ident is not None:     # started
            adder.join()
    return seen, comm.ledger_snapshot()


def test_a_ledger_snapshot_is_whole_while_a_serving_thread_adds_a_purpose(monkeypatch):
    # The harness does break what train.py did: iterate the ledger while a thread adds a purpose.
    with pytest.raises(RuntimeError, match="dictionary changed size during iteration"):
        read_while_a_purpose_is_added(lambda: {k: list(v) for k, v in comm.LEDGER.items()}, monkeypatch)
    seen, after = read_while_a_purpose_is_added(comm.ledger_snapshot, monkeypatch)
    assert seen == {"batches": (2, 200), "control": (1, 16)}                 # as of one moment: before the thread
    assert after == {**seen, "weight_request": (1, 16)}                      # whose count is kept, not lost


# Rank 0 (the learner) finds its launcher gone at its third iteration (what a SIGKILLed torchrun leaves), while
# rank 1 (the rollout rank, async mode) is still collecting ahead. The learner reports at exit how often it closed
# its team, and whether its weight-serving threads were left to the exit hook (WeightServer.abandon, which runs only
# for a team that was not closed).
LAUNCHER_GONE_AT_3 = """
import atexit, os, time
import dist.stop, rollout_ranks
if os.environ["RANK"] == "0":
    checks, closed = [], []
    def gone(self):
        checks.append(1)
        return len(checks) >= 3
    dist.stop.StopRequests.launcher_gone = gone
    close, abandon = rollout_ranks.LearnerTeam.close, rollout_ranks.WeightServer.abandon
    def counted(self):
        closed.append(1)
        close(self)
    def abandoned(self):
        print(f"serving threads left to the exit hook: {[t.name for t in self.threads if t.is_alive()]}", flush=True)
        abandon(self)
    rollout_ranks.LearnerTeam.close, rollout_ranks.WeightServer.abandon = counted, abandoned
    atexit.register(lambda: print(f"team closed {len(closed)} time(s)", flush=True))
else:
    collect = rollout_ranks.collect_rollout
    def slow(*args, **kwargs):
        time.sleep(0.5)
        return collect(*args, **kwargs)
    rollout_ranks.collect_rollout = slow
"""


@pytest.mark.slow
def test_a_learner_whose_launcher_is_gone_closes_its_team_before_it_leaves(tmp_path):
    ranks = plain_ranks(tmp_path, "--rollout.mode", "async", prelude=LAUNCHER_GONE_AT_3)
    try:
        codes = [job.finish(60) for job in ranks]
        learner, rollout = (job.output() for job in ranks)
        errors = [line for line in learner.splitlines() if line.startswith(("error:", "[syncppo] serving weights"))]
        assert errors == ["error: the launcher (torchrun) is gone: stopped after iteration 3 without saving; the "
                          "last periodic checkpoint is kept"], learner
        assert codes[0] == 1 and "team closed 1 time(s)" in learner, learner
        assert "left to the exit hook" not in learner, learner
        # the rollout rank read the stop and said it was done, as after a last iteration: no error of its own
        assert codes[1] == 0 and "error:" not in rollout and "Traceback" not in rollout, rollout
    finally:
        for job in ranks:
            job.kill_all()


@pytest.mark.slow
def test_an_env_only_a_rollout_rank_builds_says_its_error_there_and_the_learner_names_that_rank(tmp_path):
    ranks = plain_ranks(tmp_path, "--env.name", "gymnasium", "--env.task", "NoSuchTask-v0")
    try:
        codes = [job.finish(60) for job in ranks]
        learner, rollout = (job.output() for job in ranks)
        assert codes == [1, 2], learner + rollout
        errors = [line for line in rollout.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "NoSuchTask-v0" in errors[0] and "Traceback" not in rollout, rollout
        learner_errors = [line for line in learner.splitlines() if line.startswith("error:")]
        assert (len(learner_errors) == 1
                and learner_errors[0].startswith("error: rollout rank 1 died or stalled")), learner
    finally:
        for job in ranks:
            job.kill_all()


# Rank 1 (the rollout rank) steps an env that breaks the VecEnv protocol: its rewards come as [N, 1], not [N].
BAD_REWARD_SHAPE = """
import os
if os.environ["RANK"] == "1":
    import envs.cartpole
    step = envs.cartpole.CartPole.step
    def unsqueezed(self, actions):
        obs, reward, terminated, truncated, extras = step(self, actions)
        return obs, reward.unsqueeze(1), terminated, truncated, extras
    envs.cartpole.CartPole.step = unsqueezed
"""


@pytest.mark.slow
def test_an_env_that_breaks_the_protocol_on_a_rollout_rank_is_named_at_its_first_step(tmp_path):
    """The rollout rank checks its first step as a colocated rank does: one line naming the field, status 1 (a
    run-time failure with a known cause, docs/fault_tolerance.md), and the learner names the rank that is gone
    (unchecked, the [N, 1] rewards would broadcast into the rollout)."""
    ranks = plain_ranks(tmp_path, "--env.num-envs", "4", prelude=BAD_REWARD_SHAPE)
    try:
        codes = [job.finish(60) for job in ranks]
        learner, rollout = (job.output() for job in ranks)
        assert codes == [1, 1], learner + rollout
        errors = [line for line in rollout.splitlines() if line.startswith("error:")]
        assert errors == ["error: env 'cartpole': step()'s reward must be a [num_envs] = [4] tensor, got [4, 1] (see "
                          "the VecEnv protocol in envs/base.py)"] and "Traceback" not in rollout, rollout
        learner_errors = [line for line in learner.splitlines() if line.startswith("error:")]
        assert len(learner_errors) == 1, learner
        assert learner_errors[0].startswith("error: rollout rank 1 died or stalled"), learner
    finally:
        for job in ranks:
            job.kill_all()


# The learner's weight-serving thread fails sending version 3 (as a send that timed out would), while its main
# thread waits for batch 3, which the rollout rank cannot collect without those weights.
SERVING_FAILS_AT_3 = """
import os
if os.environ["RANK"] == "0":
    import sync.bucket
    from dist import comm
    sync_ = sync.bucket.BucketSyncer.sync
    def failing(self, state_dict, version):
        if version == 3:
            raise comm.CollectiveError("send for 'weight_sync' failed: injected")
        return sync_(self, state_dict, version)
    sync.bucket.BucketSyncer.sync = failing
"""


@pytest.mark.slow
def test_a_failed_weight_serving_thread_is_the_learners_error_not_its_rollout_rank(tmp_path):
    """The learner's wait for the batch ends within --dist.timeout-s (the rollout groups take it too) and reports
    the serving thread's failure, the cause, not the batch that never came."""
    ranks = plain_ranks(tmp_path, "--rollout.sync", "bucket", "--dist.timeout-s", "5", prelude=SERVING_FAILS_AT_3)
    try:
        codes = [job.finish(60) for job in ranks]
        learner, rollout = (job.output() for job in ranks)
        assert codes == [1, 1], learner + rollout
        errors = [line for line in learner.splitlines() if line.startswith("error:")]
        assert errors == ["error: rollout rank 1 died or stalled: send for 'weight_sync' failed: injected"], learner
        assert "Traceback" not in learner and "Traceback" not in rollout, learner + rollout
        assert "error: learner rank 0 died or stalled" in rollout, rollout
    finally:
        for job in ranks:
            job.kill_all()
