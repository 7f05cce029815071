"""Rollout ranks: sync mode reproduces the colocated run bit for bit, async mode keeps its staleness bound,
plan == ledger on every rank, checkpoints resume across layouts, a dead rollout rank is named."""

import glob
import os
import signal

import pytest
import torch

import torch.distributed as torch_dist

import train
from configs import preset
from dist import comm
from dist.plan import expected_ledger
from rollout_weights import WeightServer, request_weights
from rollout_ranks import describe_rollout, weight_sync_config
from sync import WeightSyncConfig, make_weight_syncer
from tests.multirank import free_port, run_ranks
from tests.torchrun_job import Job


def small(root, iterations=4, resume="", seed=1, **rollout):
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations, cfg.resume, cfg.seed = 16, 8, iterations, resume, seed
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (32, 32)
    cfg.log.root, cfg.log.save_every, cfg.log.print_every = str(root), 2, 100
    cfg.dist.sampler_sync_every, cfg.dist.device = 2, "cpu"
    for key, value in rollout.items():
        assert hasattr(cfg.rollout, key), key         # setattr would add a field nothing reads
        setattr(cfg.rollout, key, value)
    return cfg


def body(rank, world_size, cfg, iterations):
    comm.reset_ledger()
    model, scalars, plan = train.main(cfg)
    k = cfg.rollout.ranks                  # this rank's collective group: the learners or the rollout ranks
    single = (k if rank >= world_size - k else world_size - k) == 1
    return ({k: v.clone() for k, v in model.state_dict().items()}, scalars,
            {k: list(v) for k, v in comm.LEDGER.items()},
            expected_ledger(plan, iterations, final_iteration=iterations, collectives=not single))


def learner_state(results):
    return results[0][0], results[0][1]


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["patch", "bucket"])
def test_sync_mode_is_bit_identical_to_the_colocated_run(tmp_path, weights):
    colocated = train.main(small(tmp_path / "colocated"))[0].state_dict()
    split = run_ranks(body, 2, args=(small(tmp_path / "split", ranks=1, sync=weights), 4))
    learner, scalars = learner_state(split)
    for key, value in colocated.items():
        assert torch.equal(learner[key], value), key      # parameters and normalizer statistics
    copy = split[1][0]
    for key, value in learner.items():                     # the copy ends with the final weights
        assert torch.equal(copy[key], value), key
    for rank, (_, _, ledger, expected) in enumerate(split):
        if weights == "patch":            # a patch's messages and bytes depend on what changed: the plan bounds them
            assert ledger.pop("weight_sync")[1] <= expected.pop("weight_sync")[1]
        assert ledger == expected, f"rank {rank}"
    checkpoint = torch.load(glob.glob(str(tmp_path / "split" / "tracking" / "*" / "model_4.pt"))[0], weights_only=True)
    assert checkpoint["layout"] == [1, 1] and len(checkpoint["rollout_rng"]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["patch", "bucket"])
def test_two_learners_with_two_rollout_ranks_match_two_colocated_ranks(tmp_path, weights):
    colocated = run_ranks(body, 2, args=(small(tmp_path / "c", iterations=3), 3))
    split = run_ranks(body, 4, args=(small(tmp_path / "s", iterations=3, ranks=2, sync=weights), 3))
    for key, value in colocated[0][0].items():
        assert torch.equal(split[0][0][key], value) and torch.equal(split[1][0][key], value), key
    for rank in (2, 3):                                    # each rollout copy ends with its learner's final weights
        for key, value in split[rank - 2][0].items():
            assert torch.equal(split[rank][0][key], value), (rank, key)
    assert split[0][1]["Loss/learning_rate"] == colocated[0][1]["Loss/learning_rate"]
    for rank, (_, _, ledger, expected) in enumerate(split):
        if weights == "patch":            # a patch's messages and bytes depend on what changed: the plan bounds them
            assert ledger.pop("weight_sync")[1] <= expected.pop("weight_sync")[1]
        assert ledger == expected, f"rank {rank}"


@pytest.mark.slow
def test_async_mode_trains_within_its_staleness_bound(tmp_path):
    # a bfloat16 copy, and envs that time out every 5 steps: its critic's values bootstrap the time-outs
    cfg = small(tmp_path, iterations=6, ranks=1, mode="async", sync="bucket", max_staleness=2, dtype="bfloat16")
    cfg.env.episode_length_s = 0.1
    results = run_ranks(body, 2, args=(cfg, 6))
    learner, scalars = learner_state(results)
    assert 1 <= scalars["Perf/policy_lag"] <= 2            # collected while the learner updated
    for rank, (_, _, ledger, expected) in enumerate(results):
        # a rollout rank that already holds the newest version gets no update: whole updates, at most the plan's
        (calls, nbytes), (planned_calls, planned_bytes) = ledger.pop("weight_sync"), expected.pop("weight_sync")
        updates = calls * 7 // planned_calls          # the plan: one update per iteration and the final one
        assert 1 <= updates <= 7 and calls * 7 == updates * planned_calls, f"rank {rank}: {calls} weight messages"
        assert nbytes * 7 == updates * planned_bytes, f"rank {rank}"
        assert ledger == expected, f"rank {rank}"
    assert all(torch.isfinite(v).all() for v in learner.values() if v.is_floating_point())


