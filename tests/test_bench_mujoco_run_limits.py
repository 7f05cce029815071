"""bench/bench_mujoco.py's limits on the runs it starts, each refused in one line before any run: no more ranks at
once than 4 per CPU core, and no --total-steps that rounds onto the step count of runs already recorded under
another --total-steps (one table row would hold both). Where a run would start, the bench raises Launched. A
finished run is never started again."""

import json

import pytest

from tests.test_bench_flags import Launched, launched_args, usage_error
from tests.test_tools import exit_code, load_bench


def _stopped_at_launch(monkeypatch, name: str, *launches: str):
    """bench `name` whose functions `launches` (where ranks, learners or jobs would start) raise Launched(last arg)."""
    module = load_bench(name)
    for launch in launches:
        monkeypatch.setattr(module, launch, lambda *a, **k: (_ for _ in ()).throw(Launched(a[-1])))
    return module


@pytest.fixture
def bench_mujoco(monkeypatch):
    """bench_mujoco that stops where a run's train.py would start (Launched), on a machine of 2 cores."""
    module = _stopped_at_launch(monkeypatch, "bench_mujoco", "run")
    monkeypatch.setattr(module.os, "cpu_count", lambda: 2)
    return module


@pytest.mark.parametrize("flags, most", [(["--jobs", "100", "--ranks", "1"], 100),
                                         (["--jobs", "1", "--ranks", "32"], 32),
                                         (["--jobs", "3", "--ranks", "1", "4"], 12)])
def test_bench_mujoco_refuses_more_ranks_at_once_than_4_per_core(bench_mujoco, monkeypatch, capsys, tmp_path, flags,
                                                                  most):
    """`--jobs 100` or `--ranks 32` on 2 cores started real torchrun jobs (hours of oversubscribed runs).

    Mutant: no bound on --jobs x max(--ranks) -> the bench reaches its first run (Launched, not exit 2).
    """
    top = max(int(v) for v in flags[flags.index("--ranks") + 1:])
    line = usage_error(bench_mujoco.main, monkeypatch, capsys,
                       ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", "Hopper-v4", *flags])
    assert line == (f"bench_mujoco.py: error: --jobs {flags[1]} x --ranks {top} is {most} ranks at a time, more than "
                    f"this machine can host: at most 4 per CPU core (2 cores, so 8 ranks)")


@pytest.mark.parametrize("flags", [["--jobs", "8", "--ranks", "1"], ["--jobs", "4", "--ranks", "1", "2"]])
def test_bench_mujoco_takes_4_ranks_per_core_or_any_count_where_cores_are_unknown(bench_mujoco, monkeypatch, tmp_path,
                                                                                   flags):
    """8 ranks at once on 2 cores start; so do 100 where the core count cannot be read (os.cpu_count() is None).

    Mutant: the bound exclusive (>=), or applied with no core count (None taken as 1) -> exit 2, not Launched.
    """
    argv = ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", "Hopper-v4", "--seeds", "1", *flags]
    assert launched_args(bench_mujoco.main, monkeypatch, argv).jobs == int(flags[1])
    monkeypatch.setattr(bench_mujoco.os, "cpu_count", lambda: None)
    assert launched_args(bench_mujoco.main, monkeypatch, argv + ["--jobs", "100"]).jobs == 100


def test_bench_mujoco_table_only_starts_no_run_so_takes_any_jobs(bench_mujoco, monkeypatch, tmp_path):
    """--table-only starts no run: a --jobs left in a command line it is added to is not a reason to refuse.

    Mutant: the bound applied under --table-only -> exit 2 instead of the empty table's message.
    """
    code = exit_code(bench_mujoco.main, monkeypatch, ["bench_mujoco.py", "--root", str(tmp_path), "--jobs", "100",
                                                      "--table-only"])
    assert code == f"bench_mujoco: no finished runs in {tmp_path / 'results.jsonl'}"


def _recorded(tmp_path, typed: int, steps: int) -> None:
    """results.jsonl with one finished Hopper-v4 1-rank run of seed 1, asked for as --total-steps `typed`."""
    record = {"key": f"Hopper-v4/ranks1/seed1/steps{typed}", "task": "Hopper-v4", "ranks": 1, "seed": 1,
              "steps": steps, "last_episodes_return": 1.0, "last_iterations_return": 1.0}
    (tmp_path / "results.jsonl").write_text(json.dumps(record) + "\n")


def test_bench_mujoco_refuses_a_total_steps_that_rounds_onto_recorded_runs(bench_mujoco, monkeypatch, capsys,
                                                                             tmp_path):
    """--total-steps 5000 after runs of --total-steps 4096 (both 2 iterations, 4,096 steps) ran seed 1 again under
    another key, and the table put both in one row ("seeds 1, 1").

    Mutant: no check_rounding call -> the seed-1 run starts again (Launched, not exit 2).
    """
    _recorded(tmp_path, 4096, 4096)
    line = usage_error(bench_mujoco.main, monkeypatch, capsys,
                       ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", "Hopper-v4", "--seeds", "1", "2",
                        "--ranks", "1", "--last-iterations", "1", "--total-steps", "5000"])
    assert line == (f"bench_mujoco.py: error: --total-steps 5000 rounds to 4,096 steps, as --total-steps 4096 of the "
                    f"runs recorded in {tmp_path / 'results.jsonl'} does: one table row would hold both; pass "
                    f"--total-steps 4096 (or another --root)")


