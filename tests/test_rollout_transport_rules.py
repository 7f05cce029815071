"""The rollout-rank transport (dist/batches.py) and the learner's side of it (rollout_ranks.py), piece by piece: how
a layout packs each dtype, how batches of several rollout ranks are joined and checked, the order of their states,
what the plan rows count for a team of two, and which saved RNG state each rollout rank takes back."""

from types import SimpleNamespace

import pytest
import torch

from configs import preset
from dist import comm
from dist.batches import (BatchReceiver, BatchSender, Layout, concat_batches, flatten_state, naming, recv_object,
                          send_object, setup_plan_row, to_bytes)
from dist.errors import RunError
from dist.plan import expected_ledger
from rollout_ranks import LearnerTeam, batch_layout, restore_rollout_rng, unpack_team_states
from tests.multirank import run_ranks


# ----- Layout: float64 fields travel as float64, every other dtype as float32 ----------------------------------

def _layout() -> Layout:
    return Layout({"a": ((2, 3), torch.float32), "done": ((2,), torch.bool), "v": ((3,), torch.float64),
                   "b": ((1,), torch.float32)})


def test_a_layout_sizes_its_two_messages_by_dtype():
    """float32 message: a (6) + done (2) + b (1) = 9 elements = 36 bytes; float64 message: v (3) = 24 bytes."""
    layout = _layout()
    assert layout.sizes() == {torch.float32: 9, torch.float64: 3}
    assert layout.message_bytes() == [36, 24]
    assert {dtype: b.numel() for dtype, b in layout.buffers("cpu").items()} == {torch.float32: 9, torch.float64: 3}


