"""The sync-free minibatch step (--ppo.capture-step) decides exactly like the host path.

On CPU (the default) the step runs eagerly. On a GPU, `SYNCPPO_TEST_DEVICE=cuda pytest
tests/test_minibatch_step.py` runs the same tests on CUDA, where the step is captured as a CUDA graph
after its warm-up steps and replayed (bench/gpu_check.sh does this). CUDA's fused Adam reads a tensor LR
as float32 (ppo.minibatch_step.lr_tensor), so there the host path's steps take the LR rounded the same way.
"""

import copy
import math
import os
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist.grad_sync import GradSync
import ppo.update
from ppo import minibatch_step
from ppo.minibatch_step import SyncFreeStep, build_optimizer, saved_state_for
from ppo.storage import RolloutStorage
from ppo.update import ppo_update
from tests import fake_cuda_graph
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg

DEVICE = torch.device(os.environ.get("SYNCPPO_TEST_DEVICE", "cpu"))
LR_DTYPE = torch.float64 if DEVICE.type == "cpu" else torch.float32   # as build_optimizer chooses


def run_update(capture: bool, poison_minibatch: int | None = None, iterations: int = 2, linear: bool = False,
               lr_dtype: torch.dtype = LR_DTYPE, graph: bool = False, nan_env: int | None = None, before=None,
               **overrides):
    """`iterations` updates of the host path (capture False) or the sync-free step on the same data, both with the
    fused Adam. The host path's steps take the LR rounded to `lr_dtype`, as the sync-free step's tensor holds it.
    `graph`: the sync-free step captured and replayed on CPU too (install tests/fake_cuda_graph.py first; on CUDA it
    always is). `nan_env`: that env's returns are NaN, so a minibatch per epoch holding it is skipped. `before(it,
    optimizer)` runs before update `it`."""
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, DEVICE)
    fill(storage, 0, model)
    if nan_env is not None:
        storage.returns[:, nan_env] = float("nan")
    model.to(DEVICE)
    cfg = ppo_cfg(capture_step=capture, **overrides)
    optimizer = build_optimizer(model.parameters(), ppo_cfg(capture_step=True), DEVICE)  # both fused, a float LR
    if not capture and lr_dtype != torch.float64:
        step = optimizer.step

        def rounded_step():       # the exact LR stays in the param group for the host path's rule
            group = optimizer.param_groups[0]
            exact, group["lr"] = group["lr"], torch.tensor(group["lr"], dtype=lr_dtype).item()
            step()
            group["lr"] = exact
        optimizer.step = rounded_step
    sync = GradSync(model.parameters(), num_extras=2)
    if graph:
        minibatch_step.sync_free_step(model, optimizer, sync, cfg).capture = True
    if poison_minibatch is not None:   # a NaN loss on one minibatch: its step must be skipped
        calls = {"n": 0}
        value = model.value

        def poisoned(obs):
            calls["n"] += 1
            out = value(obs)
            return out * float("nan") if calls["n"] == poison_minibatch else out
        model.value = poisoned
    stats = []
    advantages, returns = storage.advantages.clone(), storage.returns.clone()
    for it in range(iterations):
        storage.advantages, storage.returns = advantages, returns
        if linear:      # as train.py's linear schedule on a resume: a float unlike the config's, before every update
            optimizer.param_groups[0]["lr"] = 1e-3 * (1.0 - (it + 1) / (iterations + 1))
        if before is not None:
            before(it, optimizer)
        stats.append(ppo_update(model, optimizer, storage, sync, cfg, generator=torch.Generator().manual_seed(7 + it)))
    return model, optimizer, stats


@pytest.mark.parametrize("overrides", [{}, {"num_micro_batches": 2, "schedule": "fixed"}, {"desired_kl": 1e-5}])
def test_sync_free_update_equals_host_update_exactly(overrides):
    host_model, host_opt, host_stats = run_update(False, **overrides)
    dev_model, dev_opt, dev_stats = run_update(True, **overrides)
    for (name, p), q in zip(host_model.named_parameters(), dev_model.parameters()):
        assert torch.equal(p, q), name
    for s_h, s_d in zip(host_opt.state.values(), dev_opt.state.values()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s_h[key], s_d[key]), key
    assert dev_stats == host_stats          # LR, KL, loss means and skip counts, as floats
    assert host_stats[-1]["learning_rate"] != 1e-3 or overrides.get("schedule") == "fixed"


