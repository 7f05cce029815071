"""Gaps a mutation audit of bench/ found: formulas behind the numbers docs/benchmarks.md and docs/weight_sync.md
quote (information limit, medians of per-round ratios, GFLOP counts, warm-up rounds left out, table columns) that
no test checked. Every expected number here is worked out by hand or with math/numpy from the inputs, never read
back from the bench. No ranks start: timers, syncers and process groups are replaced by stand-ins."""

import math
import os
import sys
import types

import numpy as np
import pytest
import torch

from tests.test_bench_flags import (Launched, bench_grad_sync, bench_sync, checkpoint,  # noqa: F401 (fixtures)
                                    launched_args, usage_error)
from tests.test_tools import load_bench


def limit_by_hand(before: dict, after: dict) -> float:
    """k changed values in the tensor's dtype plus log2(C(n, k)) bits for their positions, per tensor, in bytes."""
    total = 0.0
    for key, old in before.items():
        ints = torch.int16 if old.dtype == torch.bfloat16 else torch.int32
        n, k = old.numel(), int((old.view(ints) != after[key].view(ints)).sum())
        total += k * (2 if old.dtype == torch.bfloat16 else 4) + math.log2(math.comb(n, k)) / 8
    return total


# ---- bench/bench_sync.py ------------------------------------------------------------------------------

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
    # 0.5 (the ratio of the medians would be 1.5 / 2 = 0.75; naive over mode 2), min 0.375, max 3.
    bs = load_bench("bench_sync")
    monkeypatch.setitem(bs.SIZES, "tiny", (10, 2))            # 2 * (10 * 10 + 10) = 220 elements
    calls, naive, mode = [], iter([1.0, 2.0, 4.0] * 2), iter([3.0, 1.0, 1.5] * 2)

    def fake_timed(fn, prepare=None):
        calls.append("naive" if prepare is None else "mode")
        if prepare is None:
            return next(naive)
        prepare()
        fn()
        return next(mode)
    monkeypatch.setattr(bs, "timed", fake_timed)
    syncers = iter([FakeSyncer([0, 0, 0]), FakeSyncer([10, 20, 60])])
    monkeypatch.setattr(bs, "make_weight_syncer", lambda cfg, src, dst: next(syncers))
    rows = bs.bench_time(0, "tiny", [0.5], 3)
    assert calls == ["naive", "mode"] * 6                      # interleaved, pair by pair
    patch = rows[1]
    assert (patch["mode"], patch["naive"], patch["seconds"]) == ("patch", 2.0, 1.5)
    assert (patch["ratio"], patch["low"], patch["high"]) == (0.5, 0.375, 3.0)
    assert patch["density"] == pytest.approx((10 + 20 + 60) / 3 / 220)     # mean changed per sync over all


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


# ---- bench/bench_train.py -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bench_train():
    return load_bench("bench_train")


def test_bench_train_table_gflop_limit_and_ratios_by_hand(bench_train, capsys):
    # Shapes (1000, 1000, 1000) and (10, 20, 30): 2 * m * k * n = 2e9 + 12e3 FLOPs per minibatch step, x 2 epochs
    # x 3 minibatches. 1 warm-up round (the 9s) left out, 2 rounds kept: medians of an even count are means. The
    # limit is the least-loaded round's (0.25 s).
    from configs import preset
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_epochs, cfg.ppo.num_mini_batches = 64, 8, 2, 3
    shapes = [(1000, 1000, 1000), (10, 20, 30)]
    flops = 2 * 3 * (2 * 1000**3 + 2 * 10 * 20 * 30)
    sp, rl = [(0.5, 1.0), (1.0, 1.5)], [(1.0, 2.0, 0.5), (2.0, 2.5, 1.0)]
    rows = {"syncppo": [(9.0, 9.0)] + sp, "rsl-rl": [(9.0, 9.0, 9.0)] + rl, "limit": [0.5, 0.25, 0.75]}
    bench_train.report("large", cfg, rows, 1, shapes, torch.device("cpu"))
    out = capsys.readouterr().out
    assert "2 interleaved rounds after 1 warm-up" in out
    assert f"update GEMMs {flops / 1e9:.1f} GFLOP, matmul limit {flops / 0.25 / 1e9:.0f} GFLOP/s" in out
    for label, mine in (("syncppo", sp), ("rsl-rl 5.5.1", rl)):
        update = np.median([m[1] for m in mine])
        cells = [f"{np.median([512 / (m[0] + m[1]) for m in mine]):,.0f}", f"{np.median([m[0] for m in mine]):.3f}",
                 f"{update:.3f}", f"{np.median([flops / m[1] for m in mine]) / 1e9:.1f}", f"{100 * 0.25 / update:.0f}%",
                 f"{np.median([(r[0] + r[1]) / (m[0] + m[1]) for m, r in zip(mine, rl)]):.2f}x",
                 f"{np.median([m[1] / r[1] for m, r in zip(mine, rl)]):.2f}x"]
        assert f"| {label} | " + " | ".join(cells) + " |" in out, out
    # by hand, for syncppo: 512 / 1.5 and 512 / 2.5 -> 273; 12 / 1.0 and 12 / 1.5 GFLOP -> 10.0; 0.25 / 1.25 -> 20%
    assert "| syncppo | 273 | 0.750 | 1.250 | 10.0 | 20% | 1.90x | 0.55x |" in out
    # RSL-RL's own split: update = learn + compute_returns = 2.5, 3.5 -> 3.000; syncppo 1.0 / 2.5, 1.5 / 3.5 -> 0.41x
    bench_train.report_notes(rows, 1)
    assert "RSL-RL update 3.000 s/it, syncppo's update 0.41x of it" in capsys.readouterr().out


