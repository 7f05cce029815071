"""Gaps a mutation audit of train.py, rollout_ranks.py and rollout_weights.py found: each test here fails on a
plausible change of that code which every other test let through. Expected values come from the docs and by hand
(sizes, iteration numbers, which rank did what, a Gaussian's entropy), never from the code under test.

Pinned here: the last iteration's console line, TensorBoard steps and the loss terms logged (their counts);
Perf/total_fps over every rank; a stop request's save, message and end, and one in the last iteration; the launcher
gone; --rollout.recompute off reaching fill_storage; a learner's metrics equal to the colocated run's (the rollout
rank's sums and counts); the final weight request's version; WeightServer.close taking back its exit handler; the
run directory's lock released at the run's end; a dry run writing no probe and closing its team; the start-up's
transitions per iteration with rollout ranks; the sampler rows' cadences; Loss/entropy counted once per iteration;
a resumed learner's receives counted from its start iteration; a signal to one rank of two stopping both.

Found equivalent: a rollout rank's `need` floored at 0 instead of its start iteration (the learner publishes the start
version before any serving thread answers, and serves the newest version at least `need`: S - 1 and S get the same
answer); train.py forcing --dist.device cpu with rollout ranks whatever it was (validate refuses cuda before); the
learner reading a batch's episode returns with get instead of pop (fill_storage reads only its named fields).
"""

import contextlib
import fcntl
import glob
import io
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch

import rollout_ranks
import rollout_weights
import train
from dist.errors import UsageError
from dist.log_root import check_writable_root
from dist.stop import STOP_KEYS
from tests.multirank import run_ranks
from tests.test_faults import tb_steps
from tests.test_rollout_close_rules import ScriptedLearner, cartpole, run_against
from tests.test_rollout_ranks import body as rollout_body, small as small_rollout
from tests.test_rollout_weights import learner as weight_learner
from tests.test_train import small_tracking, train_body


def test_the_last_iteration_is_printed_whatever_print_every_says(tmp_path, capsys):
    """--log.print-every 2 over 3 iterations: iteration 2 by the cadence, and 3, the last, always (the run's final
    state reaches the console even when the cadence does not land on it); iteration 1 is not printed."""
    cfg = small_tracking(tmp_path, iterations=3)
    cfg.log.print_every = 2
    _, scalars, _ = train.main(cfg)
    printed = re.findall(r"^it +(\d+)/3 ", capsys.readouterr().out, re.MULTILINE)
    assert printed == ["2", "3"]
    # TensorBoard has every iteration at its own number, 1 to 3, and the update's three loss terms are logged
    (run_dir,) = glob.glob(os.path.join(tmp_path, "tracking", "*"))
    assert tb_steps(run_dir) == [1, 2, 3]
    assert {"Loss/surrogate", "Loss/value_function", "Loss/entropy"} <= scalars.keys()


@pytest.mark.slow
def test_total_fps_counts_the_transitions_of_every_rank(tmp_path):
    """Perf/total_fps is the whole job's rate: 2 ranks x 16 envs x 8 steps = 256 transitions per iteration over the
    iteration's collection + learning time, not one rank's 128."""
    (_, scalars), _ = run_ranks(train_body, 2, args=(small_tracking(tmp_path, iterations=1),))
    seconds = scalars["Perf/collection_time"] + scalars["Perf/learning_time"]
    assert scalars["Perf/total_fps"] * seconds == pytest.approx(2 * 16 * 8, rel=1e-9)


class FlagAt:
    """StopRequests as this rank would see it when `key` (a signal, or the launcher gone) comes up during iteration
    `at` (1-based) and not before: train.main's only reads of it are local_flags once per iteration and the handlers'
    restore at the end."""

    def __init__(self, at, key="Control/stop_signal"):
        self.at, self.key, self.calls = at, key, 0

    def __call__(self, watch_launcher):      # stands in for the class: train.main builds one
        return self

    def local_flags(self, device):
        self.calls += 1
        one = torch.ones((), device=device)
        return {k: (one * (k == self.key and self.calls == self.at), one) for k in STOP_KEYS}

    def restore_default_handlers(self):
        pass


def checkpoints(root):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "tracking", "*", "model_*.pt")))


