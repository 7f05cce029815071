"""dist/batches.py's BatchReceiver and BatchSender in one process: tests/p2p_wire.py's `Wire` stands in for dist.comm's
point-to-point calls between simulated ranks (the test says which rank is calling), matching a posted receive to the
messages of its peer in posting order, as gloo does, and counting the receives posted and the sends waited for. The gloo
versions of these checks are slow tests (tests/test_rollout_transport_rules.py); these run in milliseconds."""

import torch

from dist.batches import BatchReceiver, BatchSender, Layout
from tests.p2p_wire import Wire

LAYOUT = Layout({"x": ((2,), torch.float32), "flags": ((1,), torch.float64)})


def batch(k: int) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([float(k), k + 0.5]), "flags": torch.tensor([k], dtype=torch.float64)}


def test_the_learner_keeps_depth_receives_posted_none_past_the_run_and_takes_batches_oldest_first(monkeypatch):
    """depth 2, iterations 0..2, the rollout rank (1) has sent all three batches ahead: the first take posts the
    receives of iterations 0 and 1 (2 messages each: 4), the second those of 2 (6), the third none (the run ends
    at 3); the batches come back in the order sent.
    Mutant: `len(self.slots[0]) <= self.depth` or `self.next_posted <= self.end` in take; `pop()` (the newest
    posted receive taken first)."""
    wire = Wire(monkeypatch)
    wire.me = 1
    sender = BatchSender(0, None, LAYOUT, 3, torch.device("cpu"))
    for k in range(3):
        sender.send(batch(k))
    wire.me = 0
    receiver = BatchReceiver([1], None, LAYOUT, 3, 2, 0, 3, torch.device("cpu"))
    seen, posted = [], []
    for _ in range(3):
        (got,) = receiver.take()
        seen.append((got["x"].tolist(), got["flags"].tolist()))
        posted.append(wire.posted)
    assert seen == [([0.0, 0.5], [0.0]), ([1.0, 1.5], [1.0]), ([2.0, 2.5], [2.0])]
    assert posted == [4, 6, 6]


def decisions_waited(monkeypatch, depth: int) -> list[list[bool]]:
    """After each of 4 decide() calls of a learner with rollout ranks [1, 2]: which control sends were waited for."""
    wire = Wire(monkeypatch)
    receiver = BatchReceiver([1, 2], None, LAYOUT, 3, depth, 0, 4, torch.device("cpu"))
    out = []
    for k in range(4):
        receiver.decide(False, k == 1)
        out.append([w.waited for w in wire.sends])
    receiver.close()
    assert all(w.waited for w in wire.sends)
    return out


def test_decide_waits_for_every_decision_older_than_the_last_depth_minus_1(monkeypatch):
    """depth 1: each decide waits for both sends of the previous decision first; depth 2: for those of the one
    before the previous (the rollout ranks read decision i before they send batch i + depth).
    Mutant: `> self.depth * len(self.rollouts)` in decide (one decision per rank more left unwaited)."""
    t, f = True, False
    assert decisions_waited(monkeypatch, 1) == [[f, f], [t, t, f, f], [t, t, t, t, f, f], [t] * 6 + [f, f]]
    assert decisions_waited(monkeypatch, 2) == [[f, f], [f, f, f, f], [t, t, f, f, f, f], [t] * 4 + [f] * 4]


def test_a_rollout_rank_reads_stop_and_save_apart_and_the_states_come_in_rank_order(monkeypatch):
    """Learner 0 decides (stop, save) = (True, False), then (False, True): rollout ranks 1 and 2 read exactly those;
    at the save each sends 3 bytes of its rank, concatenated in rollout-rank order (1's, then 2's), though rank 2
    sent first. Mutant: `return bool(save), bool(stop)` in decision; the blobs concatenated in another order."""
    wire = Wire(monkeypatch)
    receiver = BatchReceiver([1, 2], None, LAYOUT, 3, 1, 0, 2, torch.device("cpu"))
    receiver.decide(True, False)
    receiver.decide(False, True)
    for rank in (2, 1):
        wire.me = rank
        sender = BatchSender(0, None, LAYOUT, 3, torch.device("cpu"))
        assert [sender.decision(), sender.decision()] == [(True, False), (False, True)]
        sender.send_state(torch.full((3,), rank, dtype=torch.uint8))
    wire.me = 0
    assert receiver.states().tolist() == [1, 1, 1, 2, 2, 2]
