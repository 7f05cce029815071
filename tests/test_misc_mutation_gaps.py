"""Gaps a mutation audit of ppo/minibatch_step.py, ppo/logger.py and dist/ (setup, roles, errors, stop, plan) found:
each test here fails on a plausible change of that code which every other test let through. References are computed
independently: by hand, or one process over the whole minibatch.

Mutants of these files found equivalent (no test can tell them apart):
- minibatch_step: comparing only the first Adam state tensor's identity in begin() (load_state_dict, the only thing
  that replaces them, replaces every one);
- stop: the last signal's name overwriting the first (signal_name is only ever read as `is not None`);
- setup: `device != "cpu"` for `device == "cuda"` (--dist.device is a Literal of auto, cpu, cuda);
- roles: is_learner without `colocated or` and per_learner without `if num_rollouts` (colocated, num_learners is
  the world size and num_rollouts 0).
The audit's one survivor, init_distributed not checking MASTER_ADDR/MASTER_PORT under torchrun's agent store (a
KeyError traceback), was fixed: tests/test_startup_errors.py.
"""

import copy
import functools
import itertools
import math
import signal

import pytest
import torch

from dist.grad_sync import GradSync
from dist.setup import init_distributed
from dist.stop import StopRequests
from ppo.loss import gaussian_kl, ppo_loss
from ppo.minibatch_step import backward_minibatch
from ppo.storage import RolloutStorage
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg
from tests.test_rollout_checkpoint_rules import joined  # noqa: F401 (a fixture: torchrun's variables, recorded joins)
from tests.test_stop_requests import clock, flags, handlers, interrupted, not_interrupted  # noqa: F401 (a fixture)


# ---- ppo/minibatch_step.py: backward_minibatch ------------------------------------------------------------------

def whole_minibatch_reference(model, batch, cfg):
    """(gradients, KL sum, loss terms) of one backward over the whole minibatch, in one process with no GradSync:
    what q equal micro-batches must add up to (the mean of their means is the whole minibatch's mean)."""
    model = copy.deepcopy(model)
    pi = model.distribution(batch["actor_obs"])
    terms = ppo_loss(pi.log_prob(batch["actions"]).sum(-1), batch["log_probs"], batch["advantages"],
                     model.value(batch["critic_obs"]), batch["values"], batch["returns"], pi.entropy().sum(-1),
                     cfg.clip_param, cfg.clip_value_loss, cfg.value_loss_coef, cfg.entropy_coef)
    grads = torch.autograd.grad(terms["loss"], list(model.parameters()))
    kl_sum = gaussian_kl(batch["action_mean"], batch["action_std"], pi.mean, pi.stddev).sum()
    return grads, kl_sum.item(), [terms[k].item() for k in ("surrogate", "value_function", "entropy")]


@pytest.mark.parametrize("q", [1, 2, 4])
def test_micro_batches_give_the_whole_minibatch_s_gradient_norm_clip_kl_and_loss_terms(q):
    """backward_minibatch with q micro-batches against one backward over the whole minibatch: each micro-batch's
    loss divided by q (without it the gradient was q times too large, hidden by Adam's scale invariance), the
    returned terms the mean over micro-batches (without / q the logged losses were q times too large), the norm
    that of the unclipped gradient, and the gradient clipped to exactly cfg.max_grad_norm (set below the norm here
    so that clipping acts; with a doubled threshold only every other test passed)."""
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, torch.device("cpu"))
    fill(storage, 0, model)
    batch = storage.split(storage.data.flatten(0, 1))        # all T x N = 48 transitions as one minibatch
    cfg = ppo_cfg(num_micro_batches=q)
    grads, kl_sum, terms = whole_minibatch_reference(model, batch, cfg)
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    cfg = ppo_cfg(num_micro_batches=q, max_grad_norm=norm / 3)     # clipping scales the gradient by 1/3
    sync = GradSync(model.parameters(), num_extras=2)
    kl_stats, got_norm, got_terms = backward_minibatch(model, batch, sync, cfg)
    assert got_norm.item() == pytest.approx(norm, rel=1e-5)
    assert kl_stats.tolist() == pytest.approx([kl_sum, T * N], rel=1e-5)
    assert got_terms.tolist() == pytest.approx(terms, rel=1e-5, abs=1e-7)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g / 3, rtol=1e-4, atol=1e-7)


# ---- ppo/minibatch_step.py: the ledger of a captured step ---------------------------------------------------------