def test_bench_train_limit_row_is_one_update_of_gemms(bench_train, monkeypatch, tmp_path):
    # one update runs epochs x minibatches steps: the limit of an iteration is that many passes over the shapes
    from configs import preset

    class Runner:
        logger = type("Logger", (), {"log": staticmethod(lambda **kw: None)})()
        alg = type("PPO", (), {"compute_returns": staticmethod(lambda obs: None)})()

        def learn(self, iterations):
            for _ in range(iterations):
                self.alg.compute_returns(None)
                self.logger.log(collect_time=1.0, learn_time=2.0)

    monkeypatch.setattr(bench_train, "rsl_rl_runner", lambda cfg, log_dir, device: Runner())
    monkeypatch.setattr(bench_train, "matmul_limit_seconds", lambda shapes, device: 0.125)
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 16, 8, 2
    cfg.ppo.num_epochs, cfg.ppo.num_mini_batches = 3, 2
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16,)
    rows = bench_train.run_interleaved(cfg, str(tmp_path), [(1, 1, 1)], torch.device("cpu"))
    assert rows["limit"] == [3 * 2 * 0.125] * 2


def test_bench_train_cpu_matmul_limit_sums_each_shape_s_best_of_3(bench_train, monkeypatch):
    # shape 1: warm-up call 9 s, then 3, 1, 2 -> best 1; shape 2: warm-up 9, then 0.5, 0.25, 4 -> best 0.25
    from tests.test_bench_train import FakeDevice
    fake = FakeDevice()
    monkeypatch.setattr(bench_train, "time", fake)
    durations = iter([9.0, 3.0, 1.0, 2.0, 9.0, 0.5, 0.25, 4.0])
    monkeypatch.setattr(torch, "mm", lambda a, b: fake.work(next(durations)))
    assert bench_train.matmul_limit_seconds([(2, 3, 4), (5, 6, 7)], torch.device("cpu")) == pytest.approx(1.25)


def test_bench_train_main_times_the_minibatch_gemms_and_leaves_out_the_warm_up(bench_train, monkeypatch):
    # the GEMMs' M is the minibatch: num_envs x num_steps / num_mini_batches; report gets the setting's warm-up
    from configs import preset
    ppo = preset("tracking").ppo
    monkeypatch.setitem(sys.modules, "rsl_rl", types.ModuleType("rsl_rl"))
    got = {}
    monkeypatch.setattr(bench_train, "run_interleaved", lambda cfg, tmp, shapes, device: got.setdefault("s", shapes))
    monkeypatch.setattr(bench_train, "report", lambda name, cfg, rows, warmup, *a: got.setdefault("w", warmup))
    monkeypatch.setattr(bench_train, "report_notes", lambda rows, warmup: None)
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--quick", "--settings", "large", "--num-envs", "64"])
    bench_train.main()
    assert got["s"][0][0] == 64 * ppo.num_steps // ppo.num_mini_batches
    assert got["w"] == 1                    # --quick large: 3 iterations, the first left out


