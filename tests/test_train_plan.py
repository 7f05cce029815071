"""The sync plan (dist/plan.py) that train.py's --dry-run prints and its ledger is checked against: the rows'
cadences, a row that never runs, the table's layout by hand, and the tracking preset's bytes per call against
docs/design.md's sync contract table."""

from pathlib import Path

import train
from tests.test_train import small_tracking

REPO = Path(__file__).resolve().parent.parent


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


def design_bytes_column() -> dict[str, str]:
    """docs/design.md's sync contract table: each row's state -> its "bytes per call (tracking preset)" cell."""
    lines = (REPO / "docs" / "design.md").read_text().split("## Sync contract", 1)[1].splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines if line.startswith("| ")]
    assert rows[0][-1] == "bytes per call (tracking preset)", rows[0]
    return {row[0]: row[-1] for row in rows[1:]}


def test_the_tracking_preset_s_plan_has_the_bytes_per_call_docs_design_md_lists(tmp_path):
    """The sizes in docs/design.md's table are the tracking preset's plan (1 rank; the metrics vector at 2 ranks, as
    its formula says), with --ppo.normalize-rewards and --log.episode-returns on for the two rows they add.

    Mutant: metrics_plan_rows without the per-rank slots of the maxima (16 B x keys only)."""
    from configs import preset
    from dist.plan import _size
    from dist.stop import STOP_KEYS
    from envs import make_env
    from ppo.rollout import TRAIN_KEYS
    cfg = preset("tracking")
    cfg.dry_run, cfg.log.root, cfg.ppo.normalize_rewards, cfg.log.episode_returns = True, str(tmp_path), True, True
    model, _, plan = train.main(cfg)
    sizes = {}
    for row in plan:
        sizes.setdefault(row.purpose, []).append(row.call_bytes)
    doc, dim = design_bytes_column(), model.critic_normalizer.mean.numel()
    (shapes,), (params,), (checksum,) = sizes["shapes"], sizes["params"], sizes["checksum"]
    assert doc["parameters"] == f"{_size(*shapes)}; {' + '.join(map(_size, params))}; {_size(*checksum)}"
    assert doc["gradients"] == f"{_size(*sizes['gradients'][0])} (flat)"
    assert doc["advantage normalization"] == " + ".join(map(_size, sizes["advantages"][0]))
    assert sizes["normalizer"] == [[(1 + 2 * dim) * 8], [24]] and dim == 73
    assert doc["observation normalizer(s)"] == f"(1 + 2 x dim) x 8 B = {_size((1 + 2 * dim) * 8)}"
    assert doc["reward normalizer (`--ppo.normalize-rewards`)"] == "24 B"
    assert sizes["sampler"] == [[2 * cfg.env.num_motions * 8]] * 2
    assert doc["sampler counts"] == f"2 x motions x 8 B = {_size(2 * cfg.env.num_motions * 8)}"
    keys = len(TRAIN_KEYS) + len(STOP_KEYS) + len(make_env(cfg.env, "cpu", 1, 1).log_keys)
    assert sizes["metrics"] == [[8], [16 * keys + 2 * 8 * 1]]
    assert doc["metrics, stop flags"] == f"16 B x keys + 2 x 8 B x ranks = {16 * keys + 2 * 8 * 2} B; 8 B"
    T, N = cfg.ppo.num_steps, cfg.env.num_envs
    assert sizes["episode_returns"] == [[T * N * 4]] and T * N * 4 == 48 * 1024
    assert doc["episode returns (`--log.episode-returns`)"] == "T x N x 4 B = 48 KB (off by default)"
    assert doc["RNG"] == _size(*sizes["checkpoint"][0]) and doc["checkpoint"] == _size(*sizes["env_state"][0])
    assert doc["resume"] == ", ".join(_size(*call) for call in sizes["resume"])
