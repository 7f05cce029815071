"""How a rollout rank and its learner end a run, and the rollout rank's check of its env's numbers (rollout_ranks.py),
each caught at once rather than by a run waiting out a timeout. The faults these tests catch:

- the rollout rank's bookkeeping of decisions read (`decided`) one off, its last decision read skipped, or a stop
  read after its last collection ignored: the learner waits for a read or a state that never comes (or the rollout
  rank for a decision or weights never sent). A rollout rank run in-process against a scripted learner that says so
  at once pins which messages it sends and reads, in which order (in sync and async mode, at saves and at stops);
- its `check_finite` dropped: a NaN reward reached the learner's normalizer, which checks only what its own envs
  produce;
- the learner leaving without waiting for its weight-serving threads (`weights.close()`): a rollout rank that asks
  for its final weights a little late found the learner gone.
- a rollout rank past its own stop flag (it collects nothing more, resending its last batch) skipping the
  sampler-count sums the other rollout ranks still enter: their collective pairs with its save's.

Equivalent (no test can tell it apart): LearnerTeam.close without `receiver.close()`. A rollout rank says `done` only
after reading every decision sent to it, and `weights.close()` right after waits for that `done`, so every `control`
send has completed by then (the gloo works left unwaited are complete; runs of real processes exit 0 without an
abort). Also equivalent, of the stopping path: the resent batch's stop flags cleared (the learners stop at the
flagged batch's iteration at the latest and never take the resent ones), the stopping branch taken only in async mode
(in sync mode the flagged batch's decision, a stop, is read before the next collection), `sent` starting as None
(read only once a batch has set `stopping`).
"""

import time
from types import SimpleNamespace

import pytest
import torch

import rollout_ranks
from configs import preset
from dist import comm
from dist.errors import RunError
from tests.multirank import run_ranks
from tests.test_rollout_ranks import body, small


class Deadlock(AssertionError):
    """A message the real peer would never match: the run would wait out --dist.timeout-s."""


class ScriptedLearner:
    """A learner as the rollout rank's messages let it go on, with no time of its own: per iteration i it takes batch
    i (its receives posted `depth` batches ahead, none past the run), sends its (stop, save), waits at a save for the
    rollout rank's state, publishes weights i + 1 unless it stopped (after `stop_after`, as on a signal, or after a
    batch that carries a stop flag, as train.py does); then it closes: every decision read, `done` said. Records what
    reached it: each batch's weight version, the states, the batches that carried a stop flag."""

    def __init__(self, start: int, end: int, depth: int, save_every: int, stop_after=None):
        self.start, self.depth, self.published, self.posted, self.closed = start, depth, start, start - 1, False
        self.batches, self.decisions, self.states, self.read, self.done = {}, [], set(), 0, False
        self.flagged = set()
        self.next_batch = start
        self.script = self.iterations(start, end, save_every, stop_after)
        self.waits = next(self.script)

    def iterations(self, start, end, save_every, stop_after):
        for i in range(start, end):
            self.posted = max(self.posted, min(i + self.depth, end) - 1)     # BatchReceiver.take posts ahead
            yield "batch", i
            stop = i == stop_after or i in self.flagged
            save = (i + 1) % save_every == 0 or i + 1 == end or stop           # train.py's rule
            self.decisions.append((stop, save))
            if save:
                yield "state", i
            if stop:
                break
            self.published = i + 1
        self.closed = True
        yield "close", None

    def pump(self):
        while (self.waits[0] == "batch" and self.waits[1] in self.batches) or \
                (self.waits[0] == "state" and self.waits[1] in self.states):
            self.waits = next(self.script)

    # ----- what the rollout rank calls: BatchSender's methods and request_weights -----------------------------------

    def send(self, tensors):
        k = self.next_batch
        if self.closed or k > self.posted:
            raise Deadlock(f"batch {k} sent, but the learner (waiting for {self.waits}) never posts its receive")
        self.batches[k], self.next_batch = int(tensors["flags"][0]), k + 1     # flags[0]: the weights' version
        if tensors["flags"][1:].any():                                          # a signal, or the launcher gone
            self.flagged.add(k)
        self.pump()

    def decision(self):
        if self.read >= len(self.decisions):
            raise Deadlock(f"decision {self.read} read, but the learner (waiting for {self.waits}) never sends it")
        self.read += 1
        return self.decisions[self.read - 1]

    def send_state(self, blob):
        i = self.start + self.read - 1           # the iteration of the decision it read last
        if self.waits != ("state", i):
            raise Deadlock(f"a state sent after decision {self.read - 1}, but the learner waits for {self.waits}")
        self.states.add(i)
        self.pump()

    def request(self, syncer, copy, learner, group, have, need):
        if need < 0:
            if not self.closed or self.read < len(self.decisions):
                raise Deadlock(f"done said with {len(self.decisions) - self.read} decision(s) unread; the learner "
                               f"waits for {self.waits}")
            self.done = True
            return have
        if self.published < need:
            raise Deadlock(f"weights {need} asked for, but the learner (waiting for {self.waits}) published "
                           f"{self.published} and publishes no more")
        return max(have, self.published)