@pytest.mark.slow
def test_checkpoints_resume_across_layouts(tmp_path):
    train.main(small(tmp_path / "a", iterations=2))                       # colocated, 1 rank
    (colocated_ckpt,) = glob.glob(str(tmp_path / "a" / "tracking" / "*" / "model_2.pt"))
    run_ranks(body, 2, args=(small(tmp_path / "b", iterations=4, ranks=1, resume=colocated_ckpt), 4))
    (split_ckpt,) = glob.glob(str(tmp_path / "b" / "tracking" / "*" / "model_4.pt"))
    saved = torch.load(split_ckpt, weights_only=True)
    assert saved["iteration"] == 4 and saved["layout"] == [1, 1]
    assert not glob.glob(str(tmp_path / "b" / "tracking" / "*" / "model_2.pt"))   # it started at iteration 2
    assert saved["env"]["sampler"]["global_counts"].sum() > 0             # the rollout rank's sampler state
    back = train.main(small(tmp_path / "c", iterations=5, resume=split_ckpt, seed=2))[0].state_dict()  # colocated
    assert [os.path.basename(p) for p in glob.glob(str(tmp_path / "c" / "tracking" / "*" / "*.pt"))] == ["model_5.pt"]
    # The same layout with a new --seed restarts the rollout rank's and the learner's streams from it (they were
    # restored from the checkpoint, silently ignoring --seed), so 1 + 1 in sync mode is again bit-identical to
    # the colocated rank; the motion library stays the checkpoint run's in both.
    same_layout = small(tmp_path / "d", iterations=5, ranks=1, resume=split_ckpt, seed=2)
    learner, _ = learner_state(run_ranks(body, 2, args=(same_layout, 5)))
    for key, value in back.items():
        assert torch.equal(learner[key], value), key


def counting_dones(rank, world_size, cfg):
    """train.main, returning how many episodes ended in each batch this rank collected (none on a learner)."""
    import rollout_ranks
    dones, collect = [], rollout_ranks.collect_rollout

    def counted(*args, **kwargs):
        batch, obs = collect(*args, **kwargs)
        dones.append(int(batch["dones"].sum()))
        return batch, obs

    rollout_ranks.collect_rollout = counted
    train.main(cfg)
    return dones


@pytest.mark.slow
def test_async_checkpoints_count_the_episodes_of_the_saved_iterations_only(tmp_path):
    """With S = 2 a rollout rank has collected two batches past a save when it reads the decision; those are
    collected again on resume, so the checkpoint's sampler visits must be the episodes of batches 0..i of both
    rollout ranks (every ended episode is one visit), not of 0..i + 2."""
    cfg = small(tmp_path, iterations=6, ranks=2, mode="async", sync="bucket", max_staleness=2)
    _, first, second = run_ranks(counting_dones, 3, args=(cfg,))
    assert len(first) == len(second) == 6 and sum(first[4:] + second[4:]) > 0    # later batches end episodes too
    for saved in (2, 4, 6):
        (path,) = glob.glob(str(tmp_path / "tracking" / "*" / f"model_{saved}.pt"))
        counts = torch.load(path, weights_only=True)["env"]["sampler"]
        assert counts["global_counts"][0].sum().item() == sum(first[:saved] + second[:saved]), saved
        assert counts["local_counts"].abs().sum().item() == 0, saved


