"""Rollout ranks (rollout_ranks.py, rollout_weights.py) at an env error, a resume and weight serving: only the first
rollout rank says an env error; a resume of the same layout and --seed hands the rollout rank its saved RNG states,
also from a checkpoint that records no seed (as a learner does); a bfloat16 copy holds its parameters in bfloat16,
each the learner's weight rounded; with --log.episode-returns the returns that ended on a rollout rank reach the
learner's TensorBoard as a colocated run logs them; WeightServer holds its lock while an answer is sent, ends a
thread on a done request without an answer, and says nothing of a failure after the learner abandoned its team."""

import atexit
import glob
import os
import threading
from types import SimpleNamespace

import pytest
import torch

import rollout_ranks
import train
from dist import comm
from dist.errors import UsageError
from test_rollout_ranks import body, learner_state, small
from test_rollout_weights import GUARD_S, Joining, Syncer, learner, reply, same, set_version, update
from test_tools import tb_scalars
from tests.multirank import run_ranks


@pytest.mark.parametrize("j", [0, 1, 2])
def test_only_the_first_rollout_rank_says_an_env_error(monkeypatch, j):
    """An env only the rollout ranks build fails on all of them alike: one line from rollout rank 0, not K."""
    def no_such_task(*args, **kwargs):
        raise ValueError("--env.task 'NoSuchTask-v0' is not a registered task")

    monkeypatch.setattr(rollout_ranks, "make_env", no_such_task)
    monkeypatch.setattr(rollout_ranks, "seed_everything", lambda seed: None)
    roles = SimpleNamespace(rollout_index=j, team=[0, 1 + j], rank=1 + j)
    with pytest.raises(UsageError, match="^--env.task 'NoSuchTask-v0' is not a registered task$") as exc:
        rollout_ranks.run_rollout_rank(small("/unused", ranks=3), roles, torch.device("cpu"), None, 0)
    assert exc.value.say_here is (j == 0)


@pytest.mark.slow
def test_a_resume_of_the_same_layout_and_seed_hands_the_rollout_rank_its_saved_rng_states(tmp_path):
    """1 + 1, checkpoint at iteration 2, resumed to 3 twice: once as saved, once with the rollout rank's saved RNG
    states replaced by other valid states (torch's and the env generator's of other seeds). A rollout rank that
    takes its saved states samples other actions in the two, so the learners end apart; one that ignored the
    checkpoint's states (starting from rank_seed(--seed, j) both times) would make the two runs identical."""
    run_ranks(body, 2, args=(small(tmp_path / "a", iterations=2, ranks=1, sync="bucket"), 2))
    (saved_path,) = glob.glob(str(tmp_path / "a" / "tracking" / "*" / "model_2.pt"))
    saved = torch.load(saved_path, weights_only=False)
    assert saved["layout"] == [1, 1] and saved["config"]["seed"] == 1
    other = {"torch": torch.Generator().manual_seed(777).get_state(),
             "env": torch.Generator().manual_seed(778).get_state()}
    assert {k: v.numel() for k, v in other.items()} == {k: v.numel() for k, v in saved["rollout_rng"][0].items()}
    assert not torch.equal(other["torch"], saved["rollout_rng"][0]["torch"])
    edited = tmp_path / "model_2.pt"
    torch.save({**saved, "rollout_rng": [other]}, edited)
    finals = []
    for path, root in ((saved_path, "b"), (str(edited), "c")):
        cfg = small(tmp_path / root, iterations=3, ranks=1, sync="bucket", resume=path)
        finals.append(learner_state(run_ranks(body, 2, args=(cfg, 3)))[0])
    assert finals[0].keys() == finals[1].keys()
    assert any(not torch.equal(finals[0][k], finals[1][k]) for k in finals[0] if finals[0][k].is_floating_point())


def parts_body(rank, world_size, cfg):
    """train.main; this rank's model (the learner's, or the rollout rank's copy) as parameters and buffers."""
    model = train.main(cfg)[0]
    return ({k: v.detach().clone() for k, v in model.named_parameters()},
            {k: v.clone() for k, v in model.named_buffers()})


@pytest.mark.slow
def test_a_bfloat16_copy_holds_each_parameter_as_the_learner_s_weight_rounded_to_bfloat16(tmp_path):
    """--rollout.dtype bfloat16: the copy's parameters are bfloat16 (the precision it samples with) and, after the
    final weights, each equals the learner's float32 weight rounded to bfloat16; its buffers (normalizer
    statistics) stay float32, equal to the learner's."""
    (params, buffers), (copy_params, copy_buffers) = \
        run_ranks(parts_body, 2, args=(small(tmp_path, iterations=2, ranks=1, sync="bucket", dtype="bfloat16"),))
    assert params.keys() == copy_params.keys() and buffers.keys() == copy_buffers.keys() and params and buffers
    for key, value in params.items():
        assert value.dtype == torch.float32 and copy_params[key].dtype == torch.bfloat16, key
        assert torch.equal(copy_params[key], value.to(torch.bfloat16)), key
    for key, value in buffers.items():
        assert copy_buffers[key].dtype == value.dtype and torch.equal(copy_buffers[key], value), key


# ----- restore_rollout_rng: a checkpoint that records no seed ------------------------------------------------

