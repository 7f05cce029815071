"""ppo/minibatch_step.py on the host path and the sync-free one (--ppo.capture-step): the device LR rule against the
host rule (bit for bit, and at exactly 2x and 0.5x the desired KL), an update whose every step is skipped, the
optimizer's implementation and settings as each path builds it, one SyncFreeStep per optimizer (freed with it) and its
refusal of two param groups, an optimizer state of another param-group count kept for load_state_dict to refuse,
minibatch advantage normalization on both paths, and a minibatch that micro-batches do not divide."""

import gc
import math
import weakref

import pytest
import torch

from dist.grad_sync import GradSync
from ppo.kl_schedule import adaptive_lr
from ppo.minibatch_step import SyncFreeStep, build_optimizer, device_adaptive_lr, saved_state_for
from ppo.storage import RolloutStorage
from ppo.update import ppo_update
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg

CPU = torch.device("cpu")


def test_device_lr_rule_gives_the_host_rule_bit_for_bit():
    desired, lr_min, lr_max = 0.01, 1e-5, 1e-2
    g = torch.Generator().manual_seed(0)
    kls = torch.cat([torch.rand(300, generator=g) * 0.04, torch.tensor([0.02, 0.005, 0.0, float("nan"), float("inf")]),
                     torch.zeros(3), torch.full((20,), 1e-6)])
    # the random KLs drift the LR down to lr_min; KLs of 0 leave it; 20 tiny ones climb to lr_max
    host, dev, seen = 1e-3, torch.tensor(1e-3, dtype=torch.float64), set()
    for kl in kls.tolist() * 3:
        if math.isfinite(kl):
            host = adaptive_lr(host, kl, desired, lr_min, lr_max)
        dev = device_adaptive_lr(dev, torch.tensor(kl, dtype=torch.float32), desired, lr_min, lr_max)
        assert dev.item() == host          # exact, including the clamps at lr_min / lr_max
        seen.add(host)
    # Both clamps acted (1.5**17 > lr_max / lr_min = 1000): without the tiny KLs lr_max was never reached, so a device
    # rule that clamped below only passed.
    assert {lr_min, lr_max} <= seen


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
def test_an_update_whose_every_step_is_skipped_reports_no_means_and_the_count(capture):
    """A NaN value on every minibatch: no step is taken, the parameters stay as they were, the loss and KL means are
    NaN (no step to average over; a 0 read as a loss of 0), and skipped_steps counts epochs x minibatches, on both
    paths."""
    model, storage = _storage_and_model()
    start = [p.detach().clone() for p in model.parameters()]
    value = model.value
    model.value = lambda obs: value(obs) * float("nan")
    cfg = ppo_cfg(capture_step=capture, schedule="fixed")
    optimizer = build_optimizer(model.parameters(), cfg, CPU)
    stats = ppo_update(model, optimizer, storage, GradSync(model.parameters(), num_extras=2), cfg,
                       generator=torch.Generator().manual_seed(0))
    means = ("surrogate", "value_function", "entropy", "clip_fraction", "kl", "grad_norm")
    assert all(math.isnan(stats.pop(key)) for key in means)
    assert stats == {"learning_rate": 1e-3, "skipped_steps": float(3 * 2)}
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


def test_build_optimizer_picks_fused_for_both_paths_and_capturable_only_on_cuda_for_capture():
    """Both paths step with the fused kernel (one arithmetic for the host path and --ppo.capture-step);
    `capturable` only with --ppo.capture-step on a CUDA device (CUDA-graph capture refuses Adam without it, and
    a capturable Adam outside a graph keeps its step counts on the device). The device is an argument, so the CUDA
    choice is checked here with host parameters."""
    for device in (CPU, torch.device("cuda")):
        host = build_optimizer(make_model().parameters(), ppo_cfg(), device).param_groups[0]
        assert host["fused"] is True and not host["foreach"] and host["capturable"] is False, device
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


def test_the_sync_free_step_lives_no_longer_than_its_optimizer():
    """docs/gpu.md: a module-level cache of steps kept every optimizer, model and graph pool alive until exit; the
    step lives on its optimizer, so once a run drops its model and optimizer all three are freed.

    Mutant: sync_free_step also keeps each step in a module-level dict (by id(optimizer)) -> the weakrefs live."""
    model, storage = _storage_and_model()
    cfg = ppo_cfg(capture_step=True)
    optimizer = build_optimizer(model.parameters(), cfg, CPU)
    sync = GradSync(model.parameters(), num_extras=2)
    ppo_update(model, optimizer, storage, sync, cfg, generator=torch.Generator().manual_seed(0))
    refs = [weakref.ref(x) for x in (model, optimizer, optimizer.sync_free_step)]
    del model, optimizer, sync, storage
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]


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
