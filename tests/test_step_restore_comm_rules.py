"""ppo/minibatch_step.py, ppo/restore.py, dist/comm.py and train.py's helpers at their edges: the device LR rule at
exactly 2x and 0.5x the desired KL, an update whose every step is skipped, the optimizer's implementation and
settings as each path builds it, one SyncFreeStep per optimizer; what restore takes from a checkpoint and what
from the run; the ledger's counts, the group the wrappers run in and the words of a failed collective; train.cli's
status, line and teardown for each kind of failure."""

import re
import sys
from types import SimpleNamespace

import pytest
import torch

import train
from configs.config import Config
from dist.checkpoint import rng_states
from dist import comm
from dist.errors import RunError, UsageError
from dist.grad_sync import GradSync
from dist.stop import SecondInterrupt
from ppo.kl_schedule import adaptive_lr
from ppo.minibatch_step import SyncFreeStep, build_optimizer, device_adaptive_lr, saved_state_for
from ppo.normalizer import RewardNormalizer
from ppo.restore import restore
from ppo.storage import RolloutStorage
from ppo.update import ppo_update
from tests.multirank import run_ranks
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg

CPU = torch.device("cpu")


# ---- ppo/minibatch_step.py -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kl_dtype", [torch.float64, torch.float32])
def test_the_device_lr_rule_keeps_the_lr_at_exactly_twice_and_half_the_desired_kl(kl_dtype):
    """The rule acts strictly above 2x and strictly below 0.5x the desired KL, as the host rule does. A desired KL of
    2**-7 puts both bounds on values float32 holds exactly, so the KL tensor can sit on them in either precision."""
    desired, lr, lr_min, lr_max = 2.0 ** -7, 1e-3, 1e-5, 1e-2

    def device(kl: float) -> float:
        return device_adaptive_lr(torch.tensor(lr, dtype=torch.float64), torch.tensor(kl, dtype=kl_dtype),
                                  desired, lr_min, lr_max).item()

    for kl in (2.0 ** -6, 2.0 ** -8):                              # 2 * desired, desired / 2: on the bound
        assert device(kl) == adaptive_lr(lr, kl, desired, lr_min, lr_max) == lr
    above = 2.0 ** -6 * (1 + 2.0 ** -20)                              # just past each bound, in float32 too
    below = 2.0 ** -8 * (1 - 2.0 ** -20)
    assert device(above) == adaptive_lr(lr, above, desired, lr_min, lr_max) == lr / 1.5
    assert device(below) == adaptive_lr(lr, below, desired, lr_min, lr_max) == lr * 1.5


def _storage_and_model():
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, CPU)
    fill(storage, 0, model)
    return model, storage


@pytest.mark.parametrize("capture", [False, True])
def test_an_update_whose_every_step_is_skipped_reports_zero_means_and_the_count(capture):
    """A NaN value on every minibatch: no step is taken, the parameters stay as they were, the loss and KL means are
    0 (averaged over max(taken, 1) steps), and skipped_steps counts epochs x minibatches, on both paths."""
    model, storage = _storage_and_model()
    start = [p.detach().clone() for p in model.parameters()]
    value = model.value
    model.value = lambda obs: value(obs) * float("nan")
    cfg = ppo_cfg(capture_step=capture, schedule="fixed")
    optimizer = build_optimizer(model.parameters(), cfg, CPU)
    stats = ppo_update(model, optimizer, storage, GradSync(model.parameters(), num_extras=2), cfg,
                       generator=torch.Generator().manual_seed(0))
    assert stats == {"surrogate": 0.0, "value_function": 0.0, "entropy": 0.0, "kl": 0.0,
                     "learning_rate": 1e-3, "skipped_steps": float(3 * 2)}
    for before, after in zip(start, model.parameters()):
        assert torch.equal(before, after)


@pytest.mark.parametrize("capture", [False, True])
def test_build_optimizer_takes_the_configured_lr_and_eps_on_both_paths(capture):
    """--ppo.learning-rate and --ppo.adam-eps (the mujoco preset's 1e-5, not torch's default 1e-8) reach the Adam
    of a fresh run, host path or --ppo.capture-step."""
    model = make_model()
    group = build_optimizer(model.parameters(), ppo_cfg(capture_step=capture, learning_rate=3e-4, adam_eps=1e-5),
                            CPU).param_groups[0]
    assert (group["lr"], group["eps"]) == (3e-4, 1e-5)