def test_a_recorded_step_counts_its_all_reduce_once_per_replay_and_not_for_the_recording(monkeypatch):
    """The ledger (plan == ledger) counts a replayed step's gradient all-reduce at each replay, since no Python runs
    then, and takes back what the recording counted, since recording issues nothing. One process counts no
    collective, so here comm.all_reduce counts each call it is given as a multi-rank run would: 3 updates x 3 epochs x
    2 minibatches = 18 steps are 18 all-reduces of every gradient plus the KL (sum, count), in float32, whether a step
    ran eagerly (the 3 warm-up steps), was recorded and replayed, or only replayed."""
    from dist import comm
    from tests import fake_cuda_graph
    from tests.test_minibatch_step import run_update
    fake_cuda_graph.install(monkeypatch)
    issue = comm.all_reduce

    def counted(tensor, purpose, async_op=False):
        comm.ledger_add(purpose, 1, tensor.numel() * tensor.element_size())
        return issue(tensor, purpose, async_op=async_op)
    monkeypatch.setattr(comm, "all_reduce", counted)
    monkeypatch.setattr(comm, "LEDGER", type(comm.LEDGER)(comm.LEDGER.default_factory))
    model, optimizer, _ = run_update(True, iterations=3, graph=True)
    assert optimizer.sync_free_step.graph.replays == 18 - 3        # all but the warm-up steps were replays
    floats = sum(p.numel() for p in model.parameters()) + 2
    assert list(comm.LEDGER["gradients"]) == [18, 18 * floats * 4]



def test_a_capturable_checkpoint_resumes_with_the_capturable_setting_this_run_built():
    """A checkpoint of --ppo.capture-step on CUDA saves capturable=True; resumed by the host path (or on CPU, where
    build_optimizer never makes it capturable), saved_state_for must keep this run's False, as it keeps fused and
    foreach. On CPU the file of such a run is stood in for by a saved group marked capturable by hand (the existing
    test of this, run on CPU, saves and resumes with capturable False on both sides, so dropping it passed there)."""
    from ppo.minibatch_step import build_optimizer, saved_state_for
    model = make_model()
    optimizer = build_optimizer(model.parameters(), ppo_cfg(capture_step=False), torch.device("cpu"))
    saved = copy.deepcopy(optimizer.state_dict())
    saved["param_groups"][0]["capturable"] = True                 # as a CUDA --ppo.capture-step run saved it
    optimizer.load_state_dict(saved_state_for(optimizer, saved))
    assert optimizer.param_groups[0]["capturable"] is False and optimizer.param_groups[0]["fused"] is True


# ---- dist/stop.py ------------------------------------------------------------------------------------------------

def test_a_ctrl_c_exactly_one_second_after_the_first_is_still_the_forwarded_copy(monkeypatch, handlers):
    """The module docstring: a second Ctrl-C is a SIGINT MORE than a second after the first. At exactly 1.0 s it is
    still within the window (a `>=` interrupted the iteration there); just past it, it interrupts."""
    clock(monkeypatch, 50.0, 51.0, 51.0625)           # exact in binary: no rounding decides the comparison
    stop = StopRequests(watch_launcher=False)
    on_signal = functools.partial(stop._on_signal, frame=None)
    not_interrupted(on_signal, signal.SIGINT)
    not_interrupted(on_signal, signal.SIGINT)        # 1.0 s after the first
    interrupted(on_signal, signal.SIGINT)            # 1.0625 s after the first


def test_an_unwatched_run_never_reports_its_launcher_gone_even_when_its_parent_changes(monkeypatch, handlers):
    """Without torchrun (watch_launcher False) the parent is no launcher: a plain `python train.py` whose shell exits
    (re-parented to pid 1) must keep training, not stop every rank as orphans. Recording the parent regardless made
    such a run report launcher_gone once its parent changed."""
    parent = itertools.chain([4242], itertools.repeat(1))      # at construction, then re-parented
    monkeypatch.setattr("dist.stop.os.getppid", lambda: next(parent))
    stop = StopRequests(watch_launcher=False)
    assert not stop.launcher_gone()
    assert flags(stop) == ((0.0, 1.0), (0.0, 1.0))


# ---- dist/setup.py -----------------------------------------------------------------------------------------------

def test_rank_0_under_the_agent_store_joins_as_a_client_too(joined):
    """Under torchrun's agent store the agent serves the store on MASTER_PORT: every rank, rank 0 included, is a
    client (is_master False). Rank 0 as master would try to serve on the port the agent already holds. The existing
    test joins as rank 1, where `is_master=rank == 0` passed as well."""
    monkeypatch, calls = joined
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    init_distributed("gloo", "cpu", timeout_s=9.0)
    args, kwargs = calls["store"]
    assert args == ("10.1.2.3", 29411, 2) and kwargs["is_master"] is False
    assert calls["group"]["rank"] == 0


