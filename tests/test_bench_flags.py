"""The bench scripts' flags: bad values are refused in one line (argparse's exit 2, naming the flag) before any
rank or training run starts, and --quick fills in only what was not typed. Nothing is benchmarked here: the
functions that would start ranks or train.py are replaced by ones that raise."""

import dataclasses
import json
import os
import struct
import sys
import types
import zipfile

import pytest
import torch

from configs.config import PolicyConfig
from ppo.actor_critic import build_actor_critic
from tests.multirank import run_ranks
from tests.test_tools import exit_code, load_bench


class Launched(Exception):
    """Raised where a bench would start its ranks or runs; carries the parsed flags it got."""


def usage_error(main, monkeypatch, capsys, argv: list) -> str:
    """Run main() with argv; it must exit 2 before launching: return argparse's error line."""
    assert exit_code(main, monkeypatch, argv) == 2
    return capsys.readouterr().err.splitlines()[-1]


def launched_args(main, monkeypatch, argv: list):
    """Run main() with argv up to the launch: the flags as the bench would run them."""
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(Launched) as launch:
        main()
    return launch.value.args[0]


# ---- bench/bench_train.py -----------------------------------------------------------------------------

def test_bench_train_warm_up_holds_the_capture_and_leaves_rounds():
    # --capture-step records its graph after CAPTURE_WARMUP_STEPS eager steps, all in the first update: the
    # warm-up iterations left out of the medians must hold it, and at least 2 rounds must remain.
    from configs import preset
    from ppo.minibatch_step import CAPTURE_WARMUP_STEPS
    ppo = preset("tracking").ppo
    for table in load_bench("bench_train").ITERATIONS.values():
        for iterations, warmup in table.values():
            assert warmup * ppo.num_epochs * ppo.num_mini_batches > CAPTURE_WARMUP_STEPS
            assert iterations - warmup >= 2


@pytest.mark.parametrize("flags, iterations", [([], 6), (["--device", "cuda"], 10), (["--quick"], 3),
                                               (["--device", "cuda", "--quick"], 3)])
def test_bench_train_iterations_follow_the_device_and_quick(monkeypatch, flags, iterations):
    bench_train = load_bench("bench_train")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # the flags' checks, not CUDA itself
    monkeypatch.setitem(sys.modules, "rsl_rl", types.ModuleType("rsl_rl"))   # no RSL-RL run: the flags only

    def launch(cfg, tmp, shapes, device):
        raise Launched((cfg.max_iterations, device.type))
    monkeypatch.setattr(bench_train, "run_interleaved", launch)
    device = "cuda" if "cuda" in flags else "cpu"
    assert launched_args(bench_train.main, monkeypatch,
                         ["bench_train.py", "--settings", "large", *flags]) == (iterations, device)


# ---- bench/bench_sync.py ------------------------------------------------------------------------------

@pytest.fixture
def bench_sync(monkeypatch):
    """bench_sync with no way to start its ranks (creating one raises Launched) or to train (--ppo)."""
    module = load_bench("bench_sync")

    class Context:
        def SimpleQueue(self):
            return None

        def Process(self, target, args):
            raise Launched(args[2])

    monkeypatch.setattr(module, "mp", types.SimpleNamespace(get_context=lambda method: Context()))
    monkeypatch.setattr(module, "ppo_checkpoints", lambda *a: (_ for _ in ()).throw(AssertionError("it trained")))
    return module


@pytest.mark.parametrize("flags, error", [
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),          # was StatisticsError in the ranks
    (["--repeats", "-2"], "--repeats must be >= 1, got -2"),
    (["--densities", "nan"], "--densities must be fractions in (0, 1], got nan"),   # was a rank traceback
    (["--densities", "0.1", "2"], "--densities must be fractions in (0, 1], got 2.0"),   # ran, printed 200%
    (["--densities", "-0.5"], "--densities must be fractions in (0, 1], got -0.5"),
    (["--densities", "0"], "--densities must be fractions in (0, 1], got 0.0"),     # changed 1 element per tensor
    (["--quick", "--repeats", "0"], "--repeats must be >= 1, got 0"),              # --quick hid it
])
def test_bench_sync_bad_numbers_are_one_line(bench_sync, monkeypatch, capsys, flags, error):
    line = usage_error(bench_sync.main, monkeypatch, capsys, ["bench_sync.py", *flags])
    assert line == f"bench_sync.py: error: {error}"


