"""bench/bench_rollout.py: the medians, ratios and changed shares behind its tables, each table's columns worked out
by hand (throughput, the overlap columns, weight sync), and --quick refusing the learning part. The train jobs and
replays are replaced by stand-ins: nothing is trained."""

import types

import torch

from tests.test_tools import load_bench


def test_bench_rollout_median_ratio_and_steady():
    br = load_bench("bench_rollout")
    assert br.median_ratio([(2.0, 1.0), (3.0, 1.0), (1.0, 4.0)]) == 2.0        # a / b: 2, 3, 0.25
    series = [(i, 0.0, 10.0 * i) for i in range(1, 7)]
    assert br.steady(series, 1) == [20.0, 30.0, 40.0, 50.0, 60.0]
    assert br.steady(series) == [10.0 * i for i in range(br.WARMUP + 1, 7)]      # the first WARMUP dropped


def test_bench_rollout_changed_share_counts_elements_whose_bits_differ():
    # fp32: 2.0000002 differs from 2.0 in its low bytes only, -3.0 from 3.0 in its sign byte only: both count.
    # In bf16, 2.0000002 rounds to 2.0: unchanged. Totals are elements, not bytes.
    br = load_bench("bench_rollout")
    before, after = {"w": torch.tensor([1.0, 2.0, 3.0])}, {"w": torch.tensor([1.0, 2.0000002, -3.0])}
    assert br.changed_share(before, after, {"w": torch.float32}) == (2, 3)
    assert br.changed_share(before, after, {"w": torch.bfloat16}) == (1, 3)


def test_bench_rollout_iteration_time_starts_after_the_warm_up(monkeypatch, capsys):
    # learner writes at walls 0, 10, 20, 21, 23, 26, 30 (7 iterations): iterations 4..7 took 1, 2, 3, 4 s -> 2.50
    br = load_bench("bench_rollout")
    walls = [0.0, 10.0, 20.0, 21.0, 23.0, 26.0, 30.0]
    series = {tag: [(i + 1, w, 1.0) for i, w in enumerate(walls)]
              for tag in ("Perf/total_fps", "Perf/collection_time", "Perf/learning_time")}
    monkeypatch.setattr(br, "train", lambda *a, **k: "run")
    monkeypatch.setattr(br, "scalars", lambda run_dir: series)
    args = types.SimpleNamespace(envs=["tracking"], iterations={"tracking": 7}, rounds=1)
    br.throughput(args, "root")
    assert "| colocated | 4,915 | 2.50 | 1.00 | 1.00 | 1.00x | - | - |" in capsys.readouterr().out   # 12,288 / 2.5