def test_linear_schedule_assigning_the_lr_before_the_first_update_equals_the_host_update():
    """train.py assigns the linear schedule's LR (a float) before the first update, so before the sync-free step
    exists: that step refused the optimizer ('needs the fused Adam with a tensor LR'), ending every
    --ppo.capture-step run with the linear schedule (the mujoco preset's) after its first rollout."""
    host_model, _, host_stats = run_update(False, iterations=3, linear=True, schedule="linear")
    dev_model, _, dev_stats = run_update(True, iterations=3, linear=True, schedule="linear")
    for p, q in zip(host_model.parameters(), dev_model.parameters()):
        assert torch.equal(p, q)
    assert dev_stats == host_stats
    assert [s["learning_rate"] for s in dev_stats] == [1e-3 * (1.0 - (it + 1) / 4) for it in range(3)]   # not 1e-3


def test_a_float32_lr_tensor_rounds_only_the_steps_not_the_lr_of_the_rule_statistics_and_checkpoints(monkeypatch):
    """CUDA's fused Adam reads its LR tensor as float32 (simulated here on the host, whose fused kernel takes one
    too). The sync-free step seeded its float64 LR from that tensor, so the LR sequence it reported, and the LR a
    checkpoint saved, started from 0.0010000000474974513 instead of 1e-3: it now keeps the exact LR beside it."""
    monkeypatch.setattr(minibatch_step, "lr_tensor",
                        lambda lr, device: torch.tensor(lr, dtype=torch.float32, device=device))
    host_model, host_opt, host_stats = run_update(False, lr_dtype=torch.float32)
    dev_model, dev_opt, dev_stats = run_update(True)
    for p, q in zip(host_model.parameters(), dev_model.parameters()):
        assert torch.equal(p, q)
    assert dev_stats == host_stats           # the LR sequence included: the host path's rule on Python floats
    assert dev_opt.param_groups[0]["lr"] == host_opt.param_groups[0]["lr"] == dev_stats[-1]["learning_rate"]
    assert isinstance(dev_opt.param_groups[0]["lr"], float)


def test_non_finite_step_is_skipped_exactly_as_on_the_host():
    host_model, host_opt, host_stats = run_update(False, poison_minibatch=3)
    dev_model, dev_opt, dev_stats = run_update(True, poison_minibatch=3)
    assert host_stats[0]["skipped_steps"] == dev_stats[0]["skipped_steps"] == 1.0
    steps = ppo_cfg().num_epochs * ppo_cfg().num_mini_batches
    assert all(s["step"].item() == 2 * steps - 1 for s in dev_opt.state.values())   # the skipped one not counted
    for p, q in zip(host_model.parameters(), dev_model.parameters()):
        assert torch.isfinite(q).all()
        assert torch.equal(p, q)
    assert dev_stats == host_stats


@pytest.mark.parametrize("capture", [False, True])
def test_an_infinite_kl_leaves_the_adaptive_lr_unchanged(capture):
    """A stored old-policy std of 0 makes KL(old || new) = log(sigma / 0) = +inf on every minibatch (one
    minibatch per epoch here) while the loss and its gradient stay finite, so every step is taken. The rule must
    not act on that KL: +inf > 2 * desired_kl would divide the LR by 1.5 at each step. Both paths keep it."""
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, DEVICE)
    fill(storage, 0, model)
    storage.action_std[0, 0] = 0.0
    model.to(DEVICE)
    cfg = ppo_cfg(capture_step=capture, num_mini_batches=1, schedule="adaptive")
    optimizer = build_optimizer(model.parameters(), cfg, DEVICE)
    stats = ppo_update(model, optimizer, storage, GradSync(model.parameters(), num_extras=2), cfg,
                       generator=torch.Generator().manual_seed(0))
    assert stats["kl"] == math.inf and stats["skipped_steps"] == 0.0
    assert stats["learning_rate"] == optimizer.param_groups[0]["lr"] == cfg.learning_rate   # a float, exact