def cartpole(iterations, mode="sync", staleness=1, save_every=2):
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations, cfg.log.save_every = 4, 4, iterations, save_every
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (8,)
    cfg.rollout.ranks, cfg.rollout.mode, cfg.rollout.max_staleness, cfg.dist.device = 1, mode, staleness, "cpu"
    return cfg


def run_against(learner, cfg, monkeypatch, start=0):
    """Rollout rank 1 of a 1 + 1 layout, in this process, its messages going to `learner`."""
    monkeypatch.setattr(comm, "_GROUP", comm._GROUP)          # run_rollout_rank's use_group, undone after the test
    monkeypatch.setattr(rollout_ranks, "make_weight_syncer", lambda *a: SimpleNamespace(
        init_receiver=lambda copy: start - 1, plan_rows=lambda: []))
    monkeypatch.setattr(rollout_ranks, "send_object", lambda *a: 0)
    monkeypatch.setattr(rollout_ranks, "BatchSender", lambda *a: SimpleNamespace(
        send=learner.send, decision=learner.decision, send_state=learner.send_state, plan_rows=lambda save_every: []))
    monkeypatch.setattr(rollout_ranks, "request_weights", learner.request)
    roles = SimpleNamespace(rollout_index=0, team=[0, 1], rank=1, num_learners=1, num_rollouts=1,
                            weights_group=None, batches_group=None, rollout_group=None)
    return rollout_ranks.run_rollout_rank(cfg, roles, torch.device("cpu"), None, start)


@pytest.mark.parametrize("mode, staleness", [("sync", 0), ("async", 1), ("async", 2)])
@pytest.mark.parametrize("stop_after", [None, 1, 3, 4])
def test_a_rollout_rank_reads_every_decision_in_turn_and_says_done_once_its_learner_closed(monkeypatch, mode,
                                                                                         staleness, stop_after):
    """5 iterations (0-4), saves after 1 and 3 and at the last or at a stop: none; after 1 (read before a later
    collection); after 3 (in async mode read once the rank collected its last batch); after the last (the learner then
    publishes no final weights). Every decision is read in turn, a save's state follows it, no batch is sent that the
    learner would not receive, each batch is collected with weights its bound allows, and `done` comes last."""
    depth = 1 if mode == "sync" else staleness + 1
    learner = ScriptedLearner(0, 5, depth, save_every=2, stop_after=stop_after)
    run_against(learner, cartpole(5, mode, max(staleness, 1)), monkeypatch)
    last = 4 if stop_after is None else stop_after
    assert learner.done and learner.read == len(learner.decisions) == last + 1
    saves = {i for i, (stop, save) in enumerate(learner.decisions) if save}
    assert learner.states == saves and (last in saves)
    # no batch the learner never takes; each collected with weights the bound allows (sync: exactly version k)
    taken = {k: v for k, v in learner.batches.items() if k <= last}
    assert sorted(taken) == list(range(last + 1)) and len(learner.batches) <= last + 1 + depth - 1
    assert all(k - staleness <= v <= k for k, v in taken.items()), learner.batches


@pytest.mark.parametrize("mode, staleness", [("sync", 0), ("async", 1), ("async", 2)])
@pytest.mark.parametrize("flag", ["signal", "launcher"])
def test_a_rollout_rank_that_raised_a_stop_collects_no_batch_past_it(monkeypatch, mode, staleness, flag):
    """A signal reaches the rollout rank while it collects batch 2 of 8 (or it finds its launcher gone): its flag rides
    in batch 2, so the learner stops after iteration 2. In async mode the rank went on collecting batches 3 .. 2 + S,
    which no update would use; now it collects none past 2, and sends the receives its learner posted ahead (depth - 1
    of them) the last batch again. Every decision is still read, the stop's save gets its state, `done` comes last."""
    depth = 1 if mode == "sync" else staleness + 1
    collected, stops = [], []
    collect = rollout_ranks.collect_rollout

    class Requests:                  # dist.stop.StopRequests, raised from inside the third collection
        def __init__(self, watch_launcher):
            self.signal_name, self.gone = None, False
            stops.append(self)

        def launcher_gone(self):
            return self.gone

        @staticmethod
        def restore_default_handlers():
            pass

    def counted(*args, **kwargs):
        collected.append(1)
        if len(collected) == 3:
            stops[0].signal_name, stops[0].gone = ("SIGTERM", False) if flag == "signal" else (None, True)
        return collect(*args, **kwargs)

    monkeypatch.setattr(rollout_ranks, "StopRequests", Requests)
    monkeypatch.setattr(rollout_ranks, "collect_rollout", counted)
    learner = ScriptedLearner(0, 8, depth, save_every=4)
    run_against(learner, cartpole(8, mode, max(staleness, 1), save_every=4), monkeypatch)
    assert learner.done and learner.decisions == [(False, False)] * 2 + [(True, True)]
    assert learner.states == {2} and learner.read == 3
    assert len(collected) == 3, len(collected)
    assert sorted(learner.batches) == list(range(2 + depth))       # every posted receive completed, none more


