"""bench/bench_sync.py's numbers and the checkpoints it replays: the information limit, the time rows (medians of
per-pair ratios) and bytes rows (wire bytes against the limit), each table column in its place, and the checks on
--checkpoints (count, order, iteration, model). Every expected number is worked out by hand or with math from the
inputs, never read back from the bench. No ranks start: timers, syncers and process groups are replaced by stand-ins."""

import math
import types

import pytest
import torch

from tests.test_bench_flags import bench_sync, checkpoint, usage_error  # noqa: F401 (fixtures)
from tests.test_tools import load_bench


def limit_by_hand(before: dict, after: dict) -> float:
    """k changed values in the tensor's dtype plus log2(C(n, k)) bits for their positions, per tensor, in bytes."""
    total = 0.0
    for key, old in before.items():
        ints = torch.int16 if old.dtype == torch.bfloat16 else torch.int32
        n, k = old.numel(), int((old.view(ints) != after[key].view(ints)).sum())
        total += k * (2 if old.dtype == torch.bfloat16 else 4) + math.log2(math.comb(n, k)) / 8
    return total


def test_bench_sync_information_limit_by_hand():
    # fp32: 3 of 40 elements changed: 3 * 4 bytes + log2(C(40, 3)) / 8; bf16: 5 of 24: 5 * 2 + log2(C(24, 5)) / 8;
    # an unchanged tensor costs nothing (C(n, 0) = 1).
    bs = load_bench("bench_sync")
    before = {"w": torch.arange(40, dtype=torch.float32), "b": torch.ones(24, dtype=torch.bfloat16),
              "z": torch.zeros(7)}
    after = {k: v.clone() for k, v in before.items()}
    after["w"][[0, 17, 39]] += 0.5
    after["b"][[1, 2, 3, 10, 23]] = 3.0
    expected = 3 * 4 + math.log2(math.comb(40, 3)) / 8 + 5 * 2 + math.log2(math.comb(24, 5)) / 8
    assert bs.information_limit(before, after) == pytest.approx(expected, rel=1e-9)


def test_bench_sync_perturb_at_density_one_changes_every_element():
    # density 1 perturbs every element, not int(n) random positions (with repeats: about 63% of them)
    bs = load_bench("bench_sync")
    state = bs.mlp_state(10, 2)
    before = {k: v.clone() for k, v in state.items()}
    bs.perturb(state, 1.0, torch.Generator().manual_seed(0))
    assert all(bool((state[k] != before[k]).all()) for k in state)


class FakeSyncer:
    """sync() answers scripted stats and keeps a copy of what it was given; apply/init do nothing."""

    def __init__(self, changed, wire=1000):
        self.changed, self.wire, self.seen = iter(changed), wire, []

    def init_sender(self, state):
        self.seen.append({k: v.clone() for k, v in state.items()})

    def sync(self, state, version):
        self.seen.append({k: v.clone() for k, v in state.items()})
        return types.SimpleNamespace(changed_elements=next(self.changed), wire_bytes=self.wire)


def test_bench_sync_time_rows_are_medians_of_per_pair_ratios(monkeypatch):
    # 3 pairs per row, naive then mode: naive 1, 2, 4 s; mode 3, 1, 1.5 s. Per-pair ratios 3, 0.5, 0.375: median
    # 0.5 (the ratio of the medians would be 1.5 / 2 = 0.75; naive over mode 2), min 0.375, max 3. Each row's
    # warm-up pair (naive 1 s, mode 1 s, first) is discarded.
    bs = load_bench("bench_sync")
    monkeypatch.setitem(bs.SIZES, "tiny", (10, 2))            # 2 * (10 * 10 + 10) = 220 elements
    calls, naive, mode = [], iter([1.0, 1.0, 2.0, 4.0] * 2), iter([1.0, 3.0, 1.0, 1.5] * 2)

    def fake_timed(fn, prepare=None):
        calls.append("naive" if prepare is None else "mode")
        if prepare is None:
            return next(naive)
        prepare()
        fn()
        return next(mode)
    monkeypatch.setattr(bs, "timed", fake_timed)
    syncers = iter([FakeSyncer([0, 0, 0, 0]), FakeSyncer([0, 10, 20, 60])])
    monkeypatch.setattr(bs, "make_weight_syncer", lambda cfg, src, dst: next(syncers))
    rows = bs.bench_time(0, "tiny", [0.5], 3)
    assert calls == ["naive", "mode"] * 8                      # interleaved, pair by pair, a warm-up pair per row
    patch = rows[1]
    assert (patch["mode"], patch["naive"], patch["seconds"]) == ("patch", 2.0, 1.5)
    assert (patch["ratio"], patch["low"], patch["high"]) == (0.5, 0.375, 3.0)
    assert patch["density"] == pytest.approx((10 + 20 + 60) / 3 / 220)     # mean changed per sync over all


