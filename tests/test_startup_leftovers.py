"""Four start-up refusals that were missing or came in the wrong order: a flag given twice (tyro kept the last, unsaid),
a tracking motion library larger than the memory (the OOM killer's exit 137, no message), --resume auto picking an
old run of another env (no way out named), and a typed flag the env never reads said only after --resume looked for
the run. Each is one line on stderr, exit status 2, before anything is built."""

import os

import pytest

from configs.typed_flags import typed_flags
from test_cli_adversarial import assert_one_line_error
from test_config_errors import run_cli


# ---- 1. a flag given twice ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--seed", "1", "--seed", "2"], "--seed is given twice (1, then 2); keep one"),
    (["--seed=1", "--dry-run", "--seed", "2"], "--seed is given twice (1, then 2); keep one"),
    (["--policy.actor-hidden", "64", "64", "--policy.actor-hidden", "8"],
     "--policy.actor-hidden is given twice (64 64, then 8); keep one"),
    (["--ppo.num-epochs", "3", "--ppo.num_epochs", "4"],      # tyro takes both spellings of the field
     "--ppo.num-epochs is given twice (--ppo.num-epochs 3, then --ppo.num_epochs 4); keep one"),
    (["--ppo.normalize-rewards", "--ppo.no_normalize_rewards"],
     "--ppo.normalize-rewards is given twice (--ppo.normalize-rewards, then --ppo.no_normalize_rewards); keep one"),
    (["--log.experiment=", "--seed", "1", "--log.experiment", "x"],
     "--log.experiment is given twice ('', then x); keep one"),
    (["--seed", "1", "--seed", "1", "--seed", "3"], "--seed is given 3 times (1, 1, then 3); keep one"),
])
def test_a_flag_given_twice_is_named_with_every_value(argv, message):
    """Mutant: typed_flags without setting `repeated` -> it is None, not the message."""
    flags = typed_flags(["cartpole", *argv])
    assert flags.repeated == message
    assert typed_flags(["cartpole", "--seed", "1", "--policy.actor-hidden", "64", "64", "--dry-run"]).repeated is None


def test_cli_refuses_a_flag_given_twice_before_anything_is_written(tmp_path):
    """`train.py cartpole --seed 1 --seed 2` trained with seed 2, unsaid.
    Mutant: typed_task without the `repeated` check -> the dry run exits 0."""
    root = tmp_path / "runs"
    out = run_cli("cartpole", "--seed", "1", "--dry-run", "--log.root", str(root), "--seed", "2")
    assert_one_line_error(out, "error: --seed is given twice (1, then 2); keep one")
    assert not os.path.exists(root)


# ---- 4. a typed flag the env never reads, before --resume looks for the run ----------------------------------------

def test_a_flag_of_another_env_is_refused_before_resume_auto_looks_for_a_run(tmp_path):
    """`cartpole --env.num-motions 5 --resume auto` with no run said "--resume auto: no checkpoint": fixed, the run
    would still refuse the flag. --env.name is a launch setting, never the checkpoint's: no checkpoint is needed.
    Mutant: typed_task without check_typed_flags of the env's flags -> the first line is resume's."""
    out = run_cli("cartpole", "--env.num-motions", "5", "--resume", "auto", "--log.root", str(tmp_path / "runs"))
    assert_one_line_error(out, "error: --env.num-motions applies only with --env.name tracking (the run uses cartpole)")
    assert not os.path.exists(tmp_path / "runs")