@pytest.mark.parametrize("flags, size, densities, repeats", [
    ([], "10M", [0.0001, 0.001, 0.01, 0.1, 0.3, 1.0], 7),
    (["--quick"], "1M", [0.001, 0.3, 1.0], 3),
    (["--quick", "--repeats", "5"], "1M", [0.001, 0.3, 1.0], 5),            # --quick used to make these 3
    (["--quick", "--densities", "0.01"], "1M", [0.01], 3),
    (["--quick", "--size", "10M"], "10M", [0.001, 0.3, 1.0], 3),
])
def test_bench_sync_quick_sets_only_what_was_not_typed(bench_sync, monkeypatch, flags, size, densities, repeats):
    args = launched_args(bench_sync.main, monkeypatch, ["bench_sync.py", *flags])
    assert (args.size, args.densities, args.repeats) == (size, densities, repeats)


def checkpoint(path, hidden=(8, 8), seed=0) -> str:
    """A train.py-like checkpoint: the actor-critic state_dict under 'model' (hidden sizes stand for a preset)."""
    torch.manual_seed(seed)
    cfg = PolicyConfig(actor_hidden=hidden, critic_hidden=hidden)
    model = build_actor_critic(cfg, {"policy": 5, "critic": 6}, 3)
    torch.save({"model": model.state_dict(), "config": {"policy": dataclasses.asdict(cfg)}, "iteration": seed}, path)
    return str(path)


