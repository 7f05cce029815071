"""ppo/update.py: mutants the other update tests let survive (hand-picked mutation testing of ppo/update.py and
ppo/storage.py). Expected values are worked out by hand."""

import pytest

from dist.grad_sync import GradSync
from ppo.update import update_plan_rows
from tests.ppo_fixtures import make_model, ppo_cfg


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