def test_a_stop_request_saves_and_ends_the_run_after_that_iteration(tmp_path, monkeypatch, capsys):
    """A signal during iteration 1 of 4 (--log.save-every 2): model_1.pt is saved for it, the run says so with the
    command that continues it, and no iteration after it runs or saves."""
    monkeypatch.setattr(train, "StopRequests", FlagAt(1))
    train.main(small_tracking(tmp_path, iterations=4))
    out = capsys.readouterr().out
    assert checkpoints(tmp_path) == ["model_1.pt"]
    said = r"stopped on request \(SIGINT/SIGTERM\) after iteration (\d+); saved \S+model_(\d+).pt; continue it"
    assert re.findall(said, out) == [("1", "1")]


def test_a_stop_request_in_the_last_iteration_is_a_finished_run_not_one_to_continue(tmp_path, monkeypatch, capsys):
    """A signal during the last of 3 iterations: the final checkpoint is saved as always, and the run, complete,
    does not say it stopped on request nor offer a command to continue it (there is nothing left to train)."""
    monkeypatch.setattr(train, "StopRequests", FlagAt(3))
    train.main(small_tracking(tmp_path, iterations=3))
    out = capsys.readouterr().out
    assert checkpoints(tmp_path) == ["model_2.pt", "model_3.pt"]
    assert "stopped on request" not in out and "continue it in place" not in out


def test_a_launcher_gone_ends_the_run_after_that_iteration_without_saving(tmp_path, monkeypatch):
    """The launcher gone during iteration 2 of 4 (saves every 2): the run fails with RunError naming iteration 2
    and writes no checkpoint for it, nor runs iteration 3; model_2.pt, which a save would have written, is absent."""
    monkeypatch.setattr(train, "StopRequests", FlagAt(2, "Control/launcher_gone"))
    with pytest.raises(train.RunError, match=r"^the launcher \(torchrun\) is gone: stopped after iteration 2 "
                                             r"without saving; the last periodic checkpoint is kept$"):
        train.main(small_tracking(tmp_path, iterations=4))
    assert checkpoints(tmp_path) == []


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


class ExitHandlers:
    """rollout_weights' atexit: which handlers are registered and not taken back (atexit's own count keeps them)."""

    def __init__(self):
        self.left = []

    def register(self, handler):
        self.left.append(handler)

    def unregister(self, handler):
        self.left = [h for h in self.left if h != handler]


def test_a_closed_weight_server_leaves_nothing_for_the_exit(monkeypatch):
    """close() takes back the exit handler start() left for a failure: registered for good, every run in a process
    (a sweep, a test session) kept its server, the copy of its weights and its syncers alive until the interpreter
    exits, and ran its no-op abandon() there."""
    link, model, server = weight_learner(monkeypatch)
    handlers = ExitHandlers()
    monkeypatch.setattr(rollout_weights, "atexit", handlers)
    server.start(model, 0)
    assert handlers.left == [server.abandon]
    link.ask(-1, -1)                             # the rollout rank's done: the serving thread ends
    server.close()
    assert handlers.left == []