def test_shutdown_collects_unreachable_objects_before_it_destroys_the_groups(monkeypatch):
    """shutdown()'s docstring: gloo work held by a reference cycle must be destroyed while the group still exists, so
    unreachable objects are collected first. A cycle whose finalizer records whether the group was still there (the
    collector disabled, so that only shutdown's own collection can free it)."""
    import gc

    import torch.distributed as torch_dist
    from dist.setup import shutdown
    events = []
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: "destroyed" not in events)
    monkeypatch.setattr(torch_dist, "destroy_process_group", lambda: events.append("destroyed"))

    class HeldWork:          # stands for a gloo work object in a cycle through a gradient hook
        def __del__(self):
            events.append("collected" if torch_dist.is_initialized() else "collected after the group")
    enabled = gc.isenabled()
    gc.disable()
    try:
        work = HeldWork()
        work.cycle = work
        del work
        shutdown()
    finally:
        if enabled:
            gc.enable()
    assert events == ["collected", "destroyed"]


# ---- dist/errors.py ----------------------------------------------------------------------------------------------

def test_one_line_drops_blank_and_whitespace_only_lines_instead_of_doubling_spaces():
    """A message with blank lines (a simulator's error, load_state_dict's header and tab-indented lines) is one line
    with single spaces between its non-blank lines and none at the ends: an empty line kept as '' joined to a double
    space, and a trailing one to a trailing space, on the `error: ...` line torchrun's summary shows."""
    from dist.errors import one_line
    message = "Error(s) in loading state_dict for ActorCritic:\n\n\tsize mismatch for w: shape [3] vs [4].\n  \n"
    assert one_line(RuntimeError(message)) == ("Error(s) in loading state_dict for ActorCritic: size mismatch for w: "
                                               "shape [3] vs [4].")


def test_an_error_file_that_cannot_be_written_leaves_the_failure_report_alone(tmp_path, monkeypatch):
    """tell_torchrun runs while cli() reports a failure: an error file it cannot write (a directory gone, a full disk)
    must not raise from there, which would replace the failure being reported with an OSError about the file."""
    from dist.errors import tell_torchrun
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "gone" / "error.json"))
    tell_torchrun("error: could not write x", after_peer=True)       # returns, raising nothing
    assert list(tmp_path.iterdir()) == []


# ---- dist/plan.py ------------------------------------------------------------------------------------------------

def test_a_row_of_cadence_dash_never_runs():
    """Cadence "-" is state kept identical by construction: it never runs, whatever bytes it lists (a ledger
    predicting it every iteration would fail plan == ledger)."""
    from dist.plan import PlanRow, expected_ledger
    never = PlanRow("optimizer", "identical by construction", "-", "-", [8])
    assert never.occurrences(10, final_iteration=10) == 0
    assert expected_ledger([never, PlanRow("m", "r", "all_reduce", "iteration", [16])], 10) == {"m": [10, 160]}


def test_the_plan_table_by_hand():
    """The whole table for three rows, written out by hand: text columns left-aligned and the calls column
    right-aligned, each as wide as its widest cell; "every K it" for an every-K row; "(xR steps)" only on a row of
    more than one round; no "(all ranks)" mark when the collectives' group is every rank (collective_size equal to
    the world size), where it tells nothing."""
    from dist.plan import PlanRow, format_plan
    rows = [PlanRow("m", "r", "all_reduce", "iteration", [16]),
            PlanRow("g", "r", "all_reduce", "iteration", [4], rounds=6),
            PlanRow("c", "r", "all_gather", "every", [5], every=4, all_ranks=True)]
    assert format_plan(rows, 2, 2).splitlines() == [
        "sync plan (2 ranks)",
        "  state rule collective cadence    calls  bytes per call",
        "  m     r    all_reduce iteration      1  16 B",
        "  g     r    all_reduce iteration      6  4 B  (x6 steps)",
        "  c     r    all_gather every 4 it     1  5 B"]


# ---- ppo/logger.py -----------------------------------------------------------------------------------------------

def test_closing_the_logger_ends_the_writer_s_thread(tmp_path):
    """Every log() flushes, so what close() adds is the end of TensorBoard's writer thread and event file; a close()
    that only flushed left both open for the life of the process (a thread per RunLogger when one process runs
    train.main again: tests, a notebook, a sweep)."""
    import threading

    from ppo.logger import RunLogger
    before = set(threading.enumerate())
    logger = RunLogger(str(tmp_path / "run"), max_iterations=5, start_iteration=0, steps_per_iteration=4)
    logger.log({"Policy/kl": 0.25}, step=1)
    assert set(threading.enumerate()) - before                # the writer's own thread, while open
    logger.close()
    assert not set(threading.enumerate()) - before