def test_build_optimizer_picks_foreach_for_the_host_path_and_fused_capturable_only_on_cuda_for_capture():
    """The host path steps with the multi-tensor kernels; --ppo.capture-step with the fused one, `capturable` on a
    CUDA device only (CUDA-graph capture refuses Adam without it). The device is an argument, so the CUDA choice is
    checked here with host parameters."""
    host = build_optimizer(make_model().parameters(), ppo_cfg(), CPU).param_groups[0]
    assert host["foreach"] is True and not host["fused"]
    for device, capturable in ((CPU, False), (torch.device("cuda"), True)):
        group = build_optimizer(make_model().parameters(), ppo_cfg(capture_step=True), device).param_groups[0]
        assert group["fused"] is True and group["capturable"] is capturable, device


def test_one_sync_free_step_serves_every_update_of_its_optimizer():
    """The step (on CUDA its captured graph) is made on the first update and kept on the optimizer: a later update
    must not build, warm up and capture a new one."""
    model, storage = _storage_and_model()
    cfg = ppo_cfg(capture_step=True)
    optimizer = build_optimizer(model.parameters(), cfg, CPU)
    sync = GradSync(model.parameters(), num_extras=2)
    advantages, returns = storage.advantages.clone(), storage.returns.clone()
    ppo_update(model, optimizer, storage, sync, cfg, generator=torch.Generator().manual_seed(0))
    first = optimizer.sync_free_step
    storage.advantages, storage.returns = advantages, returns
    ppo_update(model, optimizer, storage, sync, cfg, generator=torch.Generator().manual_seed(1))
    assert optimizer.sync_free_step is first and isinstance(first, SyncFreeStep)


def test_the_sync_free_step_refuses_a_fused_adam_with_two_param_groups():
    """It steers the LR of the first param group only: a second group would step with an LR no rule moves."""
    model = make_model()
    params = list(model.parameters())
    optimizer = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3, fused=True)
    with pytest.raises(ValueError, match="capture-step needs the fused Adam"):
        SyncFreeStep(model, optimizer, GradSync(model.parameters(), num_extras=2), ppo_cfg(capture_step=True))