def test_a_layout_packs_fields_in_order_and_unpacks_them_with_their_own_dtype():
    """1 + 2**-40 and 2**53 + 2 have no float32 value: they survive only in the float64 message. A bool field
    travels as 0./1. floats and comes back a bool tensor."""
    layout = _layout()
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "done": torch.tensor([True, False]),
               "v": torch.tensor([1 + 2**-40, 2.0**53 + 2, -3.0], dtype=torch.float64), "b": torch.tensor([7.5])}
    out = layout.buffers("cpu")
    layout.pack(tensors, out)
    assert out[torch.float32].tolist() == [0, 1, 2, 3, 4, 5, 1, 0, 7.5]        # a, done, b in field order
    assert out[torch.float64].tolist() == [1 + 2**-40, 2.0**53 + 2, -3.0]
    back = layout.unpack(out)
    assert list(back) == ["a", "done", "v", "b"]
    assert back["done"].dtype == torch.bool and back["done"].tolist() == [True, False]
    assert back["v"].dtype == torch.float64 and back["v"].tolist() == [1 + 2**-40, 2.0**53 + 2, -3.0]
    assert back["a"].shape == (2, 3) and back["a"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_the_batch_layout_keeps_dones_boolean_and_the_flags_in_float64():
    layout = batch_layout(T=2, N=3, obs_dims={"policy": 4, "critic": 5}, num_actions=1, num_keys=2,
                          episode_returns=False)
    assert layout.fields["dones"] == ((2, 3), torch.bool)
    assert layout.fields["flags"] == ((3,), torch.float64) and layout.fields["last_critic_obs"] == ((3, 5),
                                                                                                    torch.float32)
    # float32: obs 2*3*(4+5) + actions, mean, std 3*2*3*1 + log_probs, values, rewards, bootstrap, dones 5*6
    # + last_critic_obs 3*5 = 54 + 18 + 30 + 15 = 117; float64: flags 3 + sums 2 + counts 2 = 7
    assert layout.sizes() == {torch.float32: 117, torch.float64: 7}


# ----- concat_batches: joined along the env axis --------------------------------------------------------------

def test_batches_of_two_rollout_ranks_join_into_the_batch_of_all_their_envs():
    """A [T, 2N] batch split into its first and second N envs and joined back is the batch itself; the
    [N, D] bootstrap observations join along their first axis."""
    T, N = 3, 2
    whole = {"actor_obs": torch.randn(T, 2 * N, 4), "rewards": torch.randn(T, 2 * N),
             "dones": torch.rand(T, 2 * N) > 0.5, "last_critic_obs": torch.randn(2 * N, 5)}
    halves = [{k: (v[:N] if k == "last_critic_obs" else v[:, :N]) for k, v in whole.items()},
              {k: (v[N:] if k == "last_critic_obs" else v[:, N:]) for k, v in whole.items()}]
    joined = concat_batches(halves)
    assert sorted(joined) == sorted(whole)
    for key, value in whole.items():
        assert joined[key].shape == value.shape and torch.equal(joined[key], value), key


# ----- naming: a failed message names the peer ----------------------------------------------------------------

@pytest.mark.parametrize("peer, role, who", [
    (3, "learner", "learner rank 3 died or stalled, or a rank it waits for (another rollout rank of its team or "
                   "another learner)"),
    (2, "rollout", "rollout rank 2 died or stalled")])
def test_a_failed_message_names_the_peer_and_its_role(peer, role, who):
    with pytest.raises(comm.CollectiveError) as exc:
        with naming(peer, role):
            raise comm.CollectiveError("batches: recv timed out")
    assert str(exc.value) == f"{who}: batches: recv timed out" and exc.value.peer == peer


def test_a_receive_the_learner_cannot_even_post_names_the_rollout_rank(monkeypatch):
    """A rollout rank that died between two iterations makes gloo refuse the next receive as it is posted (topping
    up in take()), not only when it is waited for: that error named only the purpose ("irecv for 'batches' failed"),
    and a test that kills a rollout rank (test_rollout_ranks.py) met it now and then."""
    def refused(tensor, purpose, src, group=None):
        raise comm.CollectiveError(f"irecv for {purpose!r} failed on rank 0: rank {src} died")
    monkeypatch.setattr(comm, "irecv", refused)
    receiver = BatchReceiver([2], None, TINY, 3, 1, 0, 5, torch.device("cpu"))
    with pytest.raises(comm.CollectiveError) as exc:
        receiver.take()
    assert str(exc.value) == "rollout rank 2 died or stalled: irecv for 'batches' failed on rank 0: rank 2 died"


def object_body(rank, world_size, obj):
    """Rank 1 sends `obj` pickled to rank 0 (send_object); each returns what it got and its ledger."""
    comm.reset_ledger()
    got = send_object(obj, 0, None, "setup") if rank == 1 else recv_object(1, None, "setup")
    return got, comm.ledger_snapshot()


@pytest.mark.slow
def test_a_pickled_description_arrives_whole_and_both_ends_count_its_size_then_its_bytes():
    """A size header (one int64) then the pickle's bytes: the receiver returns the object and the pickle's size,
    and each end counts 8 + size bytes in two calls, as the plan row says."""
    import pickle
    obj = {"num_envs": 4, "obs_dims": {"policy": 4, "critic": 5}, "log_keys": ("a", "b")}
    size = len(pickle.dumps(obj))
    (received, learner_ledger), (sent_size, rollout_ledger) = run_ranks(object_body, 2, args=(obj,))
    assert received == (obj, size) and sent_size == size
    assert learner_ledger == rollout_ledger == {"setup": (2, 8 + size)}
    assert setup_plan_row([size], "recv").call_bytes == [8, size]


# ----- a learner and one rollout rank: receives posted ahead, decisions, states ------------------------------

TINY = Layout({"x": ((2,), torch.float32), "flags": ((1,), torch.float64)})


def posted_ahead(rank, world_size, depth, end):
    """A learner takes `end` batches with `depth` receives posted ahead and decides (stop, save) = (t == end - 1,
    t odd) for batch t, collecting the rollout rank's 3-byte state at saves; its rollout rank reads decision t
    before it sends batch t + depth, as run_rollout_rank does."""
    group = torch.distributed.new_group([0, 1])
    if rank == 0:
        receiver = BatchReceiver([1], group, TINY, 3, depth, 0, end, torch.device("cpu"))
        seen, posted, states = [], [], []
        for t in range(end):
            batch = receiver.take()[0]
            seen.append((batch["x"].tolist(), batch["flags"].tolist()))
            posted.append((receiver.next_posted, len(receiver.slots[0])))
            receiver.decide(t == end - 1, t % 2 == 1)
            if t % 2 == 1:
                states.append(receiver.states().tolist())
        receiver.close()
        return seen, posted, states
    sender = BatchSender(0, group, TINY, 3, torch.device("cpu"))
    decisions = []

    def read():
        decisions.append(sender.decision())
        if decisions[-1][1]:
            sender.send_state(torch.full((3,), len(decisions), dtype=torch.uint8))

    for k in range(end):
        while len(decisions) < k - (depth - 1):
            read()
        sender.send({"x": torch.tensor([k, k + 0.25]), "flags": torch.tensor([1 + k * 2.0**-40], dtype=torch.float64)})
    while len(decisions) < end:
        read()
    return decisions


@pytest.mark.slow
@pytest.mark.parametrize("depth", [1, 3])
def test_the_learner_posts_depth_receives_ahead_but_none_past_the_last_iteration(depth):
    """After taking batch t the learner has posted the receives of batches 0 .. min(t + depth, end) - 1: the ones
    of t + 1 .. on are still outstanding. Decisions arrive in order with stop and save apart, and the state of a
    save is the one the rollout rank sent after reading that decision (decisions 2 and 4 are saves)."""
    end = 5
    (seen, posted, states), decisions = run_ranks(posted_ahead, 2, args=(depth, end), timeout=60)
    assert seen == [([k, k + 0.25], [1 + k * 2.0**-40]) for k in range(end)]
    assert posted == [(min(t + depth, end), min(t + depth, end) - (t + 1)) for t in range(end)]
    assert decisions == [(False, False), (False, True), (False, False), (False, True), (True, False)]
    assert states == [[2, 2, 2], [4, 4, 4]]


# ----- a learner and two rollout ranks: batches, decisions and states of both, plan == ledger --------------------

def team_of_two(rank, world_size):
    """Learner 0 and rollout ranks 1, 2 run 2 iterations (depth 1); the second is a save. Every rank returns its
    ledger of the three purposes and what its plan rows predict for them."""
    group = torch.distributed.new_group([0, 1, 2])
    comm.reset_ledger()
    if rank == 0:
        receiver = BatchReceiver([1, 2], group, TINY, 3, 1, 0, 2, torch.device("cpu"))
        seen = []
        for t in range(2):
            seen.append([b["x"].tolist() for b in receiver.take()])
            receiver.decide(False, t == 1)
        states = receiver.states().tolist()
        receiver.close()
        plan = receiver.plan_rows(save_every=2)
        out = seen, states
    else:
        sender = BatchSender(0, group, TINY, 3, torch.device("cpu"))
        decisions = []
        for t in range(2):
            sender.send({"x": torch.tensor([10.0 * rank + t, -1.0]), "flags": torch.zeros(1, dtype=torch.float64)})
            decisions.append(sender.decision())
        sender.send_state(torch.full((3,), rank, dtype=torch.uint8))
        plan = sender.plan_rows(save_every=2)
        out = decisions
    ledger = {k: v for k, v in comm.LEDGER.items() if k in ("batches", "control", "checkpoint")}
    return out, {k: list(v) for k, v in ledger.items()}, expected_ledger(plan, 2, final_iteration=2)


@pytest.mark.slow
def test_a_learner_of_two_rollout_ranks_hears_both_in_rank_order_and_its_plan_counts_both():
    """Per iteration the learner receives 2 messages (float32 x: 8 bytes, float64 flags: 8 bytes) from each of its 2
    rollout ranks and sends each a 16-byte decision; at the save each sends 3 bytes of state, concatenated in
    rank order (rank 1's, then rank 2's)."""
    (learner, ledger, predicted), *rollouts = run_ranks(team_of_two, 3, timeout=60)
    seen, states = learner
    assert seen == [[[10.0, -1.0], [20.0, -1.0]], [[11.0, -1.0], [21.0, -1.0]]]
    assert states == [1, 1, 1, 2, 2, 2]
    assert ledger == {"batches": [2 * 2 * 2, 2 * 2 * 16], "control": [2 * 2, 2 * 2 * 16], "checkpoint": [2, 2 * 3]}
    assert predicted == ledger
    for decisions, their_ledger, their_plan in rollouts:
        assert decisions == [(False, False), (False, True)]
        assert their_ledger == {"batches": [4, 32], "control": [2, 32], "checkpoint": [1, 3]} == their_plan


# ----- LearnerTeam: the agreed spec of two rollout ranks ------------------------------------------------------

def _cfg(mode="async", max_staleness=2):
    cfg = preset("cartpole")
    cfg.rollout.mode, cfg.rollout.max_staleness, cfg.max_iterations, cfg.log.save_every = mode, max_staleness, 3, 2
    return cfg


def _spec(num_envs, state_bytes=5):
    return {"obs_dims": {"policy": 4, "critic": 4}, "num_actions": 1, "num_envs": num_envs, "log_keys": (),
            "layout": TINY, "state_layout": {"rng/torch": ((state_bytes,), torch.uint8)}, "state_bytes": state_bytes}


def team_setup(rank, world_size, second_num_envs):
    """Rollout ranks 1 and 2 send their specs (rank 2's with `second_num_envs` envs); learner 0 builds its team."""
    batches, weights = torch.distributed.new_group([0, 1, 2]), torch.distributed.new_group([0, 1, 2])
    if rank != 0:
        send_object(_spec(4 if rank == 1 else second_num_envs), 0, batches, "setup")
        return None
    roles = SimpleNamespace(rank=0, team=[0, 1, 2], batches_group=batches, weights_group=weights)
    try:
        team = LearnerTeam(_cfg(), roles, torch.device("cpu"), 0)
    except RunError as exc:
        return str(exc)
    team.weights = SimpleNamespace(plan_rows=lambda: [])          # the weight rows are rollout_weights.py's
    gathered = [(r.collective, r.call_bytes, r.every) for r in team.plan_rows() if r.collective == "gather"]
    return team.num_envs, team.receiver.depth, team.receiver.rollouts, gathered


@pytest.mark.slow
def test_a_learner_counts_the_envs_and_states_of_both_rollout_ranks_and_posts_s_plus_1_ahead():
    """2 rollout ranks x 4 envs = 8 envs to learn from; async with S = 2 keeps 3 receives posted; the gather of
    the team's states to learner 0 at a save carries 2 x 5 bytes."""
    learner, _, _ = run_ranks(team_setup, 3, args=(4,), timeout=60)
    assert learner == (8, 3, [1, 2], [("gather", [10], 2)])


@pytest.mark.slow
def test_a_rollout_rank_with_another_number_of_envs_is_named_by_the_learner():
    learner, _, _ = run_ranks(team_setup, 3, args=(6,), timeout=60)
    assert learner == "rollout rank 2 built a different env than rollout rank 1"


# ----- LearnerTeam.receive: what rides with the batches of two rollout ranks --------------------------------------

def _team(cfg, batches) -> LearnerTeam:
    """A learner's team whose receiver hands over `batches` (no ranks needed to check what receive makes of them)."""
    team = LearnerTeam.__new__(LearnerTeam)
    team.cfg, team.rollouts, team.device = cfg, [1, 2], torch.device("cpu")
    team.receiver = SimpleNamespace(take=lambda: batches)
    team.weights = SimpleNamespace(check=lambda: None)
    return team


def _batch(version, signal, gone, sums, counts, x):
    return {"x": torch.tensor(x), "last_critic_obs": torch.tensor([[x[0][0]]]),
            "flags": torch.tensor([version, signal, gone], dtype=torch.float64),
            "sums": torch.tensor(sums, dtype=torch.float64), "counts": torch.tensor(counts, dtype=torch.float64)}


def test_the_learner_joins_two_batches_and_takes_the_oldest_version_and_any_rank_s_signal():
    """Batch 5 of rollout rank 1 collected with version 5, of rollout rank 2 with version 3 (lag 2 = S): the lag is
    the older one's. Only rank 2 was signalled and only rank 1 lost its launcher: both count. Metric sums and
    counts add up over the ranks."""
    batches = [_batch(5, 0, 1, [1.5, 2.0], [1, 2], [[1.0], [2.0]]),
               _batch(3, 1, 0, [0.25, -4.0], [3, 0], [[3.0], [4.0]])]
    batch, remote = _team(_cfg("async", 2), batches).receive(5)
    assert batch["x"].tolist() == [[1.0, 3.0], [2.0, 4.0]] and batch["last_critic_obs"].tolist() == [[1.0], [3.0]]
    assert remote["lag"] == 2
    assert remote["Control/stop_signal"] == 1 and remote["Control/launcher_gone"] == 1
    assert remote["sums"].tolist() == [1.75, -2.0] and remote["counts"].tolist() == [4, 2]
    for flags, said in [(((1, 0), (0, 0)), (1, 0)), (((0, 0), (0, 1)), (0, 1)), (((0, 0), (0, 0)), (0, 0))]:
        batches = [_batch(5, *flags[0], [0.0], [0], [[1.0]]), _batch(5, *flags[1], [0.0], [0], [[1.0]])]
        _, remote = _team(_cfg("async", 2), batches).receive(5)
        assert (remote["Control/stop_signal"], remote["Control/launcher_gone"]) == said, flags


@pytest.mark.parametrize("mode, versions, iteration", [("async", (4, 2), 5), ("sync", (5, 4), 5)])
def test_a_batch_older_than_the_bound_is_refused_naming_the_flag(mode, versions, iteration):
    """async S = 2: version 2 is 3 behind iteration 5; sync: version 4 is 1 behind (sync allows none)."""
    batches = [_batch(v, 0, 0, [0.0], [0], [[1.0]]) for v in versions]
    with pytest.raises(RunError, match=r"^batch 5 from rollout ranks \[1, 2\] was collected with weights "
                                       rf"{iteration - min(versions)} versions old, more than "
                                       r"--rollout.max-staleness allows$"):
        _team(_cfg(mode, 2), batches).receive(iteration)


# ----- unpack_team_states / restore_rollout_rng: whose states are whose -------------------------------------------

def test_the_gathered_states_come_back_per_rollout_rank_with_the_first_rank_s_env_state():
    """Two rollout ranks' blobs (rng/torch, env/sampler/counts) one after the other: the RNG states come back in
    that order; the env state (identical on every rank after the sampler sum) is the first one's."""
    ranks = [{"rng/torch": torch.tensor([1, 2, 3], dtype=torch.uint8),
              "env/sampler/counts": torch.tensor([10.0, 20.0], dtype=torch.float64)},
             {"rng/torch": torch.tensor([7, 8, 9], dtype=torch.uint8),
              "env/sampler/counts": torch.tensor([10.0, 20.0], dtype=torch.float64)}]
    layout = {k: (tuple(v.shape), v.dtype) for k, v in ranks[0].items()}
    spec = {"state_bytes": 3 + 16, "state_layout": layout}
    blob = torch.cat([to_bytes(r) for r in ranks])
    assert blob.numel() == 2 * 19
    rngs, env = unpack_team_states(blob, spec)
    assert [r["torch"].tolist() for r in rngs] == [[1, 2, 3], [7, 8, 9]]
    assert list(env) == ["sampler"] and env["sampler"]["counts"].tolist() == [10.0, 20.0]
    assert flatten_state(env).keys() == {"sampler/counts"}


class _Env:
    def __init__(self, seed):
        self.generator = torch.Generator().manual_seed(seed)


def test_each_rollout_rank_takes_its_own_saved_rng_states_in_a_team_of_two(capsys):
    """Layout [1 learner, 2 rollout ranks]: rollout rank j takes rollout_rng[j]. Another layout takes none."""
    saved = [{"torch": torch.Generator().manual_seed(100 + j).get_state(),
              "env": torch.Generator().manual_seed(200 + j).get_state()} for j in range(2)]
    checkpoint = {"layout": [1, 2], "rollout_rng": saved, "config": {"seed": 1}}
    before = torch.get_rng_state()
    try:
        for j in (0, 1):
            env = _Env(seed=5)
            roles = SimpleNamespace(rank=1 + j, rollout_index=j, num_learners=1, num_rollouts=2)
            restore_rollout_rng(checkpoint, _cfg(), roles, env, torch.device("cpu"))
            assert torch.equal(torch.get_rng_state(), saved[j]["torch"]), j
            assert torch.equal(env.generator.get_state(), saved[j]["env"]), j
        torch.set_rng_state(before)
        env = _Env(seed=5)
        other = SimpleNamespace(rank=2, rollout_index=0, num_learners=2, num_rollouts=1)      # layout [2, 1]
        restore_rollout_rng(checkpoint, _cfg(), other, env, torch.device("cpu"))
        assert torch.equal(torch.get_rng_state(), before)
        assert torch.equal(env.generator.get_state(), torch.Generator().manual_seed(5).get_state())
    finally:
        torch.set_rng_state(before)
    assert capsys.readouterr().out == ""


def test_only_the_first_rollout_rank_says_that_saved_states_do_not_fit(capsys):
    """16-byte (GPU) env states do not fit a CPU generator: the streams restart; rollout rank 0 alone says so."""
    saved = [{"torch": torch.get_rng_state(), "env": torch.zeros(16, dtype=torch.uint8)} for _ in range(2)]
    checkpoint = {"layout": [1, 2], "rollout_rng": saved, "config": {"seed": 1}}
    for j in (1, 0):
        roles = SimpleNamespace(rank=1 + j, rollout_index=j, num_learners=1, num_rollouts=2)
        restore_rollout_rng(checkpoint, _cfg(), roles, _Env(seed=5), torch.device("cpu"))
        said = capsys.readouterr().out
        assert ("their streams restart" in said) == (j == 0), (j, said)
