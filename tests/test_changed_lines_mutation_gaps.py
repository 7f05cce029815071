"""Gaps found by a mutation audit of the lines changed since each module's earlier audit: dist/batches.py and
dist/buffers.py since af08ece, ppo/normalizer.py and ppo/gae.py since 16bfdf4, ppo/minibatch_step.py and ppo/logger.py
since 0296cbd, rollout_ranks.py and rollout_weights.py since c3632bc, dist/checkpoint_read.py since 53e1af3. 112
hand-made mutants of those lines, 85 killed by the earlier tests; each test below fails on one that they let through.
Expected values are written by hand or computed here from the definition (GAE: a per-step float loop).

Pinned (16): a batch layout accepting uint32 or uint64 fields, its refusal without the float64 fix, refusing int8,
uint8, int16, float16 or bfloat16 fields (float32 holds them exactly); a named collective error without the original as
its cause; GAE not bit-identical to the per-step recursion (delta's terms reordered, gamma * lam grouped otherwise);
RunLogger wrapping threading.excepthook again for each logger (the guard dropped or the marker False); the console's
kl column 5 wide when no KL was logged; the learner raising the first weight-serving failure instead of that of the
rank whose batch did not come; a serving thread's failure kept under another key than its rollout rank; an optimizer
group with decoupled_weight_decay=True accepted; a 0-dim env-state entry compared without flattening it first.

Equivalent (8): RewardNormalizer.update's std without the clamp of its count (torch.where picks the old std wherever
count is 0, the 0 / 0 is never chosen); its count-0 fallback replaced by ones (std starts at 1 and changes only where
count > 0, which never goes back to 0); ObsNormalizer's `count > 0` as `count >= 1` (counts are whole numbers); GAE's
advantages from zeros_like instead of empty_like (every row is written); not_done as dones.logical_not() (0 and 1 are
exact either way); failures[dst] = exc instead of setdefault (a serving thread returns after its first failure, so it
records at most one); receive's getattr default None instead of -1 (every CollectiveError out of BatchReceiver.take
comes through naming(), which sets `peer`); check's `dst is not None` as `dst` (a rollout rank is never rank 0, a
learner's). Not worth a test (3): the full-disk message without "(if any)" (twice) and the per-rank env-state message
saying "file" for "checkpoint": wording only, the fix each names stays."""

import atexit
import threading
from types import SimpleNamespace

import pytest
import torch

import rollout_weights
from dist import comm
from dist.batches import Layout, naming
from dist.checkpoint import to_bytes
from dist.checkpoint_read import load_checkpoint
from dist.errors import RunError, UsageError
from ppo.gae import compute_gae
from ppo.logger import RunLogger
from rollout_ranks import LearnerTeam, unpack_team_states
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


def test_a_batch_layout_carries_narrow_integers_and_half_floats_exactly():
    """float32 holds every int8, uint8 and int16 value and every float16 and bfloat16 one: such fields are accepted
    and come back bit for bit, in their own dtype (extremes and a subnormal float16 included).

    Mutant: int16, int8 and uint8, or float16 and bfloat16, added to the refused dtypes."""
    sent = {"a": torch.tensor([-128, 127, 0], dtype=torch.int8), "b": torch.tensor([0, 255], dtype=torch.uint8),
            "c": torch.tensor([-32768, 32767, -1], dtype=torch.int16),
            "d": torch.tensor([65504.0, 2.0**-24, -0.5], dtype=torch.float16),
            "e": torch.tensor([3.0e38, -2.0**-126, 1.0 + 2.0**-7], dtype=torch.bfloat16)}
    layout = Layout({name: (tuple(t.shape), t.dtype) for name, t in sent.items()})
    buffers = layout.buffers("cpu")
    layout.pack(sent, buffers)
    back = layout.unpack(buffers)
    assert buffers[torch.float32].numel() == 14 and buffers[torch.float64].numel() == 0
    for name, tensor in sent.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_rollout_ranks_env_states_with_a_scalar_entry_are_compared():
    """An env state may hold a 0-dim tensor (a curriculum level): the bitwise comparison of the rollout ranks' states
    flattens it first (a 0-dim float32 has no uint8 view), keeps it when equal and names it when not.

    Mutant: .reshape(-1) dropped before .view(torch.uint8) in unpack_team_states."""
    def blob(level):
        state = {"rng/env": torch.zeros(4, dtype=torch.uint8), "env/level": torch.tensor(level)}
        return to_bytes(state), {name: (tuple(v.shape), v.dtype) for name, v in state.items()}

    (same, layout), (other, _) = blob(2.5), blob(3.0)
    spec = {"state_bytes": same.numel(), "state_layout": layout}
    rngs, env = unpack_team_states(torch.cat([same, same]), spec)
    assert len(rngs) == 2 and env["level"].shape == () and env["level"].item() == 2.5
    with pytest.raises(RunError, match=r"^env.state_dict\(\) differs across rollout ranks in 'level' \(nested names "
                                       r"joined by '/'\): rollout rank\(s\) \[1\] hold other values"):
        unpack_team_states(torch.cat([same, other]), spec)