@pytest.mark.parametrize("flags", [["--total-steps", "4096"], ["--total-steps", "6144"],
                                   ["--total-steps", "5000", "--ranks", "2"]])
def test_bench_mujoco_total_steps_of_their_own_row_still_run(bench_mujoco, monkeypatch, tmp_path, flags):
    """The same --total-steps adds seeds to the recorded runs; another step count, or other ranks, is another row.

    Mutant: the check refuses whatever differs from the recorded --total-steps (steps or ranks not compared).
    """
    _recorded(tmp_path, 4096, 4096)
    argv = ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", "Hopper-v4", "--seeds", "1", "2",
            "--last-iterations", "1", *flags]
    assert launched_args(bench_mujoco.main, monkeypatch, argv if "--ranks" in flags else argv + ["--ranks", "1"])


def test_bench_mujoco_never_repeats_a_finished_run(monkeypatch, capsys, tmp_path):
    """docs/simulators.md: results accumulate in results.jsonl and finished runs are never repeated, so the table is
    completed piece by piece: with seed 1 recorded, seeds 1 and 2 run seed 2 alone, and the same command again none.

    Mutant: todo built from every (task, ranks, seed), recorded or not."""
    module = load_bench("bench_mujoco")
    monkeypatch.setattr(module.os, "cpu_count", lambda: 2)
    started = []

    def run(task, ranks, seed, total_steps, args):
        started.append(seed)
        return {"key": module.run_key(task, ranks, seed, total_steps), "task": task, "ranks": ranks, "seed": seed,
                "steps": 4096, "wall_s": 60.0, "versions": {"torch": "x"}, "windows": [100, 1],
                "last_episodes_return": 2.0, "episodes": 100, "last_iterations_return": 2.0}
    (tmp_path / "results.jsonl").write_text(json.dumps(run("Hopper-v4", 1, 1, 4096, None)) + "\n")
    started.clear()
    monkeypatch.setattr(module, "run", run)
    argv = ["bench_mujoco.py", "--root", str(tmp_path), "--tasks", "Hopper-v4", "--seeds", "1", "2", "--ranks", "1",
            "--total-steps", "4096", "--last-iterations", "1"]
    for _ in range(2):
        monkeypatch.setattr(module.sys, "argv", argv)
        module.main()
    assert started == [2]
    seeds = [json.loads(line)["seed"] for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert seeds == [1, 2] and "| Hopper-v4 | 1 x 2048 | 4,096 | 1, 2 |" in capsys.readouterr().out
