"""ppo/update.py, ppo/minibatch_step.py, ppo/restore.py and dist/comm.py at their edges: the 1e-8 that keeps a
constant advantage from becoming 0/0 (over the rollout and per minibatch), the unusable-policy error's advice under
the adaptive schedule, q micro-batches adding up to the whole minibatch's step, a captured step's all-reduce counted
once per replay, a resumed checkpoint keeping this run's capturable setting, a transposed Adam moment, a checkpoint
of another rollout layout with as many learners, the resume's lines (the seeds of the layout it resumes on, said by
rank 0 alone), and dist.comm's device setter.

Mutants of these files found equivalent (no test can tell them apart):
- kl_schedule: clamping as max(min(lr, lr_max), lr_min) (validate ensures lr_min <= lr_max); `elif` -> `if` (the two
  KL ranges are disjoint for a positive desired KL);
- update: normalizing "minibatch" advantages over the rollout first (a per-minibatch normalization is invariant to
  that affine map, up to the 1e-8 and float32 rounding);
- minibatch_step: SyncFreeStep.finish dividing by max(taken, 0.5) (the sums are 0 when no step was taken).
- update: setting the adaptive LR on param_groups[0] only (build_optimizer makes one group, and SyncFreeStep
  refuses more).
The CUDA-graph replay path (shape check, ledger per replay, warm-up count) runs on CPU only through
tests/fake_cuda_graph.py (tests/test_minibatch_step.py, and below: the recorded step's own input and field widths).
"""

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from dist import comm
from dist.checkpoint import rng_states
from dist.errors import RunError, UsageError
from dist.grad_sync import GradSync
from ppo.loss import gaussian_kl, ppo_loss
from ppo.minibatch_step import CAPTURE_WARMUP_STEPS, backward_minibatch, build_optimizer, sync_free_step
from ppo.restore import restore
from ppo.storage import RolloutStorage
from ppo.update import checked_noise_std, normalize_advantages, ppo_update
from tests import fake_cuda_graph
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg
from tests.test_restore import CPU, _built, _checkpoint, _run


# ---- ppo/update.py ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["local", "global"])
def test_advantages_with_no_or_tiny_spread_are_divided_by_std_plus_1e_8(mode):
    """A rollout whose advantages are all equal normalizes to 0, not 0/0 = nan (which would skip every step); a
    spread of 1e-9 is divided by 1e-9 + 1e-8, not scaled up to unit std."""
    s = RolloutStorage(2, 2, {"policy": 1, "critic": 1}, 1, CPU)
    s.advantages = torch.full((2, 2), 0.75)
    normalize_advantages(s, mode)
    assert torch.equal(s.advantages, torch.zeros(2, 2))
    s.advantages = torch.tensor([[1e-9, -1e-9], [-1e-9, 1e-9]])        # mean 0, population std 1e-9
    normalize_advantages(s, mode)
    expected = torch.tensor([[1.0, -1.0], [-1.0, 1.0]]) * (1e-9 / 1.1e-8)
    torch.testing.assert_close(s.advantages, expected, rtol=1e-5, atol=0)


def test_a_minibatch_of_equal_advantages_normalizes_to_0_and_its_step_is_taken():
    """advantage_norm "minibatch" divides by the minibatch's std + 1e-8 as well: equal advantages give 0, not
    0/0 = nan, whose gradient would make every such step a skipped one."""
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, CPU)
    fill(storage, 0, model)
    storage.advantages = torch.full((T, N), 0.75)
    cfg = ppo_cfg(num_epochs=1, num_mini_batches=2, advantage_norm="minibatch", schedule="fixed")
    stats = ppo_update(model, torch.optim.Adam(model.parameters(), lr=1e-3), storage,
                       GradSync(model.parameters(), num_extras=2), cfg, generator=torch.Generator().manual_seed(0))
    assert stats["skipped_steps"] == 0.0
    assert stats["surrogate"] == 0.0            # -mean(ratio * 0) in both steps