def test_a_finished_run_lets_go_of_its_run_directory(tmp_path):
    """The run directory's lock is held until the run's end (dist.checkpoint.lock_run_dir), not the process's: once
    main returns, another run may continue it, here a lock taken through another open file, which flock refuses
    while this process still holds one."""
    train.main(small_tracking(tmp_path, iterations=1))
    (run_dir,) = glob.glob(os.path.join(tmp_path, "tracking", "*"))
    with open(os.path.join(run_dir, ".lock"), "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)      # BlockingIOError while the lock is still held


def dry_body(rank, world_size, cfg, roots):
    """A dry run on this rank with its own --log.root, under a torchrun that may restart the job; what main returned
    and how many exit handlers it left behind."""
    os.environ["TORCHELASTIC_MAX_RESTARTS"] = "1"
    cfg.log.root, cfg.dry_run = roots[rank], True
    handlers, printed = ExitHandlers(), io.StringIO()
    rollout_weights.atexit = handlers            # this rank's process only
    with contextlib.redirect_stdout(printed):
        _, _, plan = train.main(cfg)
    return bool(plan), len(handlers.left), printed.getvalue()


@pytest.mark.slow
def test_a_dry_run_leaves_no_probe_and_passes_no_verdict_on_the_log_root(tmp_path):
    """--dry-run writes nothing in --log.root, not even the start-up probe, so a root rank 1 does not share with
    rank 0 (where a restartable run stops at start-up) does not stop a dry run, which never restarts or resumes."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for root in roots:
        os.mkdir(root)
    results = run_ranks(dry_body, 2, args=(small_tracking(tmp_path, iterations=1), roots))
    assert [(plan, handlers) for plan, handlers, _ in results] == [(True, 0)] * 2
    assert os.listdir(roots[0]) == os.listdir(roots[1]) == []


@pytest.mark.slow
def test_a_dry_run_with_a_rollout_rank_closes_its_weight_server(tmp_path):
    """A dry run with 1 + 1 ranks ends the learner's team as a run does: the serving thread took the rollout rank's
    `done`, and the exit handler WeightServer.start left for a failure is taken back (close), on every rank. The
    start-up counts the transitions the learner trains on: 1 learner x 16 envs x 8 steps, not the 2 ranks'."""
    cfg = small_rollout(tmp_path, iterations=1, ranks=1)
    results = run_ranks(dry_body, 2, args=(cfg, [str(tmp_path)] * 2))
    assert [(plan, handlers) for plan, handlers, _ in results] == [(True, 0)] * 2
    assert "\n[syncppo] 1 learner(s) x 16 envs x 8 steps = 128 transitions per iteration\n" in results[0][2]


def test_the_plan_sums_sampler_counts_at_their_own_cadence_and_before_each_save(tmp_path):
    """--dist.sampler-sync-every 3 and --log.save-every 5 (which the other tests set equal): the plan's sampler rows
    run every 3 iterations and at each save, every 5, as train.py's loop calls sum_counts."""
    cfg = small_tracking(tmp_path)
    cfg.dist.sampler_sync_every, cfg.log.save_every, cfg.dry_run = 3, 5, True
    _, _, plan = train.main(cfg)
    assert {r.rule: (r.cadence, r.every) for r in plan if r.purpose == "sampler"} == \
        {"sum of counts": ("every", 3), "sum of counts before save": ("checkpoint", 5)}


def test_the_logged_entropy_is_the_policy_s_whole_entropy(tmp_path):
    """Loss/entropy is the mean of the update's steps' entropies, each logged once: with an LR of 1e-9 the policy
    stays at its start, 6 independent joints of std --policy.init-noise-std 1, whose entropy is 6 x ln(2 pi e) / 2
    by hand (a term counted twice, or halved, is off by 4.3)."""
    cfg = small_tracking(tmp_path, iterations=1)
    cfg.ppo.schedule, cfg.ppo.learning_rate = "fixed", 1e-9
    _, scalars, _ = train.main(cfg)
    assert scalars["Loss/entropy"] == pytest.approx(3 * math.log(2 * math.pi * math.e), abs=1e-5)


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


def stop_on_one_rank_body(rank, world_size, cfg):
    """train.main where only rank 1 gets a signal, during iteration 1."""
    if rank == 1:
        train.StopRequests = FlagAt(1)           # this rank's process only
    cfg.dist.device = "cpu"
    train.main(cfg)


@pytest.mark.slow
def test_a_signal_to_one_rank_of_two_stops_both_after_that_iteration(tmp_path):
    """A signal reaches one rank of two (a SIGTERM to one process): the flag's mean over the ranks is 1/2, and any
    rank's flag must stop the whole job after that iteration with its save. Read as a majority (> 0.5) the job ran
    on to --max-iterations; the torchrun signal test caught that only by waiting out its time limit."""
    run_ranks(stop_on_one_rank_body, 2, args=(small_tracking(tmp_path, iterations=4),))
    assert checkpoints(tmp_path) == ["model_1.pt"]


def test_log_root_path_limit_counts_64_bytes_for_the_run_and_refuses_at_path_max(tmp_path):
    """PATH_MAX counts the terminating NUL: a root of PATH_MAX - 64 bytes is refused, one byte shorter is taken."""
    path_max = os.pathconf(str(tmp_path), "PC_PATH_MAX")

    def root_of(length):
        parts, left = [str(tmp_path)], length - len(str(tmp_path))
        while left > 0:
            n = min(200, left - 1) if left > 1 else 1
            parts.append("d" * n)
            left -= n + 1
        return "/".join(parts)
    assert len(root_of(path_max - 64)) == path_max - 64 and len(root_of(path_max - 65)) == path_max - 65
    check_writable_root(root_of(path_max - 65), write=False)
    with pytest.raises(UsageError, match="longer than the file system takes"):
        check_writable_root(root_of(path_max - 64), write=False)