def plain_ranks(tmp_path, *args, prelude=None):
    """Two `python train.py` processes with torchrun's variables: no launcher to kill or signal them (`prelude`:
    see tests/torchrun_job.Job)."""
    port = str(free_port())
    timeout = [] if "--dist.timeout-s" in args else ["--dist.timeout-s", "20"]   # train.py refuses a flag twice
    return [Job(["cartpole", "--max-iterations", "100000", "--log.root", str(tmp_path), "--rollout.ranks", "1",
                 *timeout, *args], python=True, prelude=prelude,
                env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("signalled", [1, 0])
def test_sigterm_on_either_rank_stops_both_after_a_checkpoint(tmp_path, mode, signalled):
    """docs/rollout_ranks.md: a signal on any rank, learner or rollout, stops every rank after the same iteration with
    a checkpoint, and every rank exits 0.
    Mutant: the learner's own stop flag dropped when it has a team (`flag + remote[key]` -> `remote[key]`): a SIGTERM
    to the learner is then ignored and the run goes on."""
    ranks = plain_ranks(tmp_path, "--rollout.mode", mode)
    try:
        ranks[0].wait_for(r"^it +3/")
        os.kill(ranks[signalled].proc.pid, signal.SIGTERM)  # a rollout rank's flag rides in its next batch
        assert [job.finish(60) for job in ranks] == [0, 0], ranks[0].output() + ranks[1].output()
        k, path = (lambda m: (int(m.group(1)), m.group(2)))(ranks[0].wait_for(r"after iteration (\d+); saved (\S+);"))
        saved = torch.load(path, weights_only=True)
        assert saved["iteration"] == k and saved["layout"] == [1, 1] and len(saved["rollout_rng"]) == 1
    finally:
        for job in ranks:
            job.kill_all()


@pytest.mark.slow
@pytest.mark.parametrize("dies, survivor, named", [(1, 0, "rollout rank 1"), (0, 1, "learner rank 0")])
def test_a_dead_rank_stops_its_partner_naming_it(tmp_path, dies, survivor, named):
    ranks = plain_ranks(tmp_path)       # without torchrun, so no launcher kills the survivor before it notices
    try:
        ranks[0].wait_for(r"^it +3/")
        os.kill(ranks[dies].proc.pid, signal.SIGKILL)
        assert ranks[survivor].finish(60) == 1
        ranks[survivor].wait_for(rf"^error: .*{named} died or stalled", timeout=1)
    finally:
        for job in ranks:
            job.kill_all()


def serve_after_three_versions(rank, world_size, kind):
    """The learner publishes versions 2, 3, 4 before its rollout rank asks; the rollout rank then asks twice."""
    group = torch_dist.new_group([0, 1])
    torch.manual_seed(rank)                        # different starting weights on each side
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    cfg = preset("tracking")
    cfg.rollout.sync = kind
    if rank == 0:
        server = WeightServer(weight_sync_config(cfg), 0, [1], group, cfg.dist.timeout_s)
        server.start(model, 1)
        for version in (2, 3, 4):
            with torch.no_grad():
                model[0].weight[version % 4].add_(float(version))   # a few elements change per version
                model[2].bias.mul_(0.5)
            server.publish(model, version)
        torch_dist.barrier()
        server.close()
        return {k: v.clone() for k, v in model.state_dict().items()}, server.syncers[1].plan_rows()
    syncer = make_weight_syncer(WeightSyncConfig(type=kind), 0, [1], group)
    have = syncer.init_receiver(model)
    torch_dist.barrier()                           # ask only once version 4 is published
    comm.reset_ledger()
    first = request_weights(syncer, model, 0, group, have, 1)
    after_first = {k: list(v) for k, v in comm.LEDGER.items()}
    second = request_weights(syncer, model, 0, group, first, 4)
    request_weights(syncer, model, 0, group, second, -1)
    return have, first, second, {k: v.clone() for k, v in model.state_dict().items()}, after_first, \
        {k: list(v) for k, v in comm.LEDGER.items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["patch", "bucket"])
def test_a_rollout_rank_that_fell_behind_gets_the_newest_weights_in_one_update(kind):
    (learner_state, rows), (have, first, second, state, after_first, ledger) = \
        run_ranks(serve_after_three_versions, 2, args=(kind,))
    assert (have, first, second) == (0, 4, 4)      # versions 1 to 3 skipped; then nothing newer to send
    for key, value in learner_state.items():
        assert torch.equal(state[key], value), key
    update = [r for r in rows if r.cadence == "iteration"][0]          # one sync's messages, at most
    assert after_first["weight_sync"][0] <= update.calls and after_first["weight_sync"][1] <= sum(update.call_bytes)
    assert ledger["weight_sync"] == after_first["weight_sync"]          # the second request moved no weights
    assert ledger["weight_request"] == [5, 3 * 16 + 2 * 8]              # (have, need) x 3, version x 2


def test_the_start_up_says_how_rollout_ranks_collect():
    """A resume continues --rollout.mode and the rest from its checkpoint: the start-up line must show them."""
    assert describe_rollout(small("/unused", ranks=1)) == \
        "; sync (on-policy), weights by patch, copy in float32, recompute auto (off)"
    assert describe_rollout(small("/unused", ranks=1, mode="async")).endswith("recompute auto (on)")   # what auto means
    assert describe_rollout(small("/unused", ranks=1, dtype="bfloat16")).endswith("recompute auto (on)")
    assert describe_rollout(small("/unused", ranks=1, mode="async", max_staleness=2, sync="bucket", dtype="bfloat16",
                                  recompute="off")) == \
        "; async, at most 2 version(s) stale, weights by bucket, copy in bfloat16, recompute off"