def test_bench_sync_time_rows_discard_a_warm_up_pair_each(monkeypatch):
    """Each row runs repeats + 1 pairs, naive then mode, and discards the first: its times (naive 100 s, mode
    0.001 s, as a first use's page faults would be) and its changed count (1000) reach no column. Kept pairs: naive
    2 s, mode 1 s (ratio 0.5), changed 22 of 220 elements each, at repeats 1 and 2.

    Mutant: no warm-up pair in bench_time -> 2 (repeats 1) or 4 timed calls per row, not 4 or 6.
    Mutant: the warm-up pair kept as the first of range(repeats + 1) pairs -> at repeats 1, naive 51 s, low 1e-05.
    Mutant: no changed.clear() after the warm-up pair -> patch's density counts its 1000 changed elements."""
    bs = load_bench("bench_sync")
    monkeypatch.setitem(bs.SIZES, "tiny", (10, 2))            # 2 * (10 * 10 + 10) = 220 elements
    for repeats in (1, 2):
        calls = []

        def fake_timed(fn, prepare=None):
            first = len(calls) % (2 * (repeats + 1)) < 2       # the row's first pair
            calls.append("naive" if prepare is None else "mode")
            if prepare is not None:
                prepare()
                fn()
            return (100.0 if first else 2.0) if prepare is None else (0.001 if first else 1.0)
        monkeypatch.setattr(bs, "timed", fake_timed)
        syncers = iter([FakeSyncer([0] * (repeats + 1)), FakeSyncer([1000] + [22] * repeats)])
        monkeypatch.setattr(bs, "make_weight_syncer", lambda cfg, src, dst: next(syncers))
        rows = bs.bench_time(0, "tiny", [0.5], repeats)
        assert calls == ["naive", "mode"] * 2 * (repeats + 1)
        for row in rows:
            assert (row["naive"], row["seconds"], row["ratio"], row["low"], row["high"]) == (2.0, 1.0, 0.5, 0.5, 0.5)
        assert rows[1]["density"] == pytest.approx(22 / 220)


