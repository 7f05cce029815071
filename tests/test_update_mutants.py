"""ppo/update.py: mutants the other update tests let survive (hand-picked mutation testing of ppo/update.py and
ppo/storage.py). Expected values are worked out by hand."""

import math

import pytest
import torch

from dist.grad_sync import GradSync
from ppo.minibatch_step import STEP_MEANS, build_optimizer
from ppo.storage import RolloutStorage
from ppo.update import ppo_update, update_plan_rows
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg

CPU = torch.device("cpu")


def test_an_update_whose_every_step_was_skipped_reports_no_means_but_nan():
    """Non-finite returns poison every minibatch's gradient, so the host path skips all 6 steps: the means over the
    steps taken (each loss term, the KL, the gradient norm) have no step to average and are NaN, not 0.
    Mutant: `v / max(num_steps, 1)` in ppo_update (a mean of no steps reported as 0)."""
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, CPU)
    fill(storage, 0, model)
    storage.returns.fill_(float("nan"))
    cfg = ppo_cfg(capture_step=False)
    optimizer = build_optimizer(model.parameters(), cfg, CPU)
    stats = ppo_update(model, optimizer, storage, GradSync(model.parameters(), num_extras=2), cfg,
                       generator=torch.Generator().manual_seed(0))
    assert stats["skipped_steps"] == 6.0
    assert [k for k in STEP_MEANS if not math.isnan(stats[k])] == []


@pytest.mark.parametrize("norm", ["global", "local", "minibatch", "none"])
def test_the_update_plan_has_one_gradient_round_per_step_and_advantage_sums_only_when_global(norm):
    """3 epochs x 2 minibatches: the gradient row has 6 rounds per iteration; the advantages' all-reduces (16 bytes
    of (n, sum), then 8 of the squared deviations) are planned for "global" alone, the only mode that makes them.
    Mutant: `cfg.advantage_norm != "global"` in update_plan_rows; the gradient rounds of one epoch only."""
    model = make_model()
    cfg = ppo_cfg(advantage_norm=norm)
    rows = update_plan_rows(model, GradSync(model.parameters(), num_extras=2), cfg)
    assert [r.rounds for r in rows if r.purpose == "gradients"] == [6]
    advantages = [(r.collective, r.call_bytes) for r in rows if r.purpose == "advantages"]
    assert advantages == ([("all_reduce", [16, 8])] if norm == "global" else [])
