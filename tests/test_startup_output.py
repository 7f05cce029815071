"""What a run prints, as docs/running.md's Start-up section says: with rollout ranks the start-up counts the envs of all
of a learner's rollout ranks and names the mapping; rank 0 prints a console line every --log.print-every iterations
and at the last (1 by default, 10 in the mujoco preset)."""

import contextlib
import glob
import io
import os

import pytest

import train
from configs import preset
from tests.multirank import run_ranks
from tests.test_rollout_ranks import small as small_rollout
from tests.test_train import small_tracking


def test_rank_0_prints_every_print_every_iterations_and_the_last(tmp_path, capsys):
    """5 iterations with --log.print-every 2: lines after iterations 2 and 4, and after 5, the last; before them the
    start-up names the run directory it writes to.
    Mutant: the cadence counted from iteration 0 (`iteration % print_every`): lines after 1, 3 and 5.
    Mutant: the `writing to` line dropped."""
    cfg = small_tracking(tmp_path, iterations=5)
    cfg.log.print_every = 2
    train.main(cfg)
    out = capsys.readouterr().out
    (run_dir,) = glob.glob(os.path.join(tmp_path, "tracking", "*"))
    assert f"\n[syncppo] writing to {run_dir}\n" in out
    lines = [line.split()[1] for line in out.splitlines() if line.startswith("it ")]
    assert lines == ["2/5", "4/5", "5/5"]
    assert preset("tracking").log.print_every == 1 and preset("mujoco").log.print_every == 10


def test_a_restart_before_the_first_checkpoint_says_it_starts_over(tmp_path, capsys, monkeypatch):
    """A torchrun restart whose first attempt died before its first save continues in that run's directory from
    iteration 0, and said nothing about it (a restart with a checkpoint says `resumed ...`). Once it has a
    checkpoint, the restart resumes and the line has no such note.
    Mutant: the note printed without `restarted` (a first start says it too); without `not resume_path` (the
    resumed restart says it)."""
    run_dir = tmp_path / "tracking" / "2026-01-01_00-00-00"
    run_dir.mkdir(parents=True)
    (run_dir / "run_id").write_text("job-3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-3")
    train.main(small_tracking(tmp_path / "first", iterations=1))
    assert "starting over" not in capsys.readouterr().out
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    train.main(small_tracking(tmp_path, iterations=2))
    out = capsys.readouterr().out
    assert f"\n[syncppo] writing to {run_dir} (a restart before the run's first checkpoint: starting over)\n" in out
    train.main(small_tracking(tmp_path, iterations=3))
    out = capsys.readouterr().out
    assert "[syncppo] resumed " in out and f"\n[syncppo] writing to {run_dir}\n" in out


def dry_run_output(rank, world_size, cfg):
    """A dry run on this rank; what it printed (rank 0 alone prints the start-up)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train.main(cfg)
    return printed.getvalue()


@pytest.mark.slow
def test_the_start_up_counts_the_envs_of_all_a_learner_s_rollout_ranks(tmp_path):
    """1 learner + 2 rollout ranks of 16 envs x 8 steps: --env.num-envs is per rollout rank, the learner trains on
    1 x 32 envs x 8 steps = 256 transitions per iteration (N is the envs of both its rollout ranks), and the mapping
    line names both.
    Mutant: the start-up's transitions line counts --env.num-envs (one rollout rank's envs) in place of N."""
    cfg = small_rollout(tmp_path, iterations=1, ranks=2)
    cfg.dry_run = True
    out = run_ranks(dry_run_output, 3, args=(cfg,))[0]
    assert out.startswith("[syncppo] world size 3, backend gloo, device cpu (one per rank); --env.num-envs 16 is per "
                          "rollout rank\n"), out
    assert "\n[syncppo] 1 learner(s) + 2 rollout rank(s): learner 0 <- rollout ranks [1, 2]; sync (on-policy)" in out
    assert "\n[syncppo] 1 learner(s) x 32 envs x 8 steps = 256 transitions per iteration\n" in out
