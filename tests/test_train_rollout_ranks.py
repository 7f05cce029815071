"""train.py's learners and rollout ranks (rollout_ranks.py) as docs/rollout_ranks.md describes them: --rollout.recompute
off reaching fill_storage, a learner's metrics equal to the colocated run's, the weights a rollout rank asks for
before it says done, the receives a resumed learner posts, the device rollout ranks join on, and the layout
team_checkpoint records (learners, then rollout ranks)."""

from types import SimpleNamespace

import pytest
import torch

import rollout_ranks
import train
from configs import preset
from tests.multirank import run_ranks
from tests.test_rollout_close_rules import ScriptedLearner, cartpole, run_against
from tests.test_rollout_ranks import body as rollout_body, small as small_rollout


def recompute_body(rank, world_size, cfg):
    """train.main on this rank, recording the `recompute` every fill_storage call got (this rank's process only)."""
    seen, fill = [], train.fill_storage

    def recording(*args, recompute, **kwargs):
        seen.append(recompute)
        return fill(*args, recompute=recompute, **kwargs)

    train.fill_storage = recording
    try:
        train.main(cfg)
    finally:
        train.fill_storage = fill
    return seen


@pytest.mark.slow
def test_recompute_off_keeps_the_rollout_copy_s_old_policy_terms_in_async_mode(tmp_path):
    """--rollout.recompute off in async mode (where auto would be on): the learner fills its storage with the stale
    copy's log-probs, means, stds and values, as docs/rollout_ranks.md says, in each of its 2 iterations; the rollout
    rank fills none."""
    cfg = small_rollout(tmp_path, iterations=2, ranks=1, mode="async", recompute="off")
    assert run_ranks(recompute_body, 2, args=(cfg,)) == [[False, False], []]


@pytest.mark.slow
def test_a_learner_logs_the_metrics_the_colocated_run_logs(tmp_path):
    """Sync mode with an fp32 copy and 1 + 1 ranks is bit-identical to the colocated run on 1 rank
    (docs/rollout_ranks.md), and its episode metrics are the rollout rank's (sum, count) pairs reduced by the same
    count-weighted rule: every logged scalar but the timings and the message counts equals the colocated run's."""
    _, colocated, _ = train.main(small_rollout(tmp_path / "colocated", iterations=2))
    (_, split, _, _), _ = run_ranks(rollout_body, 2, args=(small_rollout(tmp_path / "split", iterations=2, ranks=1), 2))
    same = {k for k in colocated if not k.startswith(("Perf/", "Comm/"))}
    assert {"Train/mean_reward", "Train/mean_episode_length", "Loss/entropy"} <= same
    assert {k: split[k] for k in same} == {k: colocated[k] for k in same}


@pytest.mark.parametrize("mode, staleness", [("sync", 0), ("async", 1)])
def test_a_rollout_rank_asks_for_the_weights_of_the_last_update_before_it_says_done(monkeypatch, mode, staleness):
    """3 iterations: before collecting batch k a rollout rank needs version k (sync) or k - 1 but not below its start
    (async, S = 1); after the last batch it asks for version 3, the weights of the last update, so the copy ends with
    the final weights whenever the learner publishes them; then -1 says done. Asking for 2 there was answered at once
    with the version it held when its request beat the learner's last publish."""
    learner, needs = ScriptedLearner(0, 3, depth=staleness + 1, save_every=2), []

    def request(syncer, copy, to, group, have, need):
        needs.append(need)
        return answer(syncer, copy, to, group, have, need)

    answer, learner.request = learner.request, request
    run_against(learner, cartpole(3, mode, staleness), monkeypatch)
    assert needs == ([0, 1, 2] if mode == "sync" else [0, 0, 1]) + [3, -1]


def test_a_resumed_learner_posts_its_receives_from_the_iteration_it_resumes_at(monkeypatch):
    """A learner resumed at iteration 3 of 5, async with S = 2: its BatchReceiver counts from 3 (it keeps S + 1 = 3
    receives posted, none past iteration 4), not from 0, which posted receives for batches no rollout rank sends."""
    spec = {"obs_dims": {"policy": 4, "critic": 4}, "num_actions": 1, "num_envs": 4, "log_keys": (), "layout": None,
            "state_bytes": 8}
    posted = []
    monkeypatch.setattr(rollout_ranks, "recv_object", lambda src, group, purpose: (spec, 10))
    monkeypatch.setattr(rollout_ranks, "BatchReceiver", lambda *args: posted.append(args))
    monkeypatch.setattr(rollout_ranks, "WeightServer", lambda *args: None)
    roles = SimpleNamespace(rank=0, team=[0, 1], batches_group=None, weights_group=None)
    rollout_ranks.LearnerTeam(cartpole(5, "async", 2), roles, torch.device("cpu"), 3)
    ((rollouts, _, _, _, depth, start, end, _),) = posted
    assert (rollouts, depth, start, end) == ([1], 3, 3, 5)


class Joined(Exception):
    """Raised in place of joining the process group: carries the device main() asked for."""


def test_rollout_ranks_take_auto_as_cpu_where_cuda_exists(tmp_path, monkeypatch):
    """Mutant: --dist.device auto left as it is with --rollout.ranks. Where torch sees a GPU, auto would mean cuda;
    with rollout ranks main() joins the process group on cpu (docs/rollout_ranks.md) and checks the device as cpu."""
    monkeypatch.setenv("RANK", "0"), monkeypatch.setenv("WORLD_SIZE", "2"), monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    checked = []
    validate_device = train.validate_device
    monkeypatch.setattr(train, "validate_device", lambda cfg, world, kind: checked.append(kind) or
                        validate_device(cfg, world, kind))

    def join(backend, device, timeout_s):
        raise Joined(device)
    monkeypatch.setattr(train, "init_distributed", join)
    cfg = preset("cartpole")
    cfg.rollout.ranks, cfg.log.root = 1, str(tmp_path)
    assert cfg.dist.device == "auto"
    with pytest.raises(Joined) as joined:
        train.main(cfg)
    assert joined.value.args == ("cpu",) and checked == ["cpu"]


def test_team_checkpoint_records_learners_then_rollout_ranks(monkeypatch):
    """The layout of a checkpoint of 1 learner + 2 rollout ranks is [1, 2], in that order (load_checkpoint checks its
    first entry against the learners' RNG list); the rollout ranks' RNGs and the first one's env state come from the
    gathered blobs, flattened on the host."""
    seen = []

    def states(gathered, spec):
        seen.append((gathered.device.type, tuple(gathered.shape), spec))
        return [{"torch": 1}, {"torch": 2}], {"steps": 3}
    monkeypatch.setattr(rollout_ranks, "unpack_team_states", states)
    roles = SimpleNamespace(num_learners=1, num_rollouts=2)
    entries = rollout_ranks.team_checkpoint(torch.zeros(2, 5, dtype=torch.uint8), {"state_bytes": 5}, roles)
    assert entries == {"env": {"steps": 3}, "rollout_rng": [{"torch": 1}, {"torch": 2}], "layout": [1, 2]}
    assert seen == [("cpu", (10,), {"state_bytes": 5})]