@pytest.mark.parametrize("capture", [False, True])
def test_a_skipped_step_leaves_the_adaptive_lr_where_it_was(capture):
    """NaN returns make every step non-finite, so every one is skipped and the policy never moves: each minibatch's
    KL is then 0, which the rule reads as "too small". Acting on it at skipped steps multiplied the LR by 1.5 six
    times (1e-3 -> 1.1e-2), so a run in trouble came out of it at lr-max. Both paths keep the LR."""
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, CPU)
    fill(storage, 0, model)
    storage.returns.fill_(float("nan"))
    cfg = ppo_cfg(capture_step=capture, lr_max=1.0)
    optimizer = build_optimizer(model.parameters(), cfg, CPU)
    before = [p.detach().clone() for p in model.parameters()]
    stats = ppo_update(model, optimizer, storage, GradSync(model.parameters(), num_extras=2), cfg,
                       generator=torch.Generator().manual_seed(0))
    assert stats["skipped_steps"] == cfg.num_epochs * cfg.num_mini_batches == 6
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))   # so the policy did not move
    assert stats["learning_rate"] == optimizer.param_groups[0]["lr"] == cfg.learning_rate


def test_the_adaptive_lr_acts_only_at_taken_steps(monkeypatch):
    """One poisoned minibatch of six: the host path applies the rule five times, once before each step it takes."""
    import ppo.update
    kls = []
    original = ppo.update.adaptive_lr
    monkeypatch.setattr(ppo.update, "adaptive_lr", lambda lr, kl, *a: kls.append(kl) or original(lr, kl, *a))
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, CPU)
    fill(storage, 0, model)
    calls = {"n": 0}
    value = model.value

    def poisoned(obs):                       # the second minibatch's value is NaN: that step alone is skipped
        calls["n"] += 1
        return value(obs) * float("nan") if calls["n"] == 2 else value(obs)
    model.value = poisoned
    cfg = ppo_cfg()
    optimizer = build_optimizer(model.parameters(), cfg, CPU)
    stats = ppo_update(model, optimizer, storage, GradSync(model.parameters(), num_extras=2), cfg,
                       generator=torch.Generator().manual_seed(0))
    assert stats["skipped_steps"] == 1.0 and len(kls) == 5
    lr = cfg.learning_rate
    for kl in kls:
        lr = original(lr, kl, cfg.desired_kl, cfg.lr_min, cfg.lr_max)
    assert stats["learning_rate"] == lr


def test_every_epoch_normalizes_each_minibatch_s_advantages(monkeypatch):
    """advantage_norm "minibatch": every step of every epoch sees its minibatch's advantages at mean 0 and unbiased
    std 1 (the storage keeps the raw ones, so epoch 2 must normalize again), checked in numpy per step."""
    import ppo.update
    seen = []
    original = ppo.update.backward_minibatch

    def spy(model, batch, grad_sync, cfg):
        seen.append(batch["advantages"].double().numpy().copy())
        return original(model, batch, grad_sync, cfg)

    monkeypatch.setattr(ppo.update, "backward_minibatch", spy)
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, CPU)
    fill(storage, 0, model)
    storage.advantages = storage.advantages * 5 + 3
    cfg = ppo_cfg(num_epochs=2, num_mini_batches=2, advantage_norm="minibatch", schedule="fixed")
    ppo_update(model, torch.optim.Adam(model.parameters(), lr=1e-3), storage,
               GradSync(model.parameters(), num_extras=2), cfg, generator=torch.Generator().manual_seed(0))
    assert len(seen) == 4
    for adv in seen:
        assert abs(adv.mean()) < 1e-6 and abs(adv.std(ddof=1) - 1.0) < 1e-6


def test_an_unusable_policy_names_lr_max_as_the_adaptive_runs_fix():
    """Under --ppo.schedule adaptive the LR moves on its own between --ppo.lr-min and --ppo.lr-max: a step too large
    comes from the LR having climbed to lr-max, so the error names --ppo.lr-max (lowering --ppo.learning-rate, where
    the adaptive schedule only starts, fixes nothing; lr-min is the floor, not the ceiling).
    Mutant: the error's advice names --ppo.lr-min for the adaptive schedule."""
    model = make_model()
    with torch.no_grad():
        model.log_std[0] = 1e4                # exp() is inf in float32
    with pytest.raises(RunError) as exc:
        checked_noise_std(model, 3, 0.01)
    message = str(exc.value)
    assert "lower --ppo.learning-rate (adaptive: --ppo.lr-max) or the loss weights" in message, message
    assert "lr-min" not in message


# ---- ppo/minibatch_step.py ------------------------------------------------------------------------------------

