"""bench/bench_rollout.py: the medians, ratios and changed shares behind its tables, each table's columns worked out
by hand (throughput, the overlap columns, weight sync), --quick refusing the learning part, and how it stops: a
replay rank that fails, a learning job that fails or is interrupted, Ctrl-C or a failed job in the first two parts.
The train jobs are replaced by stand-ins: nothing is trained. Replays run 2 spawned processes: stand-in ranks, or
(the slow tests) real gloo ranks on tiny checkpoints."""

import os
import signal
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

import bench.bench_rollout as bench_rollout     # by name, for replay: its spawned ranks unpickle their target from it
from tests.test_bench_flags import checkpoint, usage_error
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


class OrderSyncer:
    """A replay syncer stand-in that logs (mode, version) per sync() on the sender, mode per apply() on the receiver."""

    def __init__(self, mode, log):
        self.mode, self.log = mode, log

    def init_sender(self, state, *a):
        pass

    def init_receiver(self, model):
        pass

    def sync(self, state, version):
        self.log.append((self.mode, version))
        return types.SimpleNamespace(wire_bytes=version, changed_elements=0)

    def apply(self, model):
        self.log.append(self.mode)


def test_bench_rollout_replay_alternates_which_syncer_goes_first_by_version_on_both_ranks(monkeypatch):
    """Replaying versions 3..6 (model_1 is the start, synced as version 2 by both modes in turn): bucket first on the
    odd versions, patch first on the even ones, on the sender and the receiver alike, and each mode's stats still
    list its versions in order. Before, patch went first on every version and paid its first-sync costs.

    Mutant: `for mode in replay_order(version)` back to `for mode in syncers` -> patch first on versions 3 and 5.
    Mutant: replay_rank calls replay_order(rank), not replay_order(version) -> one fixed order per rank, and the two
    ranks' orders differ."""
    br = load_bench("bench_rollout")
    monkeypatch.setattr(br, "rank_signals", lambda: None)
    nothing = lambda *a, **k: None    # noqa: E731
    monkeypatch.setattr(br, "dist", types.SimpleNamespace(init_process_group=nothing, barrier=nothing,
                                                          new_group=nothing, destroy_process_group=nothing))
    monkeypatch.setattr(br.torch, "load", lambda path, **k: {"model": {"w": path}, "config": {"policy": {}}})
    monkeypatch.setattr(br, "receiver_model", lambda state, policy, dtype: object())
    logs, answers = {0: [], 1: []}, []
    for rank in (0, 1):
        monkeypatch.setattr(br, "make_weight_syncer", lambda cfg, src, dst, group, log=logs[rank]:
                            OrderSyncer(cfg.type, log))
        br.replay_rank(rank, 0, [f"model_{i}.pt" for i in range(1, 6)], "float32",
                       types.SimpleNamespace(put=answers.append))
    order = ["bucket", "patch", "patch", "bucket", "bucket", "patch", "patch", "bucket"]     # versions 3, 4, 5, 6
    assert logs[0] == [("patch", 2), ("bucket", 2)] + list(zip(order, [3, 3, 4, 4, 5, 5, 6, 6]))
    assert logs[1] == ["patch", "bucket"] + order
    stats = answers[0][2]
    assert {m: [b for b, _ in stats[m]] for m in stats} == {"patch": [3, 4, 5, 6], "bucket": [3, 4, 5, 6]}
    assert [br.replay_order(v) for v in (3, 4)] == [("bucket", "patch"), ("patch", "bucket")]


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


# ---- stopping: a failed rank, job or part, and Ctrl-C ----------------------------------------------------

BOUND_S = 60.0      # a bounded wait for what the code does at once: only a regression reaches it


def exiting_or_waiting_rank(rank, port, paths, dtype_name, queue):
    """replay's rank stand-in (spawned: a function of this module): rank 1 exits 3 before its answer, rank 0 waits
    as in a collective whose partner is gone, until it is stopped."""
    from bench._common import rank_signals
    rank_signals()      # as the real rank: ends with the test's process, whatever happens to the test
    if rank == 1:
        os._exit(3)
    threading.Event().wait()