def test_bench_sync_bytes_rows_against_the_limit(monkeypatch):
    # wire bytes / information limit, with the limit of the receiver's dtype, and density = changed / all elements
    bs = load_bench("bench_sync")
    monkeypatch.setitem(bs.SIZES, "tiny", (6, 2))             # 2 * (36 + 6) = 84 elements
    made = []

    def make(cfg, src, dst):
        made.append(FakeSyncer([21, 42], wire=500))
        return made[-1]
    monkeypatch.setattr(bs, "make_weight_syncer", make)
    rows = bs.bench_bytes(0, "tiny", [0.1, 0.5])
    assert [(r["receiver"], r["nominal"]) for r in rows] == [("float32", 0.1), ("float32", 0.5),
                                                             ("bfloat16", 0.1), ("bfloat16", 0.5)]
    for i, row in enumerate(rows):
        seen = made[i // 2].seen
        dtype = torch.float32 if row["receiver"] == "float32" else torch.bfloat16
        cast = [{k: v.to(dtype) for k, v in s.items()} for s in seen]
        limit = limit_by_hand(cast[i % 2], cast[i % 2 + 1])
        assert row["limit"] == pytest.approx(limit, rel=1e-9)
        assert row["ratio"] == pytest.approx(500 / limit, rel=1e-9)
        assert row["density"] == pytest.approx((21, 42)[i % 2] / 84)


def test_bench_sync_tables_print_each_column_in_its_place(bench_sync, capsys):
    args = types.SimpleNamespace(size="1M", repeats=3, quick=False, ppo=False)
    time_row = dict(model="1M", mode="patch", density=0.25, naive=2.0, seconds=1.5, ratio=0.5, low=0.375, high=3.0)
    bytes_row = dict(model="1M", receiver="bfloat16", nominal=0.01, density=0.00512, wire=12345, limit=6789.4,
                     ratio=1.818)
    bench_sync.print_tables({"time": [time_row], "bytes": [bytes_row]}, args)
    out = capsys.readouterr().out.splitlines()
    assert "| patch | 25.00% | 2.000 | 1.500 | 0.50 | 0.38-3.00 |" in out
    assert "| bfloat16 | 1.00% | 0.512% | 12,345 | 6,789 | 1.818 |" in out


def test_bench_sync_bytes_table_leaves_out_density_one(monkeypatch):
    # the bytes table is of partial patches: density 1 (everything changed) is the time table's only
    bs = load_bench("bench_sync")
    seen = {}
    monkeypatch.setenv("MASTER_ADDR", "x")      # worker sets these: put back after the test
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(bs, "rank_signals", lambda: None)   # a rank's: pytest is no bench's multiprocessing child
    monkeypatch.setattr(bs, "dist", types.SimpleNamespace(init_process_group=lambda *a, **k: None,
                                                          barrier=lambda: None, destroy_process_group=lambda: None))
    monkeypatch.setattr(bs, "bench_time", lambda rank, size, densities, *a: seen.setdefault("t", densities))
    monkeypatch.setattr(bs, "bench_bytes", lambda rank, size, densities: seen.setdefault("b", densities))
    queue = types.SimpleNamespace(put=lambda tables: None)
    args = types.SimpleNamespace(size="1M", densities=[0.001, 0.3, 1.0], repeats=1, device="cpu", checkpoints=None)
    bs.worker(0, 1, args, queue)
    assert seen == {"t": [0.001, 0.3, 1.0], "b": [0.001, 0.3]}


def test_bench_sync_one_checkpoint_is_a_usage_error(bench_sync, monkeypatch, capsys, tmp_path):
    one = checkpoint(tmp_path / "model_1.pt")
    line = usage_error(bench_sync.main, monkeypatch, capsys, ["bench_sync.py", "--checkpoints", one])
    assert line == "bench_sync.py: error: --checkpoints needs at least two consecutive checkpoints"


def test_bench_sync_checkpoint_out_of_order_names_the_one_before_and_its_iteration(tmp_path):
    """Iterations 1, 3, 2: the third is refused, naming the second file (not the first) and its iteration 3.

    Mutant: the message names paths[0]; it gives the refused file's iteration for the one before."""
    bs = load_bench("bench_sync")
    paths = [checkpoint(tmp_path / f"model_{i}.pt", seed=i) for i in (1, 3, 2)]
    with pytest.raises(ValueError) as error:
        bs.checkpoint_models(paths)
    assert str(error.value) == (f"--checkpoints {paths[2]!r} is of iteration 2, not after {paths[1]!r}'s 3: pass "
                                f"consecutive checkpoints of one run, in order")


@pytest.mark.parametrize("with_iteration", [(False, True), (True, False)])
def test_bench_sync_checkpoints_without_an_iteration_are_not_ordered(tmp_path, with_iteration):
    """A checkpoint with no 'iteration' entry (read_checkpoint does not require one) has no order to check, on
    either side of one that has.

    Mutant: either isinstance(..., int) guard dropped (None compared with an int: TypeError)."""
    bs = load_bench("bench_sync")
    paths = []
    for i, keep in enumerate(with_iteration, start=1):
        state = torch.load(checkpoint(tmp_path / f"model_{i}.pt", seed=i), weights_only=False)
        if not keep:
            del state["iteration"]
        torch.save(state, tmp_path / f"model_{i}.pt")
        paths.append(str(tmp_path / f"model_{i}.pt"))
    assert len(bs.checkpoint_models(paths)) == 2


@pytest.mark.parametrize("state", [{"model": {}}, {"model": {"w": 1.0}}, [1.0, 2.0]])
def test_bench_sync_checkpoint_whose_model_is_empty_or_not_tensors_is_refused(tmp_path, state):
    """An empty 'model' dict, one holding a float, or a torch file of a list is not a state_dict to sync.

    Mutant: `not model` dropped; the all-tensors check dropped; the isinstance(state, dict) guard dropped."""
    bs = load_bench("bench_sync")
    good, bad = checkpoint(tmp_path / "model_1.pt"), str(tmp_path / "model_2.pt")
    torch.save(state, bad)
    with pytest.raises(ValueError) as error:
        bs.checkpoint_models([good, bad])
    assert str(error.value) == f"--checkpoints {bad!r} is not a train.py checkpoint (no 'model' state_dict entry)"


def test_bench_sync_empty_bytes_table_says_why_even_when_the_time_table_has_rows(bench_sync, capsys):
    """`--densities 1`: the time table has its density-1 rows, the bytes table none; and a bytes table with rows
    has no such note.

    Mutant: the note keyed on the time table's rows."""
    args = types.SimpleNamespace(size="1M", repeats=1, quick=False, ppo=False)
    time_row = dict(model="1M", mode="patch", density=1.0, naive=2.0, seconds=1.5, ratio=0.5, low=0.5, high=0.5)
    bench_sync.print_tables({"time": [time_row], "bytes": []}, args)
    assert ("1M fp32 parameters: none, as --densities has none below 1 (a whole tensor has no positions to encode)"
            in capsys.readouterr().out)
    bytes_row = dict(model="1M", receiver="float32", nominal=0.5, density=0.5, wire=1, limit=1.0, ratio=1.0)
    bench_sync.print_tables({"time": [], "bytes": [bytes_row]}, args)
    assert ("Bytes: patch wire bytes (headers, tables, trailers included) against the information limit, 1M fp32 "
            "parameters") in capsys.readouterr().out.splitlines()
