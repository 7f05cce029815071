"""Gaps found by a mutation audit of the lines changed since each module's earlier audit: dist/batches.py and
dist/buffers.py since af08ece, ppo/normalizer.py and ppo/gae.py since 16bfdf4, ppo/minibatch_step.py and ppo/logger.py
since 0296cbd, rollout_ranks.py and rollout_weights.py since c3632bc, dist/checkpoint_read.py since 53e1af3. 95
hand-made mutants of those lines, 78 killed by the earlier tests; each test below fails on one that they let through.
Expected values are written by hand or computed here from the definition (GAE: a per-step float loop).

Pinned: a batch layout accepting uint32 or uint64 fields, its refusal without the float64 fix; a named collective
error without the original as its cause; GAE not bit-identical to the per-step recursion (delta's terms reordered,
gamma * lam grouped otherwise); RunLogger wrapping threading.excepthook again for each logger (the guard dropped or
the marker False); the console's kl column 5 wide when no KL was logged; the learner raising the first weight-serving
failure instead of that of the rank whose batch did not come; a serving thread's failure kept under another key than
its rollout rank; an optimizer group with decoupled_weight_decay=True accepted.

Equivalent or not worth a test: RewardNormalizer.update's std without the clamp of its count (torch.where picks the
old std wherever count is 0, the 0 / 0 is never chosen); its count-0 fallback replaced by ones (std starts at 1 and
changes only where count > 0, which never goes back to 0); GAE's advantages from zeros_like instead of empty_like
(every row is written); failures[dst] = exc instead of setdefault (a serving thread returns after its first failure,
so it records at most one); receive's getattr default None instead of -1 (every CollectiveError out of
BatchReceiver.take comes through naming(), which sets `peer`); the full-disk message without "(if any)" (wording only:
the fix it names, free space or another --log.root, stays)."""

import atexit
import threading
from types import SimpleNamespace

import pytest
import torch

import rollout_weights
from dist import comm
from dist.batches import Layout, naming
from dist.checkpoint_read import load_checkpoint
from dist.errors import UsageError
from ppo.gae import compute_gae
from ppo.logger import RunLogger
from rollout_ranks import LearnerTeam
from rollout_weights import WeightServer
from sync import WeightSyncConfig
from tests.test_checkpoint_read_rules import _saved, _with_group
from tests.test_rollout_weights import GUARD_S, learner


@pytest.mark.parametrize("dtype", [torch.uint32, torch.uint64])
def test_a_batch_layout_refuses_unsigned_wide_integers_too(dtype):
    """uint32 and uint64 travel as float32 like int32 and int64, and lose the same digits past 2**24.

    Mutant: torch.uint32 or torch.uint64 dropped from the refused dtypes."""
    with pytest.raises(ValueError) as exc:
        Layout({"x": ((2,), torch.float32), "ids": ((3,), dtype)})
    assert str(exc.value) == (f"batch layout: fields {{'ids': '{dtype}'}} would travel as float32, which rounds "
                              f"integers past 2**24; send them as float64")


def test_a_named_collective_error_keeps_the_original_as_its_cause():
    """The traceback of a failed message shows gloo's own error beneath the one that names the peer.

    Mutant: `raise error from None` in naming()."""
    original = comm.CollectiveError("recv for 'batches' failed on rank 0: timed out")
    with pytest.raises(comm.CollectiveError) as exc:
        with naming(3):
            raise original
    assert str(exc.value) == "rollout rank 3 died or stalled: recv for 'batches' failed on rank 0: timed out"
    assert exc.value.__cause__ is original and exc.value.peer == 3