def test_bench_train_two_rank_rate_leaves_out_the_warm_up(bench_train, monkeypatch, tmp_path):
    # total_fps 100, 1 (warm-up), then 10, 20, 30, 40: median of the last four = 25
    from torch.utils.tensorboard import SummaryWriter

    def fake_torchrun(command, **kwargs):
        writer = SummaryWriter(os.path.join(str(tmp_path), "two-ranks", "run"))
        for step, value in enumerate([100.0, 1.0, 10.0, 20.0, 30.0, 40.0], start=1):
            writer.add_scalar("Perf/total_fps", value, step)
        writer.close()
        return 0
    monkeypatch.setattr(bench_train, "run_child", fake_torchrun)
    assert bench_train.two_rank_rate("tracking", 16, 6, 2, str(tmp_path)) == 25.0


# ---- bench/bench_grad_sync.py -------------------------------------------------------------------------

def test_bench_grad_sync_table_columns_by_hand(capsys):
    gs = load_bench("bench_grad_sync")
    mb = gs.MB
    rows = [dict(model="m", variant="fwd+bwd", buckets=0, step=10.0, bwd=4.0, allreduce=2.0, grad_comm=2 * mb,
                 peak=3 * mb),
            dict(model="m", variant="flat", buckets=1, step=12.0, bwd=6.0, allreduce=2.0, grad_comm=4 * mb,
                 peak=6 * mb),
            dict(model="m", variant="DDP", buckets=3, step=15.0, bwd=5.0, allreduce=2.0, grad_comm=8 * mb,
                 peak=4 * mb)]
    gs.print_table(rows)
    out = capsys.readouterr().out.splitlines()
    # flat: 12 / 15 = 0.80 of DDP; overhead 12 - 10; (bwd+sync)/bwd 6 / 4; grad+comm 4 / 8; peak 6 / 4
    assert "| m | flat | 1 | 12.0 | 0.80 | 2.0 | 2.0 | 1.50 | 4.0 | 0.50 | 6.0 | 1.50 |" in out
    assert "| m | fwd+bwd | - | 10.0 | 0.67 | - | 2.0 | - | 2.0 | 0.25 | 3.0 | 0.75 |" in out


@pytest.mark.parametrize("a, b, reduce", [
    ([100.0, 4.0, 1.0, 5.0], [100.0, 2.0, 3.0, 7.0], [100.0, 0.004, 0.001, 0.005]),
    # 4 timed rounds: the median of an even count is the mean of the two middle rounds (torch.median gave the lower)
    ([100.0, 4.0, 1.0, 5.0, 3.0], [100.0, 2.0, 3.0, 7.0, 9.0], [100.0, 0.004, 0.001, 0.005, 0.003]),
])
def test_bench_grad_sync_medians_of_the_slowest_rank_after_the_warm_up(monkeypatch, a, b, reduce):
    # 1 warm-up round (the 100 s) left out; rank 1 (faked by all_gather) takes twice rank 0's time, so the slowest
    # rank's times are 2x. Backward (+ sync) is a quarter of each step. Expected medians from numpy, in ms.
    gs = load_bench("bench_grad_sync")
    script = {"A": iter(a), "B": iter(b)}

    class FakeVariant:
        def __init__(self, kind, bucket_mb, model, device):
            self.name, self.model = kind, model

        def step(self, x, y, clock):
            s = next(script[self.name])
            return [s, 0.0, s / 4]
    now, reduce_times = [0.0], iter(reduce)
    all_reduce = lambda tensor, op=None: now.__setitem__(0, now[0] + next(reduce_times))  # noqa: E731

    def all_gather(gathered, local):
        gathered[0].copy_(local)
        gathered[1].copy_(local * 2)
    monkeypatch.setattr(gs, "Variant", FakeVariant)
    monkeypatch.setattr(gs, "dist", types.SimpleNamespace(barrier=lambda: None, all_reduce=all_reduce,
                                                          all_gather=all_gather))
    monkeypatch.setattr(gs, "teardown", lambda: None)
    monkeypatch.setattr(gs, "setup", lambda *args: (torch.device("cpu"), lambda: now[0],
                                                    lambda: torch.nn.Linear(3, 2), None, None))
    out = []
    gs.time_model(0, 2, 0, types.SimpleNamespace(warmup=1, iters=len(a) - 1), "m", [("A", 0), ("B", 0)],
                  types.SimpleNamespace(put=out.append))
    (result,), ms = out, {name: 2e3 * np.median(t[1:]) for name, t in (("A", a), ("B", b), ("raw", reduce))}
    assert result["params"] == 3 * 2 + 2
    assert result["allreduce"] == pytest.approx(ms["raw"])
    assert [(r["variant"], r["step"], r["bwd"]) for r in result["rows"]] == [
        (name, pytest.approx(ms[name]), pytest.approx(ms[name] / 4)) for name in ("A", "B")]