def _recorded_on_storage_rows(monkeypatch, widths: dict):
    """A sync-free step warmed up on copies of a filled storage's rows, then recorded (on CPU through
    tests/fake_cuda_graph.py) with its first minibatch's rows, a view of the storage, laid out by `widths`."""
    fake_cuda_graph.install(monkeypatch)
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, CPU)
    fill(storage, 0, model)
    cfg = ppo_cfg(capture_step=True)
    optimizer = build_optimizer(model.parameters(), cfg, CPU)
    step = sync_free_step(model, optimizer, GradSync(model.parameters(), num_extras=2), cfg)
    step.capture = True
    rows, batch = storage.data.flatten(0, 1), T * N // cfg.num_mini_batches      # [T * N, F], a view of the storage
    step.begin()
    for i in range(CAPTURE_WARMUP_STEPS):
        step(rows[i % 2 * batch:(i % 2 + 1) * batch].clone(), widths)
    assert step.graph is None
    kept = storage.data.clone()
    step(rows[:batch], widths)                               # recorded with the storage's first rows, then replayed
    assert step.graph is not None and step.graph.replays == 1
    return step, storage, kept, rows[batch:2 * batch].clone()


def test_a_recorded_step_s_input_is_its_own_so_a_replay_leaves_the_minibatch_it_was_recorded_with_alone(monkeypatch):
    """The graph's input is a buffer of its own, laid out as the minibatch it was recorded with: a replay copies
    the next minibatch into it. Were it the caller's tensor (here a view of the rollout storage's rows), every replay
    would write the next minibatch over the caller's data."""
    widths = RolloutStorage(T, N, OBS, A, CPU).widths
    step, storage, kept, other = _recorded_on_storage_rows(monkeypatch, widths)
    step(other, widths)                                      # a replay with other rows
    assert step.graph.replays == 2 and torch.equal(storage.data, kept)
    step.finish()


def test_a_replay_refuses_field_widths_changed_in_the_dict_the_step_was_recorded_with(monkeypatch):
    """The step keeps the field widths it was recorded with, not the caller's dict: changed in place afterwards
    (the same F, other offsets), the dict would put other numbers where the graph reads a field, and is refused."""
    widths = dict(RolloutStorage(T, N, OBS, A, CPU).widths)
    step, _, _, other = _recorded_on_storage_rows(monkeypatch, widths)
    widths["actor_obs"], widths["critic_obs"] = widths["actor_obs"] + 1, widths["critic_obs"] - 1
    with pytest.raises(ValueError, match=r"^--ppo\.capture-step: the minibatch has \(shape, strides, field widths\)"):
        step(other, widths)
    assert step.graph.replays == 1


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
    return grads, kl_sum.item(), [terms[k].item() for k in ("surrogate", "value_function", "entropy", "clip_fraction")]


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


# ---- ppo/restore.py --------------------------------------------------------------------------------------------

def test_restore_refuses_an_adam_moment_transposed_to_the_same_number_of_elements():
    """Same element count, other shape: Adam's step would fail on the broadcast mid-run (or, where it broadcasts,
    mix up entries), so restore names it as damage before loading."""
    built = _built()
    params = list(built["model"].parameters())
    index = next(i for i, p in enumerate(params) if p.dim() == 2 and p.shape[0] != p.shape[1])
    rows, cols = params[index].shape
    for p in params:
        p.grad = torch.ones_like(p)
    built["optimizer"].step()
    saved = _checkpoint(built, [rng_states()])
    saved["optimizer"]["state"][index]["exp_avg"] = torch.zeros(cols, rows)
    with pytest.raises(UsageError, match=rf"its optimizer's 'exp_avg' for parameter {index} has shape "
                                         rf"\[{cols}, {rows}\], the parameter \[{rows}, {cols}\]\)"):
        restore(saved, "c.pt", _built(), None, SimpleNamespace(rank=0, num_learners=1, num_rollouts=0), CPU, _run())


