"""What train.py prints and logs each iteration, against values from the docs and by hand: the last iteration on
the console whatever --log.print-every says, TensorBoard's steps and loss terms, Perf/total_fps over every rank's
transitions, the learning time every rank logs, and Loss/entropy counted once."""

import glob
import math
import os
import re
from pathlib import Path

import pytest

import train
from tests.multirank import run_ranks
from tests.test_faults import tb_steps
from tests.test_sync_contract import phase_times_body
from tests.test_train import small_tracking, train_body


def test_the_last_iteration_is_printed_whatever_print_every_says(tmp_path, capsys):
    """--log.print-every 2 over 3 iterations: iteration 2 by the cadence, and 3, the last, always (the run's final
    state reaches the console even when the cadence does not land on it); iteration 1 is not printed."""
    cfg = small_tracking(tmp_path, iterations=3)
    cfg.log.print_every = 2
    _, scalars, _ = train.main(cfg)
    printed = re.findall(r"^it +(\d+)/3 ", capsys.readouterr().out, re.MULTILINE)
    assert printed == ["2", "3"]
    # TensorBoard has every iteration at its own number, 1 to 3, and the update's three loss terms are logged
    (run_dir,) = glob.glob(os.path.join(tmp_path, "tracking", "*"))
    assert tb_steps(run_dir) == [1, 2, 3]
    assert {"Loss/surrogate", "Loss/value_function", "Loss/entropy"} <= scalars.keys()


@pytest.mark.slow
def test_total_fps_counts_the_transitions_of_every_rank(tmp_path):
    """Perf/total_fps is the whole job's rate: 2 ranks x 16 envs x 8 steps = 256 transitions per iteration over the
    iteration's collection + learning time, not one rank's 128."""
    (_, scalars), _ = run_ranks(train_body, 2, args=(small_tracking(tmp_path, iterations=1),))
    seconds = scalars["Perf/collection_time"] + scalars["Perf/learning_time"]
    assert scalars["Perf/total_fps"] * seconds == pytest.approx(2 * 16 * 8, rel=1e-9)


def test_the_logged_entropy_is_the_policy_s_whole_entropy(tmp_path):
    """Loss/entropy is the mean of the update's steps' entropies, each logged once: with an LR of 1e-9 the policy
    stays at its start, 6 independent joints of std --policy.init-noise-std 1, whose entropy is 6 x ln(2 pi e) / 2
    by hand (a term counted twice, or halved, is off by 4.3)."""
    cfg = small_tracking(tmp_path, iterations=1)
    cfg.ppo.schedule, cfg.ppo.learning_rate = "fixed", 1e-9
    _, scalars, _ = train.main(cfg)
    assert scalars["Loss/entropy"] == pytest.approx(3 * math.log(2 * math.pi * math.e), abs=1e-5)


@pytest.mark.slow
def test_every_rank_logs_the_least_waiting_update_not_its_own(tmp_path):
    """Mutant: the learning time read from this rank's clock instead of the reduced one (the minimum over ranks). Rank
    1's updates read 1000 s long; every rank logs rank 0's (real, under a minute) and total_fps uses it."""
    logged = run_ranks(phase_times_body, 2, args=(str(tmp_path), "update"))
    for scalars in logged:
        assert 0.0 < scalars["Perf/learning_time"] < 60
        both = scalars["Perf/collection_time"] + scalars["Perf/learning_time"]
        assert scalars["Perf/total_fps"] == 2 * 8 * 8 / both
    assert logged[0]["Perf/learning_time"] == logged[1]["Perf/learning_time"]


def documented_tags() -> set[str]:
    """The backticked names in the first column of docs/running.md's table of TensorBoard tags."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "running.md").read_text()
    rows = text.split("\n## What a run writes\n", 1)[1].split("\n\n| tag |", 1)[1].split("\n\n", 1)[0]
    return {name for row in rows.splitlines()[2:] for name in re.findall(r"`([^`]+)`", row.split(" | ")[0])}


def test_every_tag_a_run_logs_is_in_the_docs_table(tmp_path):
    """Every scalar tag in a tracking run's event file, Episode/return included, is a row of docs/running.md's table
    (Loss/, Policy/ and tracking's Episode/ tags were documented nowhere); Comm/ tags by their pattern.
    Mutant: train.py logs the noise std as Policy/noise_std (or its row is dropped from the table)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = small_tracking(tmp_path, iterations=3)
    cfg.log.episode_returns = True
    train.main(cfg)
    (run_dir,) = glob.glob(os.path.join(tmp_path, "tracking", "*"))
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"Train/mean_reward", "Episode/return", "Episode/body_error", "Policy/mean_noise_std"} <= tags
    patterns = {re.sub(r"Comm/\w+_(calls|bytes)", r"Comm/<purpose>_\1", tag) for tag in tags}
    assert patterns - documented_tags() == set()
    assert {"Comm/<purpose>_calls", "Comm/<purpose>_bytes", "Perf/policy_lag"} <= documented_tags()