def test_bench_grad_sync_zero_warm_up_is_allowed(bench_grad_sync, monkeypatch):
    # --warmup counts untimed steps: 0 is a valid count (the check is >= 0; -1 is refused elsewhere)
    args = launched_args(bench_grad_sync.main, monkeypatch, ["bench_grad_sync.py", "--quick", "--warmup", "0"])
    assert args.warmup == 0


def test_bench_grad_sync_header_gives_fp32_gradient_megabytes(monkeypatch, capsys):
    # 1,048,576 parameters of 4 bytes: 4.0 MB of fp32 gradients
    gs = load_bench("bench_grad_sync")

    def launch(args, target, *rest):
        if target is gs.time_model:
            names = ["fwd+bwd", "flat", "bucketed 4MB", "DDP"]
            return dict(params=2**20, allreduce=1.0, rows=[dict(model="0.3M", variant=n, step=1.0, bwd=1.0)
                                                          for n in names])
        return dict(grad_comm=1.0, peak=1.0, buckets=1, source="VmHWM")
    monkeypatch.setattr(gs, "launch", launch)
    monkeypatch.setattr(sys, "argv", ["bench_grad_sync.py", "--models", "0.3M", "--bucket-mb", "4"])
    gs.main()
    assert "models: 0.3M = 1,048,576 params (4.0 MB of fp32 grads)" in capsys.readouterr().out


# ---- bench/bench_rollout.py ---------------------------------------------------------------------------

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


# ---- bench/bench_mujoco.py ----------------------------------------------------------------------------

def test_bench_mujoco_table_spread_verdict_and_columns_by_hand():
    bm = load_bench("bench_mujoco")

    def result(task, ranks, seed, episodes, wall):
        return {"task": task, "ranks": ranks, "steps": 4096, "seed": seed, "last_episodes_return": episodes,
                "last_iterations_return": 0.0, "wall_s": wall, "versions": {"torch": "x"}}
    # Hopper 1000, 2000: mean 1500, population std 500; (2382.86 - 1500) / 271.74 = 3.2 std below CleanRL.
    # Walker2d 2000, 2100: mean 2050 >= 2287.95 - 571.78: within. Walls 60 s and 180 s: 2.0 min on average.
    # HalfCheetah, one seed: no std to judge by, no verdict.
    lines = bm.table([result("Hopper-v4", 2, 1, 1000.0, 60.0), result("Hopper-v4", 2, 2, 2000.0, 180.0),
                      result("Walker2d-v4", 1, 1, 2000.0, 60.0), result("Walker2d-v4", 1, 2, 2100.0, 60.0),
                      result("HalfCheetah-v4", 1, 1, 0.0, 60.0)], 100, 10).splitlines()
    assert lines[2].split(" | ")[7] == "-"
    assert lines[3] == ("| Hopper-v4 | 2 x 1024 | 4,096 | 1, 2 | 1500.00 ± 500.00 | 0.00 ± 0.00 | "
                        "2382.86 ± 271.74 | no (3.2 std below) | 2.0 min |")
    assert lines[4].split(" | ")[7] == "yes"
    command = bm.train_command("Hopper-v4", 2, 1, 5, "r")
    assert command[command.index("--ppo.num-steps") + 1] == "1024"            # 2048 / 2 ranks


@pytest.mark.parametrize("flags, error", [
    (["--ranks", "3"], "--ranks 3: must divide the 2048 steps per iteration"),
    (["--total-steps", "4096"], "--total-steps must cover --last-iterations x 2048 steps"),    # 2 < 10 iterations
])
def test_bench_mujoco_flags_that_cannot_give_the_table_are_refused(monkeypatch, capsys, tmp_path, flags, error):
    bm = load_bench("bench_mujoco")
    monkeypatch.setattr(bm, "run", lambda *a: (_ for _ in ()).throw(Launched(a)))
    line = usage_error(bm.main, monkeypatch, capsys, ["bench_mujoco.py", "--root", str(tmp_path), *flags])
    assert line == f"bench_mujoco.py: error: {error}"


# ---- bench/fault_drills.py ----------------------------------------------------------------------------

def test_fault_drills_last_checkpoint_is_the_highest_iteration(tmp_path):
    fd, run = load_bench("fault_drills"), tmp_path / "cartpole" / "run"
    run.mkdir(parents=True)
    for name in ("model_5.pt", "model_10.pt", "model_40.pt", "model_40.pt.tmp-1"):
        (run / name).write_bytes(b"")
    assert fd.kept(str(tmp_path)) == "1 run dir, 3 checkpoints (last model_40.pt), 1 temporaries"