def test_fused_adam_found_inf_leaves_parameters_and_state_untouched():
    """The mechanism the skip relies on, checked directly against a copy."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(10, device=DEVICE))
    opt = torch.optim.Adam([p], lr=torch.tensor(1e-2, dtype=LR_DTYPE, device=DEVICE), fused=True)
    p.grad = torch.randn(10, device=DEVICE)
    opt.step()
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    p.grad = torch.full((10,), float("nan"), device=DEVICE)
    opt.found_inf = torch.ones((), device=DEVICE)
    opt.step()
    assert torch.equal(p, before[0])
    for key, value in opt.state[p].items():
        assert torch.equal(value, before[1][key]), key


def test_capture_step_rejects_a_plain_optimizer():
    model = make_model()
    with pytest.raises(ValueError, match="capture-step"):
        SyncFreeStep(model, torch.optim.Adam(model.parameters()), GradSync(model.parameters(), num_extras=2),
                     ppo_cfg(capture_step=True))


def test_an_lr_assigned_from_outside_is_adopted():
    """The linear schedule assigns a float to the param group before each update."""
    model = make_model().to(DEVICE)
    cfg = ppo_cfg(capture_step=True, schedule="fixed")
    opt = build_optimizer(model.parameters(), cfg, DEVICE)
    step = SyncFreeStep(model, opt, GradSync(model.parameters(), num_extras=2), cfg)
    tensor = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = 3e-4
    step.begin()
    assert opt.param_groups[0]["lr"] is tensor and step.lr.item() == 3e-4
    assert tensor.item() == torch.tensor(3e-4, dtype=LR_DTYPE).item()   # float32 on CUDA


@pytest.mark.parametrize("saved_with_capture", [False, True])
def test_a_checkpoint_of_either_path_resumes_in_the_other(saved_with_capture):
    """The saved LR, moments and step counts load; the implementation stays the one this run built."""
    def stepped(capture: bool):
        model = make_model().to(DEVICE)
        opt = build_optimizer(model.parameters(), ppo_cfg(capture_step=capture), DEVICE)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        return model, opt

    _, saving = stepped(saved_with_capture)
    # A checkpoint of an earlier version of the capture path held its LR as a tensor; every one now holds a float.
    saving.param_groups[0]["lr"] = (torch.tensor(2.5e-4, dtype=LR_DTYPE, device=DEVICE) if saved_with_capture
                                    else 2.5e-4)
    saved = saving.state_dict()
    model, resuming = stepped(not saved_with_capture)
    built = dict(resuming.param_groups[0])
    resuming.load_state_dict(saved_state_for(resuming, saved))
    group = resuming.param_groups[0]
    for key in ("fused", "capturable", "foreach"):
        assert group[key] == built[key], key
    assert group["lr"] == float(saving.param_groups[0]["lr"]) and isinstance(group["lr"], float)   # the saved LR
    for p, q in zip(saving.state.values(), resuming.state.values()):
        assert torch.equal(p["exp_avg"].cpu(), q["exp_avg"].cpu()) and float(p["step"]) == float(q["step"]) == 1.0
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    resuming.step()                        # the resumed optimizer runs with its own implementation
    assert all(float(s["step"]) == 2.0 for s in resuming.state.values())


def assert_same_run(host, dev) -> None:
    """Two run_update results: parameters, Adam's moments and step counts, and the statistics, exactly equal."""
    (host_model, host_opt, host_stats), (dev_model, dev_opt, dev_stats) = host, dev
    for (name, p), q in zip(host_model.named_parameters(), dev_model.parameters()):
        assert torch.equal(p, q), name
    assert len(host_opt.state) == len(dev_opt.state)
    for s_h, s_d in zip(host_opt.state.values(), dev_opt.state.values()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s_h[key], s_d[key]), key
    assert dev_stats == host_stats


@pytest.mark.parametrize("overrides", [{}, {"num_micro_batches": 2, "schedule": "fixed"}, {"nan_env": 2},
                                       {"advantage_norm": "minibatch", "minibatch_unit": "transition"}])
def test_a_captured_and_replayed_update_equals_the_host_update_exactly(monkeypatch, overrides):
    """As a CUDA graph the step's Python runs once, at capture; every replay repeats only its kernels, so each
    decision (the LR rule, the non-finite skip, the statistics) must be made on the device. On CPU through
    tests/fake_cuda_graph.py (recording runs nothing, a replay runs the recorded ops again on the same tensors), on
    CUDA through a real graph; with a NaN env one replayed step per epoch is skipped; per-minibatch advantages are
    written into each minibatch, copied into the graph's input with the other fields."""
    if DEVICE.type == "cpu":
        fake_cuda_graph.install(monkeypatch)
    host = run_update(False, iterations=3, **overrides)
    dev = run_update(True, iterations=3, graph=True, **overrides)
    assert_same_run(host, dev)
    assert dev[1].sync_free_step.graph is not None
    assert [s["skipped_steps"] for s in dev[2]] == [3.0 if "nan_env" in overrides else 0.0] * 3


