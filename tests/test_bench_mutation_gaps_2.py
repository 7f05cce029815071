"""Gaps a second mutation audit of bench/ found: the lines changed since the first audit (base commit fea2244,
tests/test_bench_mutation_gaps.py), 64 hand-made mutants of them. 26 were killed by the existing tests; 34 survived
and are pinned here; 3 are equivalent; 1 was not worth a test.

Pinned: --timeout's inclusive bounds [1, 1e6], just past them and nan; a nan --bucket-mb; bench_mujoco's 0-D and 2-D
Box action spaces, 32 ranks (exactly 2 per minibatch), each run's statistics line, the too-few-episodes message;
bench_rollout's iteration / (C + U) and / max(C, U) columns (C the sync job's wait), the weight-sync table and
progress line, --quick with learning refused before any part runs (it replaces test_tools.py's test, which stubbed no
part: with the check gone it started the real 400-iteration jobs); bench_sync's out-of-order message (the file before
and its iteration), checkpoints without an iteration, an empty, non-tensor or non-dict model, the empty bytes table's
note keyed on the bytes rows; fault_drills' table header. Also pinned, on an unchanged line beside a changed one:
bench_train raising RSL-RL's own failure.

Equivalent: bench_mujoco `steps % minibatches or` dropped (--ranks must divide 2048, so steps is a power of 2, and
one not divisible by the 32 minibatches is below 32 < 64, refused anyway); bench_grad_sync `len(set(caps)) <
len(caps)` -> `!=` (a set is never longer than its list); bench_train `len(rows) == max_iterations` -> `>=`
(syncppo logs at most max_iterations rows). Not worth a test: bench_sync's `except OSError` -> `FileNotFoundError`
(a regular file that cannot be read needs EACCES, which the tests' root user does not get).

Every expected number is worked out by hand from the inputs, never read back from the bench. No ranks start: train
jobs, replays and launches are replaced by stand-ins."""

import sys
import types

import gymnasium
import pytest
import torch

from tests.test_bench_flags import (bench_grad_sync, bench_mujoco, bench_sync, checkpoint,  # noqa: F401 (fixtures)
                                    launched_args, recorded_run, usage_error)
from tests.test_tools import load_bench


# ---- bench/bench_grad_sync.py -------------------------------------------------------------------------

@pytest.mark.parametrize("timeout", ["1", "1e6"])
def test_bench_grad_sync_timeout_bounds_are_inclusive(bench_grad_sync, monkeypatch, timeout):
    """--timeout must be in [1, 1e6] seconds: both ends are usable values.

    Mutant: `1 <= args.timeout` -> `1 < args.timeout`; `args.timeout <= 1e6` -> `args.timeout < 1e6`."""
    args = launched_args(bench_grad_sync.main, monkeypatch, ["bench_grad_sync.py", "--quick", "--timeout", timeout])
    assert args.timeout == float(timeout)


@pytest.mark.parametrize("timeout, shown", [("1000001", "1000001.0"), ("nan", "nan"), ("0.999", "0.999")])
def test_bench_grad_sync_timeout_just_outside_or_nan_is_refused(bench_grad_sync, monkeypatch, capsys, timeout, shown):
    """Just past either end, and nan (every comparison with it is false), are refused in one line.

    Mutant: the upper bound dropped or moved (1e6 -> 1e7); `not 1 <= t <= 1e6` -> `t < 1 or t > 1e6` (lets nan by)."""
    line = usage_error(bench_grad_sync.main, monkeypatch, capsys,
                       ["bench_grad_sync.py", "--quick", "--timeout", timeout])
    assert line == f"bench_grad_sync.py: error: --timeout must be in [1, 1e6] seconds, got {shown}"


def test_bench_grad_sync_nan_bucket_cap_is_refused(bench_grad_sync, monkeypatch, capsys):
    """A nan cap is no cap: refused like 0 and inf.

    Mutant: `not all(0 < mb < inf)` -> `any(mb <= 0 or mb == inf)` (lets nan by)."""
    line = usage_error(bench_grad_sync.main, monkeypatch, capsys, ["bench_grad_sync.py", "--quick", "--bucket-mb",
                                                                   "4", "nan"])
    assert line == "bench_grad_sync.py: error: --bucket-mb must be distinct positive caps (inf is flat), got [4.0, nan]"