def recording_spawn(monkeypatch, br) -> list:
    """replay's processes, recorded as it makes them (its spawn context otherwise)."""
    made, real = [], br.mp.get_context("spawn")

    def process(*a, **k):
        made.append(real.Process(*a, **k))
        return made[-1]
    context = types.SimpleNamespace(Queue=real.Queue, Process=process)
    monkeypatch.setattr(br, "mp", types.SimpleNamespace(get_context=lambda method: context))
    return made


def test_bench_rollout_replay_rank_failing_before_its_answer_names_its_code_and_stops_the_other(monkeypatch):
    """Rank 1 exits 3 without an answer while rank 0 waits: replay waited out its 600 s for the answer, then raised
    queue.Empty (no exit code), rank 0 waiting meanwhile. Now it raises naming the code as soon as the rank is gone,
    and has stopped rank 0 (SIGTERM) by the time it returns.

    Mutant: the exit-code check in replay's wait for answers dropped -> no rank answered in ANSWER_S (here 60 s).
    Mutant: no stop_processes(procs) in replay's finally -> rank 0 still alive when replay has raised."""
    br = bench_rollout
    monkeypatch.setattr(br, "replay_rank", exiting_or_waiting_rank)
    monkeypatch.setattr(br, "ANSWER_S", BOUND_S)
    made = recording_spawn(monkeypatch, br)
    try:
        with pytest.raises(RuntimeError) as error:
            br.replay(["unused"], "float32")
        alive = [p.pid for p in made if p.is_alive()]
    finally:
        for p in made:      # a failing case leaves no process behind
            if p.is_alive():
                p.kill()
            p.join()
    assert str(error.value) == "replay rank exited with 3"
    assert len(made) == 2 and alive == []
    assert [p.exitcode for p in made] == [-signal.SIGTERM, 3]     # rank 0 was stopped, not ended by itself


@pytest.mark.slow
def test_bench_rollout_replay_of_an_unreadable_checkpoint_fails_in_seconds_naming_the_exit_code(monkeypatch,
                                                                                                 tmp_path):
    """Real gloo ranks: rank 0 cannot load the second checkpoint (FileNotFoundError, exit 1) and rank 1 fails in
    its barrier. Neither answers: replay waited 600 s for them and raised queue.Empty.

    Mutant: the exit-code check in replay's wait for answers dropped -> no rank answered in ANSWER_S (here 60 s)."""
    monkeypatch.setattr(bench_rollout, "ANSWER_S", BOUND_S)
    with pytest.raises(RuntimeError) as error:
        bench_rollout.replay([checkpoint(tmp_path / "model_1.pt"), str(tmp_path / "model_2.pt")], "float32")
    assert str(error.value) == "replay rank exited with 1"


@pytest.mark.slow
def test_bench_rollout_replay_of_three_versions_counts_what_each_changed(tmp_path):
    """The answers still arrive through the wait that watches for failed ranks: version 2 changes every element
    of actor.0.weight (8 x 5 = 40), version 3 one element of critic.0.bias; patch counts 40 then 1, and each
    syncer is timed on both versions.

    Mutant: replay's wait keeps only the first answer -> KeyError for rank 1's."""
    state = torch.load(checkpoint(tmp_path / "model_1.pt"), weights_only=False)
    state["model"]["actor.0.weight"] += 1.0
    torch.save(state, tmp_path / "model_2.pt")
    state["model"]["critic.0.bias"][0] += 1.0
    torch.save(state, tmp_path / "model_3.pt")
    timed = bench_rollout.replay([str(tmp_path / f"model_{i}.pt") for i in (1, 2, 3)], "float32")
    assert [c for _, c in timed["stats"]["patch"]] == [40, 1]
    assert {m: (len(timed["send"][m]), len(timed["apply"][m])) for m in ("patch", "bucket")} == {
        "patch": (2, 2), "bucket": (2, 2)}


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_bench_rollout_learning_stops_its_jobs_when_one_fails_or_is_interrupted(monkeypatch, tmp_path, error):
    """One job fails (or Ctrl-C arrives) while the other runs its hour-long job: learning calls stop_all, which
    stops the running job and lets no queued one start, before the pool's exit waits for them, then re-raises.
    Here each other job waits until stop_all (a stand-in that records the call) releases it.

    Mutant: no stop_all() in learning's except -> the pool's exit waits for the running job: learning does not
    return. Mutant: `except Exception` for `except BaseException` -> the same for KeyboardInterrupt."""
    br = load_bench("bench_rollout")
    running, released, stops, outcome = threading.Event(), threading.Event(), [], {}

    def train(preset, flags, root, name, nice=0):
        if name == "coloc_s1":
            running.wait(BOUND_S)          # the pool's other thread is in its job when this one fails
            raise error("coloc_s1 failed")
        running.set()
        released.wait()
        raise RuntimeError(f"{name} stopped")      # as run_child's job, once stopped

    def stop_all():
        stops.append(running.is_set())
        released.set()

    def call():
        try:
            br.learning(types.SimpleNamespace(seeds=[1, 2]), str(tmp_path))
        except BaseException as exc:   # KeyboardInterrupt included
            outcome["raised"] = exc
    monkeypatch.setattr(br, "train", train)
    monkeypatch.setattr(br, "stop_all", stop_all)
    thread = threading.Thread(target=call)
    thread.start()
    thread.join(BOUND_S)
    returned = not thread.is_alive()
    released.set()      # a failing case: let the jobs and the test end
    thread.join()
    assert returned, "learning waited for its running job: stop_all was not called before the pool's exit"
    assert stops == [True]              # once, while the other job ran
    assert type(outcome["raised"]) is error and str(outcome["raised"]) == "coloc_s1 failed"