def test_saved_state_for_keeps_a_param_group_count_mismatch_for_load_state_dict_to_refuse():
    """A checkpoint with more param groups than this run's optimizer must not load with the extra ones dropped."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    saved = torch.optim.Adam([{"params": [a]}, {"params": [b]}], lr=1e-3).state_dict()
    ours = torch.optim.Adam([a, b], lr=1e-3, foreach=True)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        ours.load_state_dict(saved_state_for(ours, saved))


def test_the_sync_free_step_normalizes_each_minibatch_s_advantages_as_the_host_path_does():
    """--ppo.advantage-norm minibatch normalizes inside the minibatch loop: the sync-free step must take the
    normalized advantages too, so both paths (both with the fused Adam) end on the same weights and statistics."""
    results = []
    for capture in (False, True):
        model, storage = _storage_and_model()
        optimizer = build_optimizer(model.parameters(), ppo_cfg(capture_step=True), CPU)   # fused on both
        cfg = ppo_cfg(capture_step=capture, advantage_norm="minibatch")
        stats = ppo_update(model, optimizer, storage, GradSync(model.parameters(), num_extras=2), cfg,
                           generator=torch.Generator().manual_seed(3))
        results.append((stats, [p.detach().clone() for p in model.parameters()]))
    (host_stats, host_params), (dev_stats, dev_params) = results
    assert dev_stats == host_stats
    for p, q in zip(host_params, dev_params):
        assert torch.equal(p, q)



@pytest.mark.parametrize("capture", [False, True])
def test_a_minibatch_that_micro_batches_do_not_divide_is_refused_on_both_paths(capture):
    """48 transitions in 2 minibatches of 24: 5 micro-batches would be unequal, and their mean of means wrong."""
    model, storage = _storage_and_model()
    cfg = ppo_cfg(capture_step=capture, num_micro_batches=5)
    optimizer = build_optimizer(model.parameters(), cfg, CPU)
    message = r"^minibatch of 24 transitions is not divisible by --ppo.num-micro-batches 5$"
    with pytest.raises(ValueError, match=message):
        ppo_update(model, optimizer, storage, GradSync(model.parameters(), num_extras=2), cfg,
                   generator=torch.Generator().manual_seed(0))

# ---- ppo/restore.py --------------------------------------------------------------------------------------------

def _run(**changes) -> Config:
    cfg = Config()
    for name, value in changes.items():
        obj, *path, field = [cfg, *name.split("__")]
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, field, value)
    return cfg


def _built(reward_normalizer: bool = False) -> dict:
    model = make_model()
    return {"model": model, "optimizer": build_optimizer(model.parameters(), ppo_cfg(), CPU), "env": None,
            "reward_normalizer": RewardNormalizer(N, 0.99, 10.0) if reward_normalizer else None}


def _checkpoint(built: dict, rngs: list, config: dict | None = None, **changes) -> dict:
    state = {key: obj.state_dict() for key, obj in built.items() if obj is not None}
    state.update(iteration=2, rng=rngs, layout=[len(rngs), 0],
                 config=config if config is not None else {"seed": 1, "ppo": {"learning_rate": 1e-3}})
    state.update(changes)
    return state


def _roles(rank: int = 0, learners: int = 1):
    return SimpleNamespace(rank=rank, num_learners=learners, num_rollouts=0)


def test_restore_refuses_a_checkpoint_without_the_state_of_a_built_object():
    """A run with a reward normalizer resuming a checkpoint saved without one: a UsageError naming the entry."""
    saved = _checkpoint(_built(), [rng_states()])
    with pytest.raises(UsageError, match=r"^--resume 'c\.pt' has no 'reward_normalizer' state \(saved with other"):
        restore(saved, "c.pt", _built(reward_normalizer=True), None, _roles(), CPU, _run())


def test_restore_refuses_an_adam_moment_of_another_shape_naming_it():
    """Adam's load_state_dict does not compare moment shapes; restore does, before loading, and names the first."""
    built = _built()
    params = list(built["model"].parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    built["optimizer"].step()
    saved = _checkpoint(built, [rng_states()])
    saved["optimizer"]["state"][1]["exp_avg_sq"] = torch.zeros(params[1].numel() + 1)
    fresh = _built()
    with pytest.raises(UsageError, match=re.escape(
            f"--resume 'c.pt' is damaged (its optimizer's 'exp_avg_sq' for parameter 1 has shape "
            f"[{params[1].numel() + 1}], the parameter {list(params[1].shape)}); resume from another checkpoint")):
        restore(saved, "c.pt", fresh, None, _roles(), CPU, _run())


def test_restore_names_an_optimizer_whose_param_groups_do_not_fit():
    """load_state_dict refuses another number of param groups with a ValueError: one UsageError naming the entry."""
    built = _built()
    saved = _checkpoint(built, [rng_states()])
    group = saved["optimizer"]["param_groups"][0]
    saved["optimizer"]["param_groups"] = [{**group, "params": group["params"][:1]},
                                          {**group, "params": group["params"][1:]}]
    with pytest.raises(UsageError, match=r"^--resume 'c\.pt': its optimizer does not fit this run .*parameter groups"):
        restore(saved, "c.pt", _built(), None, _roles(), CPU, _run())


@pytest.mark.parametrize("layout", [True, False], ids=["layout", "no-layout"])
def test_rank_1_of_two_learners_takes_its_own_rng_states(layout):
    """Each rank restores its own entry of the checkpoint's `rng` list; a checkpoint from before `layout` existed
    counts one learner per entry."""
    rngs = [{"torch": torch.Generator().manual_seed(10 + r).get_state(),
             "shuffle": torch.Generator().manual_seed(20 + r).get_state()} for r in range(2)]
    saved = _checkpoint(_built(), rngs)
    if not layout:
        del saved["layout"]
    shuffle, before = torch.Generator().manual_seed(0), torch.get_rng_state()
    try:
        restore(saved, "c.pt", _built(), shuffle, _roles(rank=1, learners=2), CPU, _run())
        assert torch.equal(torch.get_rng_state(), rngs[1]["torch"])
    finally:
        torch.set_rng_state(before)
    assert torch.equal(shuffle.get_state(), rngs[1]["shuffle"])


def test_the_start_up_lines_of_a_resume_with_a_new_lr_and_a_longer_linear_schedule(capsys):
    """Rank 0 says what it resumed, that a typed LR replaces the checkpoint's, and where the linear LR jumps: here
    iteration 2 of a run that annealed 1e-3 to 0 at 4 runs at 2e-4 * (1 - 2/8) = 1.5e-4 instead of 1e-3 * (1 - 2/4)."""
    config = {"seed": 1, "max_iterations": 4, "ppo": {"learning_rate": 1e-3, "schedule": "linear"}}
    saved = _checkpoint(_built(), [rng_states()], config)
    cfg = _run(max_iterations=8, ppo__learning_rate=2e-4, ppo__schedule="linear")
    restore(saved, "c.pt", _built(), None, _roles(), CPU, cfg)
    assert capsys.readouterr().out.splitlines()[-3:] == [
        "[syncppo] resumed c.pt at iteration 2",
        "[syncppo] --ppo.learning-rate 0.0002 replaces the checkpoint's LR (its run started at 0.001)",
        "[syncppo] --max-iterations 8 re-anneals the linear LR (the checkpoint's run reached 0 at 4): iteration 2 runs "
        "at LR 0.00015, not 0.0005"]


@pytest.mark.parametrize("saved_ppo, max_iterations", [({"schedule": "fixed"}, 4), ({"schedule": "linear"}, None)],
                         ids=["other-schedule", "no-max-iterations"])
def test_no_re_anneal_line_unless_both_runs_anneal_linearly_to_a_known_end(capsys, saved_ppo, max_iterations):
    """The jump is only said when the checkpoint's run was linear too and its --max-iterations is known (an older
    checkpoint without it resumes without one, rather than failing on the arithmetic); a dry run says 'would'."""
    config = {"seed": 1, "ppo": {"learning_rate": 1e-3, **saved_ppo}}
    if max_iterations is not None:
        config["max_iterations"] = max_iterations
    saved = _checkpoint(_built(), [rng_states()], config)
    restore(saved, "c.pt", _built(), None, _roles(), CPU, _run(max_iterations=8, ppo__schedule="linear", dry_run=True))
    assert capsys.readouterr().out.splitlines() == ["[syncppo] would resume c.pt at iteration 2"]


def test_only_rank_0_says_that_a_new_seed_restarts_the_rng_streams(capsys):
    """Every rank restarts its streams on a --seed unlike the checkpoint's; the line is said once, by rank 0."""
    rngs = [rng_states(None, torch.Generator()) for _ in range(2)]
    for rank in (1, 0):
        restore(_checkpoint(_built(), rngs), "c.pt", _built(), torch.Generator(), _roles(rank, 2), CPU, _run(seed=5))
        out = capsys.readouterr().out
        assert ("--seed 5 is not the checkpoint run's (1): RNG streams restart" in out) == (rank == 0), rank


# ---- train.py's helpers: cli's status, words and teardown; first_on_node ------------------------------------

@pytest.mark.parametrize("local_rank, first", [(None, True), ("0", True), (" 0 ", True), ("1", False), ("x", True),
                                               ("-1", True)])
def test_first_on_node_is_local_rank_0_or_an_unreadable_one(monkeypatch, local_rank, first):
    """Unset means one process (local rank 0); a value main() will refuse counts as first, so the refusal is said."""
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert train.first_on_node() is first


def _failing_cli(monkeypatch, capsys, failure, local_rank="0"):
    """train.cli around a main() that raises `failure`: (status, stderr, what was torn down and told to torchrun)."""
    events = []

    def main(cfg, typed):
        if failure is not None:
            raise failure
    monkeypatch.setattr(train, "main", main)
    monkeypatch.setattr(train, "shutdown", lambda: events.append("shutdown"))
    monkeypatch.setattr(train, "release_run_dirs", lambda: events.append("release"))
    monkeypatch.setattr(train, "tell_torchrun", lambda message: events.append(("torchrun", message)))
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(sys, "last_value", None, raising=False)
    monkeypatch.setattr(sys, "last_exc", None, raising=False)
    code = train.cli(Config())
    return code, capsys.readouterr().err, events


@pytest.mark.parametrize("failure, code, said", [
    (UsageError("--ppo.clip-param must be > 0"), 2, "error: --ppo.clip-param must be > 0"),
    (RunError("could not write x: No space left"), 1, "error: could not write x: No space left"),
    (comm.CollectiveError("all_reduce for 'metrics' failed on rank 1"), 1,
     "error: all_reduce for 'metrics' failed on rank 1"),
    (KeyboardInterrupt(), 130, "error: interrupted by Ctrl-C outside the training loop: nothing saved since the last "
                               "checkpoint"),
    (SecondInterrupt(), 130, "error: interrupted by a second Ctrl-C: nothing saved since the last checkpoint"),
], ids=["usage", "run", "collective", "ctrl-c", "second-ctrl-c"])
def test_cli_gives_each_failure_its_status_and_one_line_and_tears_down(monkeypatch, capsys, failure, code, said):
    """Status 2 for bad input, 1 for a run-time failure, 130 for Ctrl-C; one line on stderr, the same line for
    torchrun's error file, the process group and run directories released, the failure recorded as uncaught."""
    status, err, events = _failing_cli(monkeypatch, capsys, failure)
    assert (status, err) == (code, said + "\n")
    assert events == [("torchrun", said), "shutdown", "release"]
    assert sys.last_value is failure


def test_cli_prints_an_unexpected_exception_s_traceback_and_its_first_line(monkeypatch, capsys):
    """A bug: its traceback, then 'unexpected <type> (traceback above): <first line of its message>', status 1."""
    status, err, events = _failing_cli(monkeypatch, capsys, ZeroDivisionError("float division by zero\nmore"))
    said = "error: unexpected ZeroDivisionError (traceback above): float division by zero"
    assert status == 1 and err.startswith("Traceback (most recent call last):")
    assert err.endswith("ZeroDivisionError: float division by zero\nmore\n" + said + "\n")
    assert events == [("torchrun", said), "shutdown", "release"]


@pytest.mark.parametrize("failure, local_rank, said", [
    (UsageError("--seed bad"), "0", True), (UsageError("--seed bad"), "1", False),
    (UsageError("--env.task bad", say_here=True), "1", True),
    (UsageError("--env.task bad", say_here=False), "0", False),
    (RunError("disk full"), "1", True)])
def test_cli_says_a_usage_error_once_per_node_unless_it_names_who_says_it(monkeypatch, capsys, failure, local_rank,
                                                                         said):
    """Every rank meets the same bad flag: local rank 0 says it; an error only some ranks meet says `say_here`; a
    run-time failure is said by every rank that meets it. torchrun's error file gets it either way."""
    status, err, events = _failing_cli(monkeypatch, capsys, failure, local_rank)
    assert bool(err) is said and events[0] == ("torchrun", f"error: {failure}")


def test_cli_returns_0_after_a_run_and_tears_nothing_down_itself(monkeypatch, capsys):
    """main() shuts its own process group down; cli adds nothing after a run that ended well."""
    assert _failing_cli(monkeypatch, capsys, None) == (0, "", [])


# ---- dist/comm.py ----------------------------------------------------------------------------------------------

def two_rank_traffic(rank, world_size):
    """Every wrapper once on 2 gloo ranks; what each returned and this rank's ledger."""
    comm.reset_ledger()
    x = torch.tensor([float(rank), 10.0 - rank])                                 # rank 0: [0, 10]; rank 1: [1, 9]
    out = {"max": comm.all_reduce(x.clone(), "metrics", op="max"),
           "min": comm.all_reduce(x.clone(), "metrics", op="min"), "sum": comm.all_reduce(x.clone(), "metrics"),
           "broadcast": comm.broadcast(torch.tensor([rank + 5]), "params", src=1),
           "gathered": comm.all_gather(torch.tensor([rank, 2 * rank], dtype=torch.int32), "checksum")}
    work = comm.all_reduce(torch.ones(3, dtype=torch.float64), "gradients", async_op=True)
    work.wait()
    out["completed"] = work.is_completed()
    if rank == 0:
        comm.send(torch.tensor([7.0, 8.0, 9.0]), "batches", dst=1)
        comm.send(torch.tensor([3]), "control", dst=1)                              # a header naming kind 3
        received = torch.zeros(2, dtype=torch.int32)
        comm.irecv(received, "weight_sync", src=1).wait()
    else:
        received = comm.recv(torch.zeros(3), "batches", src=0)
        out["header"] = comm.recv_then_count(torch.zeros(1, dtype=torch.int64), lambda t: f"kind{int(t[0])}", src=0)
        comm.isend(torch.tensor([4, 2], dtype=torch.int32), "weight_sync", dst=0).wait()
    out["received"] = received
    return out, comm.ledger_snapshot()


@pytest.mark.slow
def test_the_wrappers_on_two_ranks_reduce_broadcast_gather_and_count_what_each_rank_moved():
    """max/min/sum element-wise over [0, 10] and [1, 9]; a broadcast from rank 1; the gather stacked in rank order;
    the ledger counts each call and its payload bytes under its purpose: the sender what it sent, the receiver what it
    received, a header under the purpose it names once received."""
    results = run_ranks(two_rank_traffic, 2)
    for rank, (out, _) in enumerate(results):
        assert out["max"].tolist() == [1.0, 10.0] and out["min"].tolist() == [0.0, 9.0], rank
        assert out["sum"].tolist() == [1.0, 19.0] and out["broadcast"].tolist() == [6], rank
        assert out["gathered"].tolist() == [[0, 0], [1, 2]] and out["completed"], rank
    (out0, ledger0), (out1, ledger1) = results
    assert out1["received"].tolist() == [7.0, 8.0, 9.0] and out1["header"].tolist() == [3]
    assert out0["received"].tolist() == [4, 2]
    collectives = {"metrics": (3, 3 * 8), "params": (1, 8), "checksum": (1, 8), "gradients": (1, 24)}
    assert ledger0 == {**collectives, "batches": (1, 12), "control": (1, 8), "weight_sync": (1, 8)}
    assert ledger1 == {**collectives, "batches": (1, 12), "kind3": (1, 8), "weight_sync": (1, 8)}


def test_in_one_process_the_collectives_return_their_input_and_count_nothing():
    """World size 1: all_reduce and broadcast give the tensor back (None as an async all_reduce's work), all_gather a
    stack of one; nothing crossed ranks, so nothing is counted."""
    comm.reset_ledger()
    x = torch.tensor([1.5, -2.0])
    assert comm.all_reduce(x, "metrics") is x and comm.all_reduce(x, "gradients", async_op=True) is None
    assert comm.broadcast(x, "params") is x
    gathered = comm.all_gather(x, "checksum")
    assert gathered.shape == (1, 2) and torch.equal(gathered[0], x)
    assert comm.ledger_snapshot() == {}


def test_a_ledger_snapshot_is_a_copy_and_reset_empties_the_ledger():
    """Counting after a snapshot does not change it; negative counts take calls back; reset_ledger clears all."""
    comm.reset_ledger()
    comm.ledger_add("metrics", 2, 64)
    before = comm.ledger_snapshot()
    comm.ledger_add("metrics", 3, 16)
    comm.ledger_add("metrics", -1, -8)
    assert before == {"metrics": (2, 64)} and comm.ledger_snapshot() == {"metrics": (4, 72)}
    comm.reset_ledger()
    assert comm.ledger_snapshot() == {}


class _Failing:
    """A backend call that fails (or a work handle whose wait does) with `message`."""

    def __init__(self, message: str):
        self.message = message

    def __call__(self, *args, async_op: bool = False, **kwargs):
        if async_op:        # an async all_reduce fails when waited on
            return self
        raise RuntimeError(self.message)

    def wait(self):
        raise RuntimeError(self.message)


@pytest.mark.parametrize("call, kind", [
    (lambda: comm.all_reduce(torch.ones(2), "metrics"), "all_reduce"),
    (lambda: comm.broadcast(torch.ones(2), "metrics"), "broadcast"),
    (lambda: comm.all_gather(torch.ones(2), "metrics"), "all_gather"),
    (lambda: comm.send(torch.ones(2), "metrics", dst=0), "send"),
    (lambda: comm.recv(torch.ones(2), "metrics", src=0), "recv"),
    (lambda: comm.isend(torch.ones(2), "metrics", dst=0).wait(), "isend"),
    (lambda: comm.irecv(torch.ones(2), "metrics", src=0).wait(), "irecv"),
    (lambda: comm.all_reduce(torch.ones(2), "metrics", async_op=True).wait(), "all_reduce"),
], ids=["all_reduce", "broadcast", "all_gather", "send", "recv", "isend-wait", "irecv-wait", "async-wait"])
@pytest.mark.parametrize("message, said", [("Connection closed by peer [127.0.0.1]:1234\n  at gloo/pair.cc:598",
                                            "Connection closed by peer [127.0.0.1]:1234"), ("  \n", "RuntimeError")])
def test_a_failed_call_or_wait_is_a_collective_error_naming_the_call_purpose_rank_and_cause(
        monkeypatch, call, kind, message, said):
    """Whatever the backend raised becomes one CollectiveError: the call, its purpose, this rank, the flag that sets
    the timeout, and the first line of the backend's message (its type when the message is blank)."""
    failing = _Failing(message)
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    for name in ("all_reduce", "broadcast", "all_gather", "send", "recv"):
        monkeypatch.setattr(comm.torch_dist, name, failing)
    for name in ("isend", "irecv"):
        monkeypatch.setattr(comm.torch_dist, name, lambda *args, **kwargs: failing)
    monkeypatch.setattr(comm.torch_dist, "get_rank", lambda: 1)
    with pytest.raises(comm.CollectiveError) as caught:
        call()
    assert str(caught.value) == (f"{kind} for 'metrics' failed on rank 1: a peer rank died or stalled past the "
                                 f"process group's timeout (train.py: --dist.timeout-s) ({said})")


def test_team_checkpoint_records_learners_then_rollout_ranks(monkeypatch):
    """The layout of a checkpoint of 1 learner + 2 rollout ranks is [1, 2], in that order (load_checkpoint checks its
    first entry against the learners' RNG list); the rollout ranks' RNGs and the first one's env state come from the
    gathered blobs, flattened on the host."""
    seen = []

    def states(gathered, spec):
        seen.append((gathered.device.type, tuple(gathered.shape), spec))
        return [{"torch": 1}, {"torch": 2}], {"steps": 3}
    monkeypatch.setattr(train, "restore_team_states", states)
    roles = SimpleNamespace(num_learners=1, num_rollouts=2)
    entries = train.team_checkpoint(torch.zeros(2, 5, dtype=torch.uint8), {"state_bytes": 5}, roles)
    assert entries == {"env": {"steps": 3}, "rollout_rng": [{"torch": 1}, {"torch": 2}], "layout": [1, 2]}
    assert seen == [("cpu", (10,), {"state_bytes": 5})]


def test_a_work_handle_reports_the_backend_s_completion(monkeypatch):
    """is_completed() is the backend work's answer, not a guess."""
    for done in (False, True):
        work = SimpleNamespace(is_completed=lambda: done)
        monkeypatch.setattr(comm.torch_dist, "isend", lambda *args, **kwargs: work)
        assert comm.isend(torch.ones(1), "control", dst=1).is_completed() is done


def pairs_in_their_own_groups(rank, world_size):
    """Ranks {0, 1} and {2, 3} each in their own group (as learners are, apart from rollout ranks): every wrapper
    runs in the group use_group set, and world_size() is that group's size."""
    groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    comm.use_group(groups[rank // 2])
    try:
        comm.reset_ledger()
        summed = comm.all_reduce(torch.tensor([10.0 ** rank]), "metrics")
        first = comm.broadcast(torch.tensor([rank]), "params", src=2 * (rank // 2))
        gathered = comm.all_gather(torch.tensor([rank]), "checksum")
        return comm.world_size(), summed, first, gathered
    finally:
        comm.use_group(None)


@pytest.mark.slow
def test_collectives_run_in_the_group_use_group_set():
    """4 ranks as two pairs: sums, broadcasts and gathers stay within each pair (1 + 10, 100 + 1000)."""
    results = run_ranks(pairs_in_their_own_groups, 4)
    for rank, (size, summed, first, gathered) in enumerate(results):
        pair = 2 * (rank // 2)
        assert size == 2, rank
        assert summed.tolist() == [10.0 ** pair + 10.0 ** (pair + 1)], rank
        assert first.tolist() == [pair] and gathered.flatten().tolist() == [pair, pair + 1], rank