def test_a_checkpoint_of_as_many_learners_but_other_rollout_ranks_restarts_the_learner_streams(capsys):
    """The layout is the learners and the rollout ranks together: 1 + 1 resumed on 1 + 2 restarts every stream from
    the seeds, the learner's too, and says so, though the learner's saved entry would fit its generators."""
    saved_torch, saved_shuffle = torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)
    rngs = [{"torch": saved_torch.get_state(), "shuffle": saved_shuffle.get_state()}]
    saved, built = _checkpoint(_built(), rngs, layout=[1, 1]), _built()
    shuffle, before = torch.Generator().manual_seed(7), torch.get_rng_state()
    expected_shuffle = shuffle.get_state()
    try:
        torch.manual_seed(3)        # after the build, which seeds torch itself
        expected_torch = torch.get_rng_state()
        restore(saved, "c.pt", built, shuffle, SimpleNamespace(rank=0, num_learners=1, num_rollouts=2), CPU, _run())
        assert torch.equal(torch.get_rng_state(), expected_torch)
    finally:
        torch.set_rng_state(before)
    assert torch.equal(shuffle.get_state(), expected_shuffle)
    assert "resuming a checkpoint of 1 learner(s) + 1 rollout rank(s) on 1 + 2: RNG streams restart" in \
        capsys.readouterr().out


@pytest.mark.parametrize("learners, rollouts, seeds", [
    (2, 0, "RNG streams restart from rank_seed(--seed, rank); everything else"),
    (1, 2, "RNG streams restart from their seeds (rank_seed(--seed, rank) on a learner, rank_seed(--seed, j) on "
           "rollout rank L + j of L learners); everything else")])
def test_a_layout_change_names_the_seeds_of_the_layout_it_resumes_on(capsys, learners, rollouts, seeds):
    """Resumed on another layout, every RNG stream restarts from its seed, and the line says which:
    rank_seed(--seed, rank) when every rank is a learner (however many), and a rollout rank's own seed as well when
    the run has rollout ranks (however few learners). The choice follows the rollout ranks, not the number of learners.
    Mutant: the rollout ranks' seeds named when there is more than one learner instead of when there are rollout
    ranks."""
    saved = _checkpoint(_built(), [rng_states()], layout=[3, 1])          # a layout neither run has
    before = torch.get_rng_state()
    try:
        restore(saved, "c.pt", _built(), None, SimpleNamespace(rank=0, num_learners=learners, num_rollouts=rollouts),
                CPU, _run())
    finally:
        torch.set_rng_state(before)
    out = capsys.readouterr().out
    assert f"resuming a checkpoint of 3 learner(s) + 1 rollout rank(s) on {learners} + {rollouts}: {seeds} is " \
           f"restored" in out, out


@pytest.mark.parametrize("case", ["restored", "another-seed", "states-misfit", "another-layout"])
def test_only_rank_0_says_how_a_resume_went(capsys, case):
    """Every rank restores the same file, and rank 0 alone prints (the start-up lines are the run's, said once): on
    rank 1 of 2 learners nothing is printed, whether the RNG streams were restored, restart from another --seed,
    restart because the saved states do not fit, or restart on another layout; rank 0 prints the resumed line.
    Mutant: the resumed line (and the LR line with it), the "do not fit" line or the other-layout line printed on
    every rank."""
    fitting = rng_states(None, None, CPU)
    rngs = [fitting, {"torch": torch.zeros(16, dtype=torch.uint8)} if case == "states-misfit" else fitting]
    layout = [1, 1] if case == "another-layout" else [2, 0]
    saved = _checkpoint(_built(), rngs, layout=layout, config={"seed": 5 if case == "another-seed" else 1,
                                                               "ppo": {"learning_rate": 1e-3}})
    before = torch.get_rng_state()
    try:
        for rank in (1, 0):
            restore(saved, "c.pt", _built(), None, SimpleNamespace(rank=rank, num_learners=2, num_rollouts=0), CPU,
                    _run(ppo__learning_rate=2e-3))
            out = capsys.readouterr().out
            if rank == 1:
                assert out == ""
    finally:
        torch.set_rng_state(before)
    assert "[syncppo] resumed c.pt at iteration 2\n" in out and "LR" in out, out


# ---- dist/comm.py ----------------------------------------------------------------------------------------------

def test_set_device_is_where_collective_tensors_go():
    """dist.setup sets cuda:LOCAL_RANK under NCCL: a setter that changed nothing would leave every staged tensor on
    the host, which NCCL refuses (a torch.device needs no GPU to be named)."""
    try:
        comm.set_device(torch.device("cuda", 1))
        assert comm.device() == torch.device("cuda", 1)
        comm.set_device("cpu")
        assert comm.device() == torch.device("cpu")
    finally:
        comm.set_device(torch.device("cpu"))