def test_a_rollout_rank_restores_states_of_a_checkpoint_without_a_seed_as_a_learner_does():
    """ppo.restore takes a learner's RNG states when the saved config has no seed (None counts as this run's):
    a rollout rank must too, or the two sides of one resume disagree. A different seed restarts the streams."""
    from rollout_ranks import restore_rollout_rng
    from test_rollout_transport_rules import _cfg, _Env
    saved = {"torch": torch.Generator().manual_seed(100).get_state(),
             "env": torch.Generator().manual_seed(200).get_state()}
    roles = SimpleNamespace(rank=1, rollout_index=0, num_learners=1, num_rollouts=1)
    cfg = _cfg()
    cfg.seed = 3
    before = torch.get_rng_state()
    try:
        for config, restored in (({}, True), ({"seed": 3}, True), ({"seed": 4}, False)):
            torch.set_rng_state(before)
            env = _Env(seed=5)
            checkpoint = {"layout": [1, 1], "rollout_rng": [saved], "config": config}
            restore_rollout_rng(checkpoint, cfg, roles, env, torch.device("cpu"))
            fresh = torch.Generator().manual_seed(5).get_state()
            assert torch.equal(env.generator.get_state(), saved["env"] if restored else fresh), config
            assert torch.equal(torch.get_rng_state(), saved["torch"] if restored else before), config
    finally:
        torch.set_rng_state(before)


def serve_version_0(link, model, server):
    """Start the server at version 0: the init handshake, then the first request's reply and update."""
    set_version(model, 0)
    server.start(model, 0)
    same(link.take(1), [("init", [1], -1)])
    link.ask(-1, 0)
    same(link.take(2), [reply(0), update(0)])


# ----- WeightServer: an answer in flight keeps the lock ------------------------------------------------------

def test_an_answer_in_flight_holds_the_lock_that_publish_takes(monkeypatch):
    """publish() copies the next version into the very tensors being sent: while sync/ sends an update, the serving
    thread must hold the condition publish() takes, or a publish meanwhile changes weights mid-send (the rollout
    rank then holds a mix of two versions under one number). Seen without timing: from inside the update, another
    thread's non-blocking acquire must fail."""
    link, model, server = learner(monkeypatch)
    free = []

    class Probing(Syncer):
        def sync(self, state, version):
            def probe():
                got = server.published.acquire(blocking=False)
                if got:
                    server.published.release()
                free.append(got)
            thread = threading.Thread(target=probe)
            thread.start()
            thread.join()
            super().sync(state, version)

    server.syncers[1] = Probing(link, [1])
    try:
        serve_version_0(link, model, server)
        assert free == [False]
        link.ask(0, -1)
        server.close()
    finally:
        atexit.unregister(server.abandon)


def test_a_done_request_ends_the_serving_thread_without_an_answer(monkeypatch):
    """need -1 is the rollout rank's last message: the thread answers nothing and ends (a reply would go unread and
    the thread would then wait for a request that never comes, so close() would never return)."""
    link, model, server = learner(monkeypatch)
    try:
        serve_version_0(link, model, server)
        link.ask(0, -1)
        server.threads[0].join(GUARD_S)
        assert not server.threads[0].is_alive() and list(link.out.queue) == []
    finally:
        atexit.unregister(server.abandon)


def test_a_message_failing_after_the_learner_abandoned_its_team_is_not_reported(monkeypatch, capsys):
    """At exit after a learner failure (abandon, groups still up), a serving thread's receive fails once its rollout
    rank exits: a consequence of the learner's error, already reported. The thread ends silently, keeping nothing
    for check() and ending no process."""
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    link, model, server = learner(monkeypatch)
    try:
        server.start(model, 0)
        same(link.take(1), [("init", [1], -1)])
        failed = comm.CollectiveError("recv for 'weight_request' failed on rank 0: rollout rank 1 exited")
        thread = server.threads[0]
        server.threads = [Joining(thread, lambda: link.requests.put(failed))]   # fails once abandon waits for it
        server.abandon()
        thread.join(GUARD_S)
        assert not thread.is_alive()
        assert (capsys.readouterr().err, server.failures, exits) == ("", {}, [])
    finally:
        atexit.unregister(server.abandon)


@pytest.mark.slow
def test_a_rollout_rank_hands_the_learner_every_episode_return_a_colocated_run_logs(tmp_path):
    """--log.episode-returns with a rollout rank: the returns of the episodes that ended there reach the learner's
    TensorBoard (Episode/return) at their iterations, the values and order the colocated run logs (sync mode with an
    fp32 copy is bit-identical to it), not zeros or nothing."""
    colocated, split = small(tmp_path / "colocated"), small(tmp_path / "split", ranks=1, sync="bucket")
    colocated.log.episode_returns = split.log.episode_returns = True
    train.main(colocated)
    run_ranks(body, 2, args=(split, 4))
    logged = [tb_scalars(glob.glob(str(tmp_path / root / "tracking" / "*"))[0], "Episode/return")
              for root in ("colocated", "split")]
    assert len(logged[0]) > 10 and any(value != 0 for _, value in logged[0])   # a random policy loses track fast
    assert logged[1] == logged[0]