@pytest.mark.parametrize("loaded", ["copy", "unstepped"])
def test_a_step_recorded_again_after_load_state_dict_replaced_adams_moments_equals_the_host_path(monkeypatch, loaded):
    """A CUDA graph steps the moment tensors that existed when it was recorded: after `load_state_dict` gave Adam new
    ones, the next update records the step again instead of replaying a graph that steps the old ones. It warms up
    first, as before the first recording: a state loaded from an optimizer that never stepped holds no moments, and
    the step recorded at once had Adam create them inside the capture, so every replay zero-filled them again before
    stepping (each step Adam's first, from zero moments). Against the host path with the same load; on CPU through
    tests/fake_cuda_graph.py, whose replays run the recorded ops again as a GPU's do, on CUDA through real graphs."""
    if DEVICE.type == "cpu":
        fake_cuda_graph.install(monkeypatch)
    graphs = []

    def load(it, optimizer):
        if hasattr(optimizer, "sync_free_step"):
            graphs.append(optimizer.sync_free_step.graph)
        if it == 1:    # as from a file: new tensors
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()) if loaded == "copy" else
                                      build_optimizer(make_model().to(DEVICE).parameters(), ppo_cfg(capture_step=True),
                                                      DEVICE).state_dict())

    host = run_update(False, iterations=3, before=load)
    dev = run_update(True, iterations=3, graph=True, before=load)
    assert_same_run(host, dev)
    step = dev[1].sync_free_step
    assert graphs[0] is None and graphs[1] is not None and graphs[2] not in (None, graphs[1])
    assert step.graph is graphs[2]    # the third update replayed the graph the second recorded
    moments = [t for state in dev[1].state.values() for t in state.values()]     # Adam steps them in place
    assert len(step.captured_state) == len(moments) and all(a is b for a, b in zip(step.captured_state, moments))


class HostIssued(TorchDispatchMode):
    """The aten ops issued while active, leaving out those a graph's replay issues: a CUDA graph's replay is one
    launch issuing no aten op, the CPU stand-in's reruns the recorded ones (`replaying` is set around it)."""

    def __init__(self, replaying: list[bool]):
        super().__init__()
        self.ops, self.replaying = [], replaying

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.replaying[0]:
            self.ops.append((func, args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overrides", [{}, {"num_micro_batches": 2, "schedule": "fixed"},
                                       {"advantage_norm": "minibatch", "minibatch_unit": "transition"}])
