"""bench/bench_mujoco.py: its table (mean and spread over seeds, the verdict against CleanRL's numbers, the columns),
each run's statistics line, and the flags and tasks it refuses because they cannot give that table. No run starts:
train.py's runs are replaced by stand-ins or by a launch that raises."""

import pytest

from tests.test_bench_flags import Launched, usage_error
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
