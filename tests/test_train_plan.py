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