# ---- bench/bench_mujoco.py ----------------------------------------------------------------------------

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


# ---- bench/bench_rollout.py ---------------------------------------------------------------------------

def learner_series(gap: float, wait: float, update: float) -> dict:
    """7 iterations logged every `gap` s, each with learner wait `wait` and update `update`."""
    return {"Perf/total_fps": [(i + 1, gap * i, 1.0) for i in range(7)],
            "Perf/collection_time": [(i + 1, gap * i, wait) for i in range(7)],
            "Perf/learning_time": [(i + 1, gap * i, update) for i in range(7)]}


def test_bench_rollout_overlap_columns_use_the_sync_job_s_wait_and_this_job_s_update(monkeypatch, capsys):
    """iteration / (C + U) and iteration / max(C, U), C the sync job's wait (3 s), U the row's own update.
    sync: 4 s/it, 4 / (3 + 1) = 1.00, 4 / 3 = 1.33. async: 2 s/it, update 1.5, its own wait 0.5 (not C):
    2 / (3 + 1.5) = 0.44, 2 / max(3, 1.5) = 0.67. Steps/s 12,288 / 4 and / 2; vs colocated (5 s/it) 1.25x, 2.50x.

    Mutant: the row's own wait for C; min for max; the two columns swapped; a ratio inverted."""
    br = load_bench("bench_rollout")
    series = {"colocated": learner_series(5.0, 1.0, 1.0), "sync": learner_series(4.0, 3.0, 1.0),
              "async": learner_series(2.0, 0.5, 1.5)}
    monkeypatch.setattr(br, "train", lambda preset, flags, root, name: name.split("_")[1])
    monkeypatch.setattr(br, "scalars", lambda variant: series[variant])
    br.throughput(types.SimpleNamespace(envs=["tracking"], iterations={"tracking": 7}, rounds=1), "root")
    out = capsys.readouterr().out.splitlines()
    assert "| sync | 3,072 | 4.00 | 3.00 | 1.00 | 1.25x | 1.00 | 1.33 |" in out
    assert "| async | 6,144 | 2.00 | 0.50 | 1.50 | 2.50x | 0.44 | 0.67 |" in out


def test_bench_rollout_weight_sync_table_columns_by_hand(monkeypatch, capsys, tmp_path):
    """Ledger medians after iteration 1: patch 200 B, bucket 1,000 B (0.20 of it), messages 3 / 5; replay medians:
    sync patch 1 ms + apply 2 ms, bucket 2 + 8 ms, apply time patch / bucket 0.25 (sync's would be 0.50). Each
    version changes actor.0.weight alone (all 40 of its elements): share 40 / all elements.

    Mutant: patch / bucket bytes inverted; the sync time's ratio for apply's; sync and apply swapped in a cell;
    the share printed as a fraction; bucket's bytes in patch's place in the progress line."""
    br = load_bench("bench_rollout")
    run = tmp_path / "ws_0_patch_float32"
    run.mkdir()
    first = torch.load(checkpoint(run / "model_1.pt"), weights_only=False)
    for i in (2, 3, 4):
        first["model"]["actor.0.weight"] += 1.0
        torch.save(first, run / f"model_{i}.pt")
    share = 100 * first["model"]["actor.0.weight"].numel() / sum(v.numel() for v in first["model"].values())
    ledger = {"patch": ([9e9, 100.0, 200.0, 300.0], [0.0, 3.0, 3.0, 3.0]),
              "bucket": ([9e9, 1000.0, 1000.0, 1000.0], [0.0, 5.0, 5.0, 5.0])}

    def scalars(run_dir):
        nbytes, calls = ledger["patch" if "patch" in run_dir else "bucket"]
        return {"Comm/weight_sync_bytes": [(i, 0.0, v) for i, v in enumerate(nbytes)],
                "Comm/weight_sync_calls": [(i, 0.0, v) for i, v in enumerate(calls)],
                "Loss/learning_rate": [(i, 0.0, 1e-3) for i in range(4)]}
    monkeypatch.setattr(br, "train", lambda preset, flags, root, name: str(tmp_path / name))
    monkeypatch.setattr(br, "scalars", scalars)
    monkeypatch.setattr(br, "replay", lambda paths, dtype: {
        "send": {"patch": [0.001] * 3, "bucket": [0.002] * 3}, "apply": {"patch": [0.002] * 3, "bucket": [0.008] * 3},
        "stats": {"patch": [(0, 0)] * 3, "bucket": [(0, 0)] * 3}})
    br.weight_sync(types.SimpleNamespace(lrs={"L": []}, dtypes=["float32"], sync_iterations=4), str(tmp_path))
    out = capsys.readouterr().out.splitlines()
    assert f"  L, float32: {share:.1f}% changed, patch 200 B, bucket 1,000 B per iteration" in out
    assert (f"| L | float32 | 1.0e-03 | {share:.1f}% | 200 | 1,000 | 0.20 | 1.00 + 2.00 | 2.00 + 8.00 | 0.25 | 3 / 5 |"
            in out), out



