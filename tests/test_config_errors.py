"""Bad input fails before anything is built, with a message naming the flag to fix."""

import subprocess
import sys

import pytest
import torch

import train
from configs import preset, resolve_num_envs, validate
from dist.errors import UsageError


def cfg_with(**changes):
    cfg = preset("tracking")
    for dotted, value in changes.items():
        section, field = dotted.split("__") if "__" in dotted else (None, dotted)
        setattr(getattr(cfg, section) if section else cfg, field, value)
    return cfg


@pytest.mark.parametrize("changes, flag", [
    ({"env__num_envs": 510}, "--env.num-envs"),                 # not divisible by 4 minibatches
    ({"env__num_envs": 0}, "--env.num-envs"),
    ({"ppo__num_steps": -1}, "--ppo.num-steps"),
    ({"ppo__num_mini_batches": 0}, "--ppo.num-mini-batches"),
    ({"ppo__num_epochs": 0}, "--ppo.num-epochs"),
    ({"max_iterations": 0}, "--max-iterations"),
    ({"ppo__gamma": 1.5}, "--ppo.gamma"),
    ({"ppo__lam": -0.1}, "--ppo.lam"),
    ({"ppo__learning_rate": 1.0}, "--ppo.learning-rate"),
    ({"policy__actor_hidden": (64, 0)}, "--policy.actor-hidden"),
    ({"ppo__num_micro_batches": 5}, "--ppo.num-micro-batches"),   # 512 x 24 / 4 = 3072 transitions, not / 5
    ({"dist__bucket_mb": 0.0}, "--dist.bucket-mb"),
    ({"dist__verify_every": -1}, "--dist.verify-every"),
    ({"dist__sampler_sync_every": 0}, "--dist.sampler-sync-every"),
])
def test_bad_values_name_the_flag(changes, flag):
    with pytest.raises(ValueError, match=flag.replace(".", r"\.")):
        validate(cfg_with(**changes))


def test_global_env_budget_splits_across_ranks_or_fails():
    cfg = cfg_with(env__global_num_envs=1024)
    assert "512 per rank" in resolve_num_envs(cfg, 2) and cfg.env.num_envs == 512
    with pytest.raises(ValueError, match="--env.global-num-envs 1000 is not divisible by the world size 3"):
        resolve_num_envs(cfg_with(env__global_num_envs=1000), 3)
    per_rank = cfg_with()
    assert "per rank" in resolve_num_envs(per_rank, 4) and per_rank.env.num_envs == 512


def test_resume_path_errors(tmp_path):
    with pytest.raises(UsageError, match="--resume .* does not exist"):
        train.main(cfg_with(resume=str(tmp_path / "missing.pt")))
    with pytest.raises(ValueError, match="directory"):
        train.main(cfg_with(resume=str(tmp_path)))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable torch checkpoint"):
        train.main(cfg_with(resume=str(garbage)))
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(ValueError, match="not a syncppo checkpoint"):
        train.main(cfg_with(resume=str(foreign)))


def run_cli(*args):
    return subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True, timeout=120)


def test_cli_unknown_preset_and_help():
    bad = run_cli("walker")
    assert bad.returncode != 0 and "cartpole" in bad.stderr + bad.stdout       # lists the valid presets
    help_text = run_cli("tracking", "--help").stdout
    for flag in ("--env.num-envs", "--ppo.num-epochs", "--ppo.desired-kl", "--log.save-every", "--resume"):
        assert flag in help_text
    assert "environments per rank" in help_text                                 # field help strings are shown
    typo = run_cli("tracking", "--ppo.num-epoch", "3")
    assert typo.returncode != 0 and "num-epochs" in typo.stderr + typo.stdout