def stopped_part(monkeypatch, br, failing: str, error) -> tuple[list, list]:
    """br with every part stubbed: `failing` makes its root, leaves a job's log there and raises `error`; the others
    raise AssertionError if they run. Returns (the failing part's roots, stop_all's calls)."""
    roots, stops = [], []

    def fail(args, root):
        os.makedirs(root)
        (Path(root) / "job.log").write_text("a job's output")
        roots.append(root)
        raise error("stopped in " + failing)
    for part in ("throughput", "weight_sync", "learning"):
        monkeypatch.setattr(br, part, fail if part == failing else lambda *a, part=part: (_ for _ in ()).throw(
            AssertionError(f"{part} ran")))
    monkeypatch.setattr(br, "stop_all", lambda: stops.append(True))
    return roots, stops


def test_bench_rollout_interrupted_throughput_removes_its_run_folder_and_stops_all(monkeypatch, capsys, tmp_path):
    """Ctrl-C (or SIGTERM, raised as KeyboardInterrupt) in the throughput part: its jobs are stopped and the run_*
    folder under --out goes, with what the jobs wrote in it; the interrupt goes on up (stopped_main's one line).

    Mutant: the `except KeyboardInterrupt` branch dropped -> run_* kept as after a failure.
    Mutant: no stop_all() in it -> no call recorded. Mutant: no rmtree in it -> run_* kept."""
    br = load_bench("bench_rollout")
    roots, stops = stopped_part(monkeypatch, br, "throughput", KeyboardInterrupt)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["bench_rollout.py", "--quick", "--parts", "throughput", "sync", "--out",
                                      str(out)])
    with pytest.raises(KeyboardInterrupt):
        br.main()
    assert len(roots) == 1 and Path(roots[0]).parent.parent == out and Path(roots[0]).parent.name.startswith("run_")
    assert os.listdir(out) == [] and stops == [True]
    assert "kept" not in capsys.readouterr().err


def test_bench_rollout_failed_sync_part_keeps_its_run_folder_and_names_it(monkeypatch, capsys, tmp_path):
    """A job of the sync part fails (RuntimeError with the log's tail): run_* stays, with the job's log, and the
    last line on stderr says where, before the error goes on up.

    Mutant: the `except BaseException` branch dropped -> nothing on stderr. Mutant: it removes run_* as the
    KeyboardInterrupt branch does -> the log is gone."""
    br = load_bench("bench_rollout")
    roots, _ = stopped_part(monkeypatch, br, "weight_sync", RuntimeError)
    monkeypatch.setattr(br, "throughput", lambda args, root: None)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["bench_rollout.py", "--quick", "--parts", "throughput", "sync", "--out",
                                      str(out)])
    with pytest.raises(RuntimeError, match="^stopped in weight_sync$"):
        br.main()
    [scratch] = out.glob("run_*")
    assert roots == [str(scratch / "sync")]
    assert (scratch / "sync" / "job.log").read_text() == "a job's output"
    said = capsys.readouterr().err.splitlines()
    assert said[-1:] == [f"bench_rollout: the jobs' run directories are kept in {scratch}"]