def test_bench_rollout_quick_learning_is_refused_before_any_part_or_folder(monkeypatch, capsys, tmp_path):
    """--quick with learning among the parts: one line, exit 2, no part started and no --out made. (Every part is
    stubbed: without them, a regression would start the real 400-iteration learning jobs rather than fail.)

    Mutant: the `"learning" in args.parts` check under --quick dropped."""
    br = load_bench("bench_rollout")
    for part in ("throughput", "weight_sync", "learning"):
        monkeypatch.setattr(br, part, lambda *a: (_ for _ in ()).throw(AssertionError("a part ran")))
    out = tmp_path / "out"
    line = usage_error(br.main, monkeypatch, capsys, ["bench_rollout.py", "--quick", "--parts", "throughput",
                                                      "learning", "--out", str(out)])
    assert line == ("bench_rollout.py: error: --quick has no learning part (its jobs run 400 iterations, about an "
                    "hour): drop --quick or leave learning out of --parts")
    assert not out.exists()

# ---- bench/bench_sync.py ------------------------------------------------------------------------------

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



# ---- bench/bench_train.py -----------------------------------------------------------------------------

@pytest.mark.parametrize("failure", [RuntimeError("rsl-rl broke"), InterruptedError("rsl-rl broke")])
def test_bench_train_rsl_rl_failure_is_raised_not_a_table_without_it(monkeypatch, tmp_path, failure):
    """RSL-RL failing in its thread (anything but the bench's own StopRslRl, an InterruptedError of RSL-RL's too) is
    raised in the main thread once syncppo is done, rather than returning rows with no RSL-RL rounds.

    Mutant: `if errors: raise errors[0]` dropped (an unchanged line next to the stop's, checked here too); rsl_thread
    catching InterruptedError (the stop's exception before StopRslRl)."""
    from configs import preset
    bt = load_bench("bench_train")

    class BrokenRunner:
        logger = type("Logger", (), {"log": staticmethod(lambda **kw: None)})()
        alg = type("PPO", (), {"compute_returns": staticmethod(lambda obs: None)})()

        def learn(self, iterations):
            raise failure
    monkeypatch.setattr(bt, "rsl_rl_runner", lambda cfg, log_dir, device: BrokenRunner())
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 16, 8, 2
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16,)
    with pytest.raises(type(failure), match="^rsl-rl broke$"):
        bt.run_interleaved(cfg, str(tmp_path), [(1, 1, 1)], torch.device("cpu"))

# ---- bench/fault_drills.py ----------------------------------------------------------------------------

def test_fault_drills_table_header_says_whose_exit_status(monkeypatch, capsys):
    """The exit status column is torchrun's (the launcher's), one row per drill under a 4-column rule.

    Mutant: the header's '(torchrun)' dropped; a column short in the rule."""
    fd = load_bench("fault_drills")
    monkeypatch.setattr(fd, "drill", lambda name, *a, **k: (name, 1, 2.5, "kept"))
    monkeypatch.setattr(sys, "argv", ["fault_drills.py"])
    fd.main()
    out = capsys.readouterr().out.splitlines()
    at = out.index("| drill | exit status (torchrun) | seconds to exit | kept |")
    assert out[at + 1:at + 3] == ["|---|---|---|---|", "| kill -9 one rank | 1 | 2.5 | kept |"]