def per_step_gae(rewards, values, dones, last_values, gamma, lam):
    """GAE as the per-step recursion from its definition, one step at a time, in the dtype of the inputs."""
    advantages, next_advantage, next_values = torch.empty_like(rewards), torch.zeros_like(last_values), last_values
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t].to(rewards.dtype)
        delta = rewards[t] + gamma * not_done * next_values - values[t]
        next_advantage = delta + gamma * lam * not_done * next_advantage
        advantages[t] = next_advantage
        next_values = values[t]
    return advantages


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gae_has_the_bits_of_the_per_step_recursion(dtype):
    """compute_gae precomputes delta and the decay for all steps, in the per-step recursion's operations and order:
    the advantages are the same bits, not only close (gamma 0.998 and lam 0.95 round differently in float32 when
    grouped as lam * (gamma * not_done)).

    Mutant: delta = rewards - values + gamma * not_done * next_values; decay = lam * (gamma * not_done)."""
    g = torch.Generator().manual_seed(7)
    rewards, values = torch.randn(32, 6, generator=g, dtype=dtype), torch.randn(32, 6, generator=g, dtype=dtype)
    dones, last = torch.rand(32, 6, generator=g) < 0.1, torch.randn(6, generator=g, dtype=dtype)
    advantages, returns = compute_gae(rewards, values, dones, last, 0.998, 0.95)
    expected = per_step_gae(rewards, values, dones, last, 0.998, 0.95)
    assert torch.equal(advantages, expected)
    assert torch.equal(returns, expected + values)


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


def test_the_learner_raises_the_serving_failure_of_the_rank_whose_batch_did_not_come(monkeypatch):
    """Rollout rank 2 stalled: the learner's wait for its batch fails, named. A failure of the thread serving rank 1
    (a healthy rank that timed out waiting for the learner) is not the cause and is not raised; rank 2's own
    thread's failure is.

    Mutant: self.weights.check() (the first failure of any thread) in LearnerTeam.receive."""
    monkeypatch.setattr(rollout_weights, "make_weight_syncer", lambda cfg, rank, dsts, group: None)
    team = LearnerTeam.__new__(LearnerTeam)
    team.weights = WeightServer(WeightSyncConfig(type="bucket"), 0, [1, 2], None, 1.0)

    def take():
        with naming(2):
            raise comm.CollectiveError("wait for 'batches' failed on rank 0: timed out")
    team.receiver = SimpleNamespace(take=take)
    healthy, own = comm.CollectiveError("rank 1's request timed out"), comm.CollectiveError("rank 2's send failed")
    team.weights.failures = {1: healthy}
    with pytest.raises(comm.CollectiveError) as exc:
        team.receive(0)
    assert str(exc.value) == "rollout rank 2 died or stalled: wait for 'batches' failed on rank 0: timed out"
    team.weights.failures = {1: healthy, 2: own}
    with pytest.raises(comm.CollectiveError) as exc:
        team.receive(0)
    assert exc.value is own


def test_a_serving_thread_keeps_its_failure_under_its_rollout_rank(monkeypatch):
    """check(dst) finds the failure of the thread serving `dst` only if the thread keeps it under `dst`.

    Mutant: self.failures.setdefault(-1, exc) in serve."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    link, model, server = learner(monkeypatch)
    try:
        server.start(model, 0)
        link.requests.put(comm.CollectiveError("recv for 'weight_request' failed on rank 0: injected"))
        server.threads[0].join(GUARD_S)
        assert not server.threads[0].is_alive()
        server.check(2)                                # no thread of rank 2 failed: nothing to raise
        with pytest.raises(comm.CollectiveError) as exc:
            server.check(1)
        assert str(exc.value) == "rollout rank 1 died or stalled: recv for 'weight_request' failed on rank 0: injected"
        assert list(server.failures) == [1]
    finally:
        atexit.unregister(server.abandon)


def test_an_optimizer_group_with_decoupled_weight_decay_is_refused(tmp_path):
    """decoupled_weight_decay=True turns torch's Adam into AdamW, which no syncppo run builds: loaded as saved, it
    would change how the weight decay acts.

    Mutant: "decoupled_weight_decay" dropped from ADAM_VARIANTS."""
    path = _saved(tmp_path, _with_group(decoupled_weight_decay=True))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its optimizer param group 0 has "
                              f"{{'decoupled_weight_decay': True}}, which the Adam syncppo builds never has); resume "
                              f"from another checkpoint")