def test_a_resumed_rollout_rank_counts_decisions_from_its_start(monkeypatch):
    learner = ScriptedLearner(2, 5, 1, save_every=2)
    run_against(learner, cartpole(5), monkeypatch, start=2)
    assert learner.done and learner.read == 3 and learner.batches == {2: 2, 3: 3, 4: 4} and learner.states == {3, 4}


def test_a_nan_reward_on_a_rollout_rank_stops_it_before_its_batch_reaches_the_learner(monkeypatch):
    """The learner checks only batches its own envs collect: a rollout rank's NaN would enter its normalizers."""
    import envs.cartpole
    step = envs.cartpole.CartPole.step

    def nan_at_env_2(self, actions):
        obs, reward, terminated, truncated, extras = step(self, actions)
        return obs, torch.where(torch.arange(len(reward)) == 2, float("nan"), reward), terminated, truncated, extras

    monkeypatch.setattr(envs.cartpole.CartPole, "step", nan_at_env_2)
    learner = ScriptedLearner(0, 3, 1, save_every=2)
    with pytest.raises(RunError, match=r"^env 'cartpole' produced nan in reward at step 0 \(0-based\) of iteration 1 "
                                       r"in env 2 on rank 1; "):
        run_against(learner, cartpole(3), monkeypatch)
    assert learner.batches == {}


def late_final_request(rank, world_size, cfg):
    """train.main on a 1 + 1 layout whose rollout rank asks for its final weights only a while after it read the last
    decision (a slow rollout rank): the learner must still be there to serve them and take its `done`."""
    if rank == 1:
        request = rollout_ranks.request_weights

        def late(syncer, copy, learner, group, have, need):
            if need == cfg.max_iterations:
                time.sleep(2)                 # widens the window; the original never depends on it
            return request(syncer, copy, learner, group, have, need)

        rollout_ranks.request_weights = late
    return body(rank, world_size, cfg, cfg.max_iterations)


@pytest.mark.slow
def test_a_learner_leaves_only_once_its_rollout_rank_took_the_final_weights(tmp_path):
    results = run_ranks(late_final_request, 2, args=(small(tmp_path, iterations=2, ranks=1, sync="bucket"),))
    learner, copy = results[0][0], results[1][0]
    for key, value in learner.items():
        assert torch.equal(copy[key], value), key
    for rank, (_, _, ledger, expected) in enumerate(results):
        assert ledger == expected, f"rank {rank}"     # the learner counted the final request and the done


def tracking(iterations, staleness):
    """`cartpole`'s layout on the tracking env, whose motion sampler's counts the rollout ranks sum among them."""
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations, cfg.log.save_every = 4, 4, iterations, 4
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (8,)
    cfg.rollout.ranks, cfg.rollout.mode, cfg.rollout.max_staleness = 1, "async", staleness
    cfg.dist.device, cfg.dist.sampler_sync_every = "cpu", 2
    return cfg


@pytest.mark.parametrize("signalled", [True, False], ids=["own-flag", "stopped-by-the-learner"])
def test_a_rollout_rank_past_its_own_stop_still_sums_sampler_counts_where_the_other_rollout_ranks_do(monkeypatch,
                                                                                                   signalled):
    """The sampler-count sum is a collective among the rollout ranks: one whose own stop flag rode in batch 2 collects
    nothing more, but the others still collect and sum, so it must enter the sum at every iteration they do (else the
    others' iteration-3 sum pairs with its save's, or waits out --dist.timeout-s). Async S = 2, sums after every 2nd
    iteration, saves every 4: by hand, as (batches sent, decisions read) at each sum: after batch 1 (2, 0); after
    batch 3, a resend when signalled (4, 1); at the stop's save, in decision 2's read (5, 3). A rank that raised no
    flag, stopped after iteration 2 by its learner (as on another rank's flag), sums at the same points."""
    stops, sums, collected = [], [], []
    collect, summed = rollout_ranks.collect_rollout, rollout_ranks.sum_counts

    class Requests:                  # dist.stop.StopRequests, raised from inside the third collection
        def __init__(self, watch_launcher):
            self.signal_name = None
            stops.append(self)

        @staticmethod
        def launcher_gone():
            return False

        @staticmethod
        def restore_default_handlers():
            pass

    def counted(*args, **kwargs):
        collected.append(1)
        if len(collected) == 3 and signalled:
            stops[0].signal_name = "SIGTERM"
        return collect(*args, **kwargs)

    learner = ScriptedLearner(0, 8, 3, save_every=4, stop_after=None if signalled else 2)

    def recorded(sampler):
        sums.append((learner.next_batch, learner.read))
        return summed(sampler)

    monkeypatch.setattr(rollout_ranks, "StopRequests", Requests)
    monkeypatch.setattr(rollout_ranks, "collect_rollout", counted)
    monkeypatch.setattr(rollout_ranks, "sum_counts", recorded)
    run_against(learner, tracking(8, 2), monkeypatch)
    assert learner.done and learner.decisions == [(False, False)] * 2 + [(True, True)] and learner.states == {2}
    assert len(collected) == (3 if signalled else 5)
    assert sums == [(2, 0), (4, 1), (5, 3)]
