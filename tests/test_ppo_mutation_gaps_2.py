"""Gaps a hand mutation audit of ppo/rollout.py, ppo/update.py and ppo/restore.py found: each test here fails on a
plausible change of that code which every other test let through. Expectations are written by hand from the docs.

135 hand-made mutants (49 of rollout.py, 37 of update.py, 49 of restore.py), each run alone against the fast tests
of the 10 to 15 files that exercise its module, each survivor then against the slow (gloo) tests that reach its
code: 121 killed by them (6 only by slow tests: ended_returns' order and NaN filter and its ledger name, local for
global advantage statistics, update_plan_rows' gradient rows per epoch and its advantage rows for every mode), 5
pinned below, 9 equivalent.

Pinned here: checked_noise_std's error naming --ppo.lr-max as an adaptive run's fix; a resume on another layout
naming the seeds by whether the run has rollout ranks (not by its number of learners); the resume's start-up lines
(resumed, LR, states that do not fit, another layout) printed by rank 0 alone (one test kills three mutants).

Equivalent (no test can tell them apart):
- rollout.keep allocating every field as float32: only dones changes (to 0/1 floats), and both readers convert it
  (fill_storage's `.bool()`, dist/batches.Layout.pack's copy_ into its bool slot);
- check_finite without the `numel()` filter, or without `not extremes`: an empty field never reaches it (validate
  refuses 0 envs and 0 steps, ppo/env_check.py an observation group of width 0): dead code, removed since;
- collect_rollout cloning the values it stores (model.value returns a fresh tensor, and keep copies it);
- update: the adaptive LR set on param_groups[0] only (one group: build_optimizer; also listed by
  tests/test_update_step_rules.py), counting a step before optimizer.step() instead of after;
- restore: `if lr` for `if lr is not None` and `if saved_lr` for `is not None` (an LR of 0 never arrives: validate
  refuses --ppo.learning-rate <= 0, and linear's 0 is at --max-iterations, a finished run train.py stops before
  restoring); `fits` without `same_layout` (the {} of another layout never fits: rng_states always has "torch").
"""

from types import SimpleNamespace

import pytest
import torch

from dist.checkpoint import rng_states
from dist.errors import RunError
from ppo.restore import restore
from ppo.update import checked_noise_std
from tests.ppo_fixtures import make_model
from tests.test_step_restore_rules import CPU, _built, _checkpoint, _run

# ---- ppo/update.py ---------------------------------------------------------------------------------------------


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


# ---- ppo/restore.py --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("learners, rollouts, seeds", [
    (2, 0, "RNG streams restart from --seed + rank; everything else"),
    (1, 2, "RNG streams restart from their seeds (--seed + rank on a learner, --seed + j on rollout rank L + j of L "
           "learners); everything else")])
def test_a_layout_change_names_the_seeds_of_the_layout_it_resumes_on(capsys, learners, rollouts, seeds):
    """Resumed on another layout, every RNG stream restarts from its seed, and the line says which: --seed + rank
    when every rank is a learner (however many), and a rollout rank's own seed as well when the run has rollout ranks
    (however few learners). The choice follows the rollout ranks, not the number of learners.
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
