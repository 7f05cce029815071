"""bench/bench_mujoco.py: its table (mean and spread over seeds, the verdict against CleanRL's numbers, the columns),
each run's statistics line, and the flags and tasks it refuses because they cannot give that table. No run starts:
train.py's runs are replaced by stand-ins or by a launch that raises."""

import json
import sys

import gymnasium
import pytest

from tests.test_bench_flags import (Launched, bench_mujoco, launched_args, recorded_run,  # noqa: F401 (fixtures)
                                    usage_error)
from tests.test_tools import load_bench


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


class BoxActions(gymnasium.Env):
    """An env whose only point is its action space (check_tasks makes it and reads action_space)."""

    def __init__(self, shape=(2, 3)):
        self.observation_space = gymnasium.spaces.Box(-1.0, 1.0, (4,))
        self.action_space = gymnasium.spaces.Box(-1.0, 1.0, shape)


@pytest.mark.parametrize("shape", [(2, 3), ()])
def test_bench_mujoco_task_with_a_box_of_other_than_one_dimension_is_refused(bench_mujoco, monkeypatch, capsys,
                                                                           tmp_path, shape):
    """train.py's adapter takes 1-D Box actions: a 2-D or a 0-D Box is refused before any run, naming the space.

    Mutant: `or len(space.shape) != 1` dropped, `or` -> `and`, `!= 1` -> `> 1` (the 0-D Box)."""
    from gymnasium.envs.registration import EnvSpec, registry
    name = f"BoxActions{len(shape)}D-v0"
    monkeypatch.setitem(registry, name, EnvSpec(name, entry_point=lambda **kw: BoxActions(shape)))
    space = gymnasium.spaces.Box(-1.0, 1.0, shape)
    line = usage_error(bench_mujoco.main, monkeypatch, capsys,
                       ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", name])
    assert line == f"bench_mujoco.py: error: --tasks {name!r}: needs a 1-D continuous (Box) action space, got {space}"


def test_bench_mujoco_ranks_that_leave_exactly_two_per_minibatch_are_run(bench_mujoco, monkeypatch, tmp_path):
    """32 ranks: 2048 / 32 = 64 steps per rank, 32 minibatches of exactly 2 (the least the check allows).

    Mutant: `steps < 2 * minibatches` -> `steps <= 2 * minibatches`."""
    monkeypatch.setattr(bench_mujoco.os, "cpu_count", lambda: 8)    # 32 ranks at once: within 4 per core
    args = launched_args(bench_mujoco.main, monkeypatch, ["bench_mujoco.py", "--root", str(tmp_path), "--tasks",
                                                          "Hopper-v4", "--seeds", "0", "--ranks", "32"])
    assert args.ranks == [32]


def test_bench_mujoco_each_finished_run_prints_its_statistics_line(monkeypatch, capsys, tmp_path):
    """One line per run as it finishes: the last-episodes mean, the last-iterations mean, wall minutes (90 s = 1.5).

    Mutant: the two means swapped in the line; `wall_s / 60` -> `wall_s / 3600`."""
    bm = load_bench("bench_mujoco")
    key = "Hopper-v4/ranks1/seed1/steps4096"

    def finished(task, ranks, seed, total_steps, args):
        return {"key": key, "task": task, "ranks": ranks, "seed": seed, "steps": 4096, "wall_s": 90.0,
                "versions": {"torch": "x"}, "windows": [2, 3], "last_episodes_return": 12.5, "episodes": 5,
                "last_iterations_return": 6.25}
    monkeypatch.setattr(bm, "run", finished)
    monkeypatch.setattr(sys, "argv", ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", "Hopper-v4", "--seeds",
                                      "1", "--ranks", "1", "--total-steps", "40960", "--last-episodes", "2",
                                      "--last-iterations", "3"])
    bm.main()
    out = capsys.readouterr().out.splitlines()
    assert f"[bench] {key}: last 2 episodes 12.50, last 3 iterations 6.25, 1.5 min" in out


def test_bench_mujoco_too_few_episodes_names_the_count_and_the_window(tmp_path):
    """A run that finished 3 episodes cannot give the mean of the last 5: the error says both numbers.

    Mutant: the window's value left out of the message."""
    bm = load_bench("bench_mujoco")
    recorded_run(tmp_path, "k", [1.0, 2.0, 3.0], [1.0], [5, 1], (0.0, 0.0))
    with pytest.raises(RuntimeError) as error:
        bm.final_returns(str(tmp_path / "k"), 5, 1)
    assert str(error.value) == f"{tmp_path / 'k'}: only 3 episodes finished, fewer than --last-episodes 5"


@pytest.mark.parametrize("second, reason", [
    (("seed1/steps5000", 1, {"torch": "a"}), "are seed 1 twice"),
    (("seed2/steps4096", 2, {"torch": "b"}), "ran under other versions (torch a; torch b)"),
    (("seed2/steps5000", 2, {"torch": "a"}), None),
])
def test_bench_mujoco_table_refuses_a_row_that_is_not_seeds_of_one_setting(monkeypatch, capsys, tmp_path, second,
                                                                            reason):
    """--table-only over runs recorded before check_rounding (or by --table-only runs, which skip it): --total-steps
    4096 and 5000 are both 2 iterations, one training command, so seed 1 under both keys is one run counted as two
    seeds; a run under other versions is not a seed of the same setting either. Both were averaged into one row.
    Seed 2 of --total-steps 5000 is a seed of that one command: its row is printed.

    Mutant: no check_rows call in main -> the table is printed (no exit); `other["seed"] == r["seed"]` -> `!=`;
    the keys (so --total-steps) compared instead of the seeds -> the third row refused."""
    bm = load_bench("bench_mujoco")
    tail, seed, versions = second
    records = [(f"Hopper-v4/ranks1/{tail}", seed, versions), ("Hopper-v4/ranks1/seed1/steps4096", 1, {"torch": "a"})]
    lines = [json.dumps({"key": key, "task": "Hopper-v4", "ranks": 1, "seed": seed, "steps": 4096, "wall_s": 1.0,
                         "versions": versions, "windows": [100, 10], "last_episodes_return": 1.0,
                         "last_iterations_return": 1.0}) for key, seed, versions in records]
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(sys, "argv", ["bench_mujoco.py", "--root", str(tmp_path), "--table-only"])
    if reason is None:
        bm.main()
        assert "| Hopper-v4 | 1 x 2048 | 4,096 | 1, 2 | 1.00 ± 0.00 |" in capsys.readouterr().out
        return
    with pytest.raises(SystemExit) as code:
        bm.main()
    first, later = sorted(["Hopper-v4/ranks1/seed1/steps4096", f"Hopper-v4/ranks1/{tail}"])
    assert code.value.code == (f"bench_mujoco: {first} and {later} {reason} in one table row (Hopper-v4, ranks 1, "
                               f"4,096 steps); delete the lines of one from {tmp_path / 'results.jsonl'}, or pass "
                               f"another --root")
