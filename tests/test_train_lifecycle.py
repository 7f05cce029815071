"""What a run holds and gives back: the run directory's lock (released at the run's end, taken before the process
group forms when a run is continued in place), the exit handler its weight server registers, and a dry run that
writes nothing under --log.root and still closes its learner team; a run with a frozen layer resumes."""

import contextlib
import fcntl
import glob
import io
import os
import re

import pytest

import rollout_weights
import train
from dist.errors import UsageError
from tests.multirank import run_ranks
from tests.test_rollout_ranks import small as small_rollout
from tests.test_rollout_weights import learner as weight_learner
from tests.test_train import small_tracking


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


def test_a_live_run_s_directory_is_refused_before_the_process_group_forms(tmp_path, monkeypatch):
    """Mutant: the early lock of a run continued in place dropped (the run directory is then locked only when it is
    opened for writing, after the process group, the env and the model exist). While another open file holds the
    lock, `--resume auto` is refused naming the directory as in use, and no process group was joined."""
    train.main(small_tracking(tmp_path, iterations=1))
    (run_dir,) = glob.glob(os.path.join(tmp_path, "tracking", "*"))

    def join(*args):
        raise AssertionError("the process group was joined before the refusal")
    monkeypatch.setattr(train, "init_distributed", join)
    cfg = small_tracking(tmp_path, iterations=2)
    cfg.resume = "auto"
    with open(os.path.join(run_dir, ".lock"), "a+") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)   # another run's, through another open file
        with pytest.raises(UsageError, match=f"^run directory {re.escape(run_dir)} is in use by another run"):
            train.main(cfg)


def test_a_run_with_a_frozen_layer_resumes(tmp_path, monkeypatch):
    """A frozen (requires_grad False) part of the policy, e.g. a pretrained encoder: Adam held it in its param groups
    but never stepped it, so the saved optimizer state covered some parameters only and every checkpoint of the run
    was refused on --resume as damaged (found freezing a layer of cartpole's policy and resuming its run).
    Mutant: build_optimizer without its `requires_grad` filter."""
    build = train.build_actor_critic

    def frozen_first_layer(*args):
        model = build(*args)
        model.critic[0].requires_grad_(False)
        return model
    monkeypatch.setattr(train, "build_actor_critic", frozen_first_layer)
    train.main(small_tracking(tmp_path, iterations=1))
    (run_dir,) = glob.glob(os.path.join(tmp_path, "tracking", "*"))
    cfg = small_tracking(tmp_path, iterations=2)
    cfg.resume = run_dir
    model = train.main(cfg)[0]
    assert os.path.exists(os.path.join(run_dir, "model_2.pt"))
    assert not model.critic[0].weight.requires_grad