@pytest.mark.parametrize("damage, reason", [
    ("missing", "does not exist"),                                   # was FileNotFoundError in the ranks
    ("directory", "is not a regular file"),
    ("garbage", "is not a torch checkpoint"),                        # was EOFError / UnpicklingError
    ("truncated", "is a truncated or damaged checkpoint"),
    ("no model", "is not a train.py checkpoint (no 'model' state_dict entry)"),
    ("flipped", "does not match its CRC-32"),                        # was timed as a change of the weights
    ("nan", "has nan in its model["),
    ("not after", "is of iteration 0, not after"),                   # the same iteration twice: no change at all
    ("other preset", "its model differs from"),                      # was 'weight sync: shape or dtype changed'
])
def test_bench_sync_bad_checkpoints_are_refused_before_the_ranks(bench_sync, monkeypatch, capsys, tmp_path,
                                                                 damage, reason):
    good = checkpoint(tmp_path / "model_1.pt")
    bad = tmp_path / "model_2.pt"
    if damage == "directory":
        bad.mkdir()
    elif damage == "garbage":
        bad.write_bytes(b"not a checkpoint\n" * 10)
    elif damage == "truncated":
        data = open(checkpoint(bad), "rb").read()
        bad.write_bytes(data[:len(data) // 2])
    elif damage == "no model":
        torch.save({"weights": torch.zeros(3)}, bad)
    elif damage == "other preset":
        checkpoint(bad, hidden=(16, 8))
    elif damage == "flipped":
        data = bytearray(open(checkpoint(bad, seed=2), "rb").read())
        with zipfile.ZipFile(bad) as archive:          # the largest member: a weight tensor's bytes
            member = max((info for info in archive.infolist() if info.filename.split("/data/")[-1].isdigit()),
                         key=lambda info: info.file_size)
        at = member.header_offset          # local header: 30 bytes, then the name and the extra field
        start = at + 30 + sum(struct.unpack_from("<HH", data, at + 26))
        data[start + member.file_size // 2] ^= 1
        bad.write_bytes(bytes(data))
    elif damage == "nan":
        state = torch.load(checkpoint(bad, seed=2))
        next(iter(state["model"].values()))[0] = float("nan")
        torch.save(state, bad)
    elif damage == "not after":
        checkpoint(bad)
    line = usage_error(bench_sync.main, monkeypatch, capsys, ["bench_sync.py", "--checkpoints", good, str(bad)])
    assert line.startswith(f"bench_sync.py: error: --checkpoints {str(bad)!r}") and reason in line, line


def test_bench_sync_checkpoints_of_one_run_reach_the_ranks(bench_sync, monkeypatch, tmp_path):
    paths = [checkpoint(tmp_path / f"model_{i}.pt", seed=i) for i in (1, 2, 3)]
    args = launched_args(bench_sync.main, monkeypatch, ["bench_sync.py", "--quick", "--checkpoints", *paths])
    assert args.checkpoints == paths
    models = bench_sync.checkpoint_models(paths)
    assert all(torch.equal(m[k], torch.load(p)["model"][k]) for m, p in zip(models, paths) for k in m)


def _sync_checkpoints(rank, world_size, paths):
    return [row["step"] for row in load_bench("bench_sync").bench_checkpoints(rank, paths)]


@pytest.mark.slow
def test_bench_sync_checkpoint_rows_name_the_files_they_sync(tmp_path):
    """Rows were labelled by position (`it1->2`) whatever the files: model_4 -> model_9 read as iterations 1 -> 2."""
    paths = [checkpoint(tmp_path / f"model_{i}.pt", seed=i) for i in (4, 9, 10)]
    steps = run_ranks(_sync_checkpoints, 2, args=(paths,))[1]
    assert steps == [f"{dtype} {pair}" for dtype in ("float32", "bfloat16") for _mode in ("patch", "bucket")
                     for pair in ("model_4 -> model_9", "model_9 -> model_10")]


@pytest.mark.parametrize("ppo, title", [(True, "PPO checkpoints (tracking preset, consecutive iterations)"),
                                        (False, "PPO checkpoints (--checkpoints, in the order given)")])
def test_bench_sync_checkpoint_table_says_whose_checkpoints_it_syncs(bench_sync, capsys, ppo, title):
    """--checkpoints' table was titled as if of the tracking preset's consecutive iterations, whatever files."""
    args = types.SimpleNamespace(size="1M", repeats=1, quick=False, ppo=ppo)
    row = dict(step="float32 model_4 -> model_9", mode="patch", density=0.5, wire=1234, seconds=0.25)
    bench_sync.print_tables({"time": [], "bytes": [], "ppo": [row]}, args)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-5:] == ["", title, "| step | mode | density | wire bytes | sync+apply s |", "|---|---|---|---|---|",
                          "| float32 model_4 -> model_9 | patch | 50.0% | 1,234 | 0.250 |"]


def test_bench_sync_bytes_table_without_a_density_below_1_says_why_it_is_empty(bench_sync, capsys):
    """`--densities 1` printed the header alone."""
    args = types.SimpleNamespace(size="1M", repeats=1, quick=False, ppo=False)
    bench_sync.print_tables({"time": [], "bytes": []}, args)
    assert ("fp32 parameters: none, as --densities has none below 1 (a whole tensor has no positions to encode)"
            in capsys.readouterr().out)


def test_bench_sync_ppo_with_checkpoints_is_refused(bench_sync, monkeypatch, capsys, tmp_path):
    """--ppo was silently ignored when --checkpoints were given (and trained anyway after a bare --checkpoints)."""
    paths = [checkpoint(tmp_path / f"model_{i}.pt", seed=i) for i in (1, 2)]
    line = usage_error(bench_sync.main, monkeypatch, capsys, ["bench_sync.py", "--ppo", "--checkpoints", *paths])
    assert line.startswith("bench_sync.py: error: --checkpoints with --ppo")


# ---- bench/bench_grad_sync.py -------------------------------------------------------------------------

@pytest.fixture
def bench_grad_sync(monkeypatch):
    module = load_bench("bench_grad_sync")
    monkeypatch.setattr(module, "launch", lambda args, *rest: (_ for _ in ()).throw(Launched(args)))
    monkeypatch.setattr(module.os, "cpu_count", lambda: 2)
    return module


def test_bench_grad_sync_refuses_oversubscribed_cpu_ranks(bench_grad_sync, monkeypatch, capsys):
    """--world-size 100000 on CPU kept spawning ranks until killed."""
    argv = ["bench_grad_sync.py", "--quick", "--world-size"]
    line = usage_error(bench_grad_sync.main, monkeypatch, capsys, argv + ["9"])
    assert line == ("bench_grad_sync.py: error: --world-size 9 is more than 4 ranks per CPU core (2 cores): the "
                    "timings of oversubscribed ranks are meaningless")
    args = launched_args(bench_grad_sync.main, monkeypatch, argv + ["8"])
    assert args.world == 8


@pytest.mark.parametrize("flags, expected", [
    ([], dict(models=["0.3M", "10M"], batch=256, warmup=3, iters=10, bucket_mb=[25.0, 4.0])),
    (["--quick"], dict(models=["20k", "0.6M"], batch=64, warmup=1, iters=3, bucket_mb=[25.0, 0.5])),
    (["--quick", "--iters", "7", "--batch", "32", "--models", "10M", "--bucket-mb", "2"],     # were replaced
     dict(models=["10M"], batch=32, warmup=1, iters=7, bucket_mb=[2.0])),
])
def test_bench_grad_sync_quick_sets_only_what_was_not_typed(bench_grad_sync, monkeypatch, flags, expected):
    args = launched_args(bench_grad_sync.main, monkeypatch, ["bench_grad_sync.py", *flags])
    got = dict(vars(args), models=list(args.models))
    assert {name: got[name] for name in expected} == expected


@pytest.mark.parametrize("flags, error", [
    (["--timeout", "inf"], "--timeout must be in [1, 1e6] seconds, got inf"),     # OverflowError in every rank
    (["--timeout", "1e-9"], "--timeout must be in [1, 1e6] seconds, got 1e-09"),  # stacks dumped before a step
    (["--bucket-mb", "inf"], "--bucket-mb must be distinct positive caps (inf is flat), got [inf]"),  # a flat row
    (["--bucket-mb", "4", "4"], "--bucket-mb must be distinct positive caps (inf is flat), got [4.0, 4.0]"),  # twice
    (["--bucket-mb", "0"], "--bucket-mb must be distinct positive caps (inf is flat), got [0.0]"),
])
def test_bench_grad_sync_values_no_rank_can_use_are_one_line(bench_grad_sync, monkeypatch, capsys, flags, error):
    line = usage_error(bench_grad_sync.main, monkeypatch, capsys, ["bench_grad_sync.py", "--quick", *flags])
    assert line == f"bench_grad_sync.py: error: {error}"


def test_bench_grad_sync_runs_one_quick_model_when_named(bench_grad_sync, monkeypatch):
    args = launched_args(bench_grad_sync.main, monkeypatch, ["bench_grad_sync.py", "--quick", "--models", "20k"])
    assert list(args.models) == ["20k"]


# ---- bench/bench_mujoco.py ----------------------------------------------------------------------------

@pytest.fixture
def bench_mujoco(monkeypatch):
    module = load_bench("bench_mujoco")
    monkeypatch.setattr(module, "run", lambda *a: (_ for _ in ()).throw(Launched(a[-1])))
    return module


@pytest.mark.parametrize("flags, error", [
    (["--seeds", "-1"], "--seeds must be in [0, 4294967295], got -1"),            # train.py exited 2, a traceback
    (["--seeds", "1", str(2**32)], "--seeds must be in [0, 4294967295], got 4294967296"),       # past 32 bits
    (["--last-iterations", "0"], "--last-iterations must be at least 1, got 0"),    # averaged every iteration
    (["--last-iterations", "-3"], "--last-iterations must be at least 1, got -3"),
    (["--tasks", "Hopper-v4", "NoSuch-v0"], "--tasks 'NoSuch-v0': Environment `NoSuch` doesn't exist."),
    (["--tasks", "Hopper"], "--tasks 'Hopper': No registered env with id: Hopper"),
    (["--tasks", "Hopper-v4", "CartPole-v1"],        # train.py refused it after the Hopper runs, "see train.log"
     "--tasks 'CartPole-v1': needs a 1-D continuous (Box) action space, got Discrete(2)"),
    (["--ranks", "64"], "--ranks 64: each rank's 32 steps must split into the mujoco preset's 32 minibatches of at "
                        "least 2; use at most 32 ranks"),        # train.py refused it once 64 ranks had started
])
def test_bench_mujoco_bad_flags_are_one_line(bench_mujoco, monkeypatch, capsys, tmp_path, flags, error):
    line = usage_error(bench_mujoco.main, monkeypatch, capsys, ["bench_mujoco.py", "--root", str(tmp_path), *flags])
    assert line == f"bench_mujoco.py: error: {error}"


@pytest.mark.parametrize("table_only", [False, True])
def test_bench_mujoco_root_under_a_file_is_one_line(bench_mujoco, monkeypatch, capsys, tmp_path, table_only):
    """--root below a file was a NotADirectoryError traceback."""
    (tmp_path / "afile").write_text("hello")
    root = str(tmp_path / "afile" / "x")
    line = usage_error(bench_mujoco.main, monkeypatch, capsys,
                       ["bench_mujoco.py", "--root", root] + (["--table-only"] if table_only else []))
    assert line == f"bench_mujoco.py: error: --root {root!r}: {str(tmp_path / 'afile')!r} is a file, not a " \
                   f"directory; pick another --root"


def test_bench_mujoco_good_flags_reach_the_runs(bench_mujoco, monkeypatch, tmp_path):
    root = str(tmp_path / "new" / "root")
    args = launched_args(bench_mujoco.main, monkeypatch, ["bench_mujoco.py", "--root", root, "--tasks", "Hopper-v4",
                                                          "--seeds", "0", "--ranks", "1", "--last-iterations", "1"])
    assert (args.tasks, args.seeds, args.last_iterations) == (["Hopper-v4"], [0], 1)


def test_bench_mujoco_failed_run_is_one_line_naming_its_log(monkeypatch, tmp_path):
    """A train.py that exits non-zero ended the bench with a RuntimeError traceback."""
    bench_mujoco = load_bench("bench_mujoco")
    calls = []

    def train_exits_2(command, **kwargs):
        calls.append(command)
        return 2

    monkeypatch.setattr(bench_mujoco, "run_child", train_exits_2)
    monkeypatch.setattr(sys, "argv", ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", "Hopper-v4",
                                      "--seeds", "1", "2", "--ranks", "1"])
    with pytest.raises(SystemExit) as exit_info:
        bench_mujoco.main()
    log = os.path.join(str(tmp_path), "Hopper-v4", "ranks1", "seed1", "steps1000000", "train.log")
    assert exit_info.value.code == f"bench_mujoco: Hopper-v4 ranks 1 seed 1 exited with 2; see {log}"
    assert len(calls) == 1          # the queued run was not started after the failure


def recorded_run(root, key: str, episodes: list, iterations: list, windows: list, stored: tuple) -> None:
    """A finished run under `root` (its TensorBoard file, unless `episodes` is None) and its results.jsonl line,
    recorded over `windows` with the statistics `stored`."""
    from torch.utils.tensorboard import SummaryWriter
    if episodes is not None:
        writer = SummaryWriter(str(root / key / "mujoco" / "2026-01-01_00-00-00"))
        for step, value in enumerate(iterations, start=1):
            writer.add_scalar("Train/mean_reward", value, step)
        for value in episodes:
            writer.add_scalar("Episode/return", value, len(iterations))
        writer.close()
    record = {"key": key, "task": "Hopper-v4", "ranks": 1, "seed": 1, "steps": 4096, "wall_s": 60.0,
              "versions": {"torch": "x"}, "windows": windows, "last_episodes_return": stored[0],
              "episodes": 99, "last_iterations_return": stored[1]}
    with open(root / "results.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def test_bench_mujoco_table_statistics_use_the_windows_its_header_names(monkeypatch, capsys, tmp_path):
    """The header took this command's --last-episodes/--last-iterations over numbers recorded with others."""
    bench_mujoco = load_bench("bench_mujoco")
    recorded_run(tmp_path, "Hopper-v4/ranks1/seed1/steps4096", [10.0, 20.0, 40.0], [1.0, 2.0, 6.0], [100, 10],
                 (999.0, 999.0))
    monkeypatch.setattr(sys, "argv", ["bench_mujoco.py", "--root", str(tmp_path), "--table-only",
                                      "--last-episodes", "2", "--last-iterations", "2"])
    bench_mujoco.main()
    header, _, row, _ = capsys.readouterr().out.splitlines()
    assert "last 2 episodes" in header and "last 2 iterations" in header
    assert "| 30.00 (one seed) | 4.00 (one seed) |" in row         # (20 + 40) / 2 and (2 + 6) / 2, not 999


def test_bench_mujoco_table_without_the_run_files_needs_the_recorded_windows(monkeypatch, tmp_path):
    bench_mujoco = load_bench("bench_mujoco")
    recorded_run(tmp_path, "Hopper-v4/ranks1/seed1/steps4096", None, [], [100, 10], (12.5, 7.5))
    monkeypatch.setattr(sys, "argv", ["bench_mujoco.py", "--root", str(tmp_path), "--table-only",
                                      "--last-episodes", "5"])
    with pytest.raises(SystemExit) as exit_info:
        bench_mujoco.main()
    assert exit_info.value.code == ("bench_mujoco: Hopper-v4/ranks1/seed1/steps4096 was recorded over windows "
                                    "[100, 10] (last episodes, iterations) and its TensorBoard file is gone; pass "
                                    "those windows")


def test_bench_mujoco_table_of_no_runs_says_so(monkeypatch, tmp_path):
    """It printed an empty table and `versions: `."""
    bench_mujoco = load_bench("bench_mujoco")
    monkeypatch.setattr(sys, "argv", ["bench_mujoco.py", "--root", str(tmp_path), "--table-only"])
    with pytest.raises(SystemExit) as exit_info:
        bench_mujoco.main()
    assert exit_info.value.code == f"bench_mujoco: no finished runs in {tmp_path / 'results.jsonl'}"