def test_the_graph_reads_one_packed_input_laid_out_as_the_host_minibatch_and_a_replay_copies_it_once(monkeypatch,
                                                                                                    overrides):
    """The captured step read contiguous copies of each field, made by one copy per field before every replay (9
    launches where one does), while the host path reads the fields as views of the packed minibatch [B, F] (row
    stride F): cuBLAS picks GEMM kernels partly by leading dimension and alignment, so the two could round
    differently, a false alarm of the exactness tests on a GPU. The graph's input is now one buffer laid out as the
    packed minibatch, the fields it reads are views of it with the host path's shapes, strides and offsets, and a
    replay issues one op: the copy of the packed minibatch into that buffer. On CPU through tests/fake_cuda_graph.py,
    on CUDA through a real graph (whose replay issues no aten op)."""
    if DEVICE.type == "cpu":
        fake_cuda_graph.install(monkeypatch)
    seen = {False: [], True: []}    # per path: the layout of each minibatch backward_minibatch was handed
    path = [False]

    def spied(original):
        def backward(model, batch, grad_sync, cfg):
            storages = {v.untyped_storage().data_ptr() for v in batch.values()}
            layout = tuple((k, tuple(v.shape), v.stride(), v.storage_offset()) for k, v in batch.items())
            seen[path[0]].append((storages, layout))
            return original(model, batch, grad_sync, cfg)
        return backward
    monkeypatch.setattr(ppo.update, "backward_minibatch", spied(ppo.update.backward_minibatch))
    monkeypatch.setattr(minibatch_step, "backward_minibatch", spied(minibatch_step.backward_minibatch))
    replaying, replays = [False], []
    replay, call = torch.cuda.CUDAGraph.replay, SyncFreeStep.__call__

    def flagged_replay(graph):
        replaying[0] = True
        try:
            replay(graph)
        finally:
            replaying[0] = False

    def counted_call(step, packed, *args):
        if step.graph is None:          # a warm-up step, or the capture (whose replay comes back here)
            return call(step, packed, *args)
        issued = HostIssued(replaying)
        with issued:
            call(step, packed, *args)
        replays.append((issued.ops, packed, step))
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", flagged_replay)
    monkeypatch.setattr(SyncFreeStep, "__call__", counted_call)

    host = run_update(False, iterations=2, **overrides)
    path[0] = True
    dev = run_update(True, iterations=2, graph=True, **overrides)
    assert_same_run(host, dev)
    steps = 2 * ppo_cfg().num_epochs * ppo_cfg().num_mini_batches
    assert len(seen[False]) == steps and len(seen[True]) == minibatch_step.CAPTURE_WARMUP_STEPS + 1   # + the capture
    host_layouts = {layout for storages, layout in seen[False]}
    assert len(host_layouts) == 1 and all(len(storages) == 1 for storages, _ in seen[False])   # views of one tensor
    storages, captured_layout = seen[True][-1]           # what the graph reads
    assert captured_layout in host_layouts               # the host path's shapes, strides and offsets
    step = dev[1].sync_free_step
    assert storages == {step.static.untyped_storage().data_ptr()}
    assert len(replays) == steps - minibatch_step.CAPTURE_WARMUP_STEPS
    for ops, packed, replayed in replays:
        assert replayed is step and [func for func, _ in ops] == [torch.ops.aten.copy_.default], ops   # one copy
        (_, (dst, src)), = ops                            # of the packed minibatch into the graph's input
        assert dst.data_ptr() == step.static.data_ptr() and dst.shape == step.static.shape and src is packed
        assert dst.data_ptr() % 64 == src.data_ptr() % 64    # so each field (same offset) is aligned alike in both


def test_a_replay_refuses_a_minibatch_laid_out_otherwise_than_the_captured_one(monkeypatch):
    """copy_ would broadcast a smaller minibatch into the graph's input, and a buffer of the same shape with other
    strides or field widths would put other numbers where the graph reads a field: each is refused, naming both."""
    if DEVICE.type == "cpu":
        fake_cuda_graph.install(monkeypatch)
    _, optimizer, _ = run_update(True, iterations=1, graph=True)
    step = optimizer.sync_free_step
    widths = RolloutStorage(T, N, OBS, A, DEVICE).widths
    B, F = step.static.shape
    assert (B, F) == (T * N // ppo_cfg().num_mini_batches, sum(max(w, 1) for w in widths.values()))
    other = {**widths, "actor_obs": widths["actor_obs"] + 1, "critic_obs": widths["critic_obs"] - 1}   # the same F
    for packed, layout in [(torch.zeros(B // 2, F, device=DEVICE), widths),
                           (torch.zeros(F, B, device=DEVICE).t(), widths),
                           (torch.zeros(B, F, device=DEVICE), other)]:
        with pytest.raises(ValueError, match=r"^--ppo\.capture-step: the minibatch has \(shape, strides, field "
                                             r"widths\) .*, the captured step \(\(" + f"{B}, {F}\\), \\({F}, 1\\)"):
            step(packed, layout)
    graph, replays = step.graph, getattr(step.graph, "replays", 0)     # the CPU stand-in counts its replays
    step(torch.zeros(B, F, device=DEVICE), dict(widths))                 # an equal layout (another dict) replays
    assert step.graph is graph and (DEVICE.type != "cpu" or graph.replays == replays + 1)


@pytest.mark.parametrize("capture", [False, True])
def test_a_kl_of_exactly_zero_leaves_the_adaptive_lr(capture):
    """An update's first minibatch meets the policy that collected the rollout: KL exactly 0, no evidence about the
    step size, so the LR stays (RSL-RL's rule; it was raised 1.5x at every update's start before 2026-12-04). One
    minibatch per update, so that KL is the only one the rule sees."""
    _, optimizer, stats = run_update(capture, iterations=1, num_epochs=1, num_mini_batches=1)
    assert stats[0]["kl"] == 0.0
    assert stats[0]["learning_rate"] == optimizer.param_groups[0]["lr"] == 1e-3
