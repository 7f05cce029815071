"""The sync plan (dist/plan.py) that train.py's --dry-run prints and its ledger is checked against: the rows'
cadences, a row that never runs, and the table's layout by hand."""

import train
from tests.test_train import small_tracking


def test_the_plan_sums_sampler_counts_at_their_own_cadence_and_before_each_save(tmp_path):
    """--dist.sampler-sync-every 3 and --log.save-every 5 (which the other tests set equal): the plan's sampler rows
    run every 3 iterations and at each save, every 5, as train.py's loop calls sum_counts."""
    cfg = small_tracking(tmp_path)
    cfg.dist.sampler_sync_every, cfg.log.save_every, cfg.dry_run = 3, 5, True
    _, _, plan = train.main(cfg)
    assert {r.rule: (r.cadence, r.every) for r in plan if r.purpose == "sampler"} == \
        {"sum of counts": ("every", 3), "sum of counts before save": ("checkpoint", 5)}
