"""ppo/evaluate.py on an Isaac Lab checkpoint (`make eval CKPT=... PRESET=isaaclab`), through the adapter against
tests/fake_isaaclab.py: scored as counted by hand with the exported policy, in the run's launcher settings or the ones
typed, and ended by Kit with evaluate's own status. The fake simulates on the CPU (see tests/test_env_isaaclab.py)."""

import glob
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import train
from envs.isaaclab import IsaacLabEnv
from ppo import evaluate as evaluation
from tests.fake_isaaclab import MAX_EPISODE_LENGTH, TASK, install_for_test
from tests.forked_python import run_python
from tests.test_env_isaaclab import fake  # noqa: F401 - the fixture that installs the fake Isaac Lab
from tests.test_env_isaaclab_runs import small_run
from tests.test_evaluate import by_hand, relabelled
from tests.test_export_inputs import REPO


@pytest.fixture(scope="module")
def isaac_checkpoint(tmp_path_factory) -> str:
    """Two iterations of the isaaclab preset through the fake, with a privileged critic and launcher flags of its own
    (a visualizer) that an evaluation of it starts with too."""
    root = tmp_path_factory.mktemp("eval_isaaclab")
    with pytest.MonkeyPatch.context() as patch:
        install_for_test(patch)
        patch.setattr(torch.cuda, "is_available", lambda: False)     # the fake simulates on the CPU
        cfg = small_run(root)
        cfg.env.launcher_args = "--viz newton"
        train.main(cfg)
    (ckpt,) = glob.glob(str(root / "isaaclab" / "*" / "model_2.pt"))
    return ckpt


def test_an_isaac_lab_checkpoint_is_scored_through_the_adapter_as_counted_by_hand(isaac_checkpoint, fake, monkeypatch):
    """9 episodes on 3 envs, 3 each, the first of each env (its length spread over the time limit at reset) left out;
    the evaluation starts Isaac Lab with the run's launcher flags (its visualizer) and the seed given.
    Mutants: the isaaclab refusal kept in saved_env -> ValueError; the run's --env.launcher-args dropped -> no
    visualizer. (The accumulators on the env's device matter on a GPU only: the fake simulates on the CPU.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    scores = evaluation.evaluate(isaac_checkpoint, episodes=9, num_envs=3, seed=4, stochastic=True,
                                 progress=lambda line: None)
    launch = fake.launches[0]
    assert (launch["visualizer"], launch["seed"], launch["num_envs"]) == (["newton"], 4, 3)
    # The exported mean action plus the model's std times standard normals (under its mean action the fake's point
    # mass runs every episode alike), on an adapter built here with the run's observation groups.
    returns, lengths = by_hand(isaac_checkpoint, 3, 3, 4, stochastic=True, make=lambda num_envs, seed: IsaacLabEnv(
        TASK, num_envs, torch.device("cpu"), seed, critic_obs_groups=("policy", "critic")))
    assert scores["episodes"] == len(returns) == 9
    r, n = np.array(returns), np.array(lengths)
    expected = {"return_mean": r.mean(), "return_std": r.std(), "return_min": r.min(), "return_max": r.max(),
                "length_mean": n.mean(), "length_std": n.std()}
    assert {k: scores[k] for k in expected} == pytest.approx(expected, rel=1e-6)
    assert len(set(returns)) == 9 and set(lengths) <= set(range(1, MAX_EPISODE_LENGTH + 1))


def test_typed_env_settings_replace_the_runs_and_are_checked_as_in_training(isaac_checkpoint, fake, monkeypatch):
    """--env.launcher-args (to watch the policy in a viewer, say) and --env.task-overrides (another physics preset)
    replace the run's, checked by the adapter as in training. Mutants: the typed settings ignored -> the run's
    visualizer and physics."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    evaluation.evaluate(isaac_checkpoint, episodes=3, num_envs=3, progress=lambda line: None,
                        typed={"launcher_args": "--viz kit", "task_overrides": ["physics=ovphysx"]})
    assert (fake.launches[-1]["visualizer"], fake.launches[-1]["physics"]) == (["kit"], "ovphysx")
    with pytest.raises(ValueError, match="--env.launcher-args: Isaac Lab's launcher does not know --frame-rate 5"):
        evaluation.evaluate(isaac_checkpoint, episodes=3, num_envs=3, typed={"launcher_args": "--frame-rate 5"})
    with pytest.raises(ValueError, match=r"unknown --env.task 'Isaac-Velocity-Rough-G2' for Isaac Lab; did you mean: "
                                         r"Isaac-Velocity-Rough-G1"):
        evaluation.evaluate(isaac_checkpoint, episodes=3, num_envs=3, typed={"task": "Isaac-Velocity-Rough-G2"})


def test_typed_env_settings_are_refused_by_envs_that_do_not_take_them():
    """Which checkpoints take which typed setting: a task for gymnasium and Isaac Lab, task overrides and launcher
    flags for Isaac Lab; the rest of the run's settings stay. Mutant: the per-env refusal left out -> no error."""
    gym = evaluation.saved_env({"env": {"name": "gymnasium", "task": "Hopper-v4", "action_scale": 2.0}}, "m.pt", 4,
                               {"task": "Hopper-v5"})
    assert (gym.task, gym.action_scale, gym.num_envs) == ("Hopper-v5", 2.0, 4)
    isaac = evaluation.saved_env({"env": {"name": "isaaclab", "task": "T", "task_overrides": ["physics=physx"]}},
                                 "m.pt", 4, {"task_overrides": []})
    assert (isaac.task, isaac.task_overrides) == ("T", ())
    for name, value, flag, envs in (("launcher_args", "--viz kit", "--env.launcher-args", "isaaclab"),
                                    ("task_overrides", ["physics=physx"], "--env.task-overrides", "isaaclab"),
                                    ("task", "CartPole-v1", "--env.task", "gymnasium and isaaclab")):
        with pytest.raises(ValueError, match=rf"^{flag} is for {envs} checkpoints, but CKPT 'm.pt' trained on "
                                             rf"cartpole: leave the flag out$"):
            evaluation.saved_env({"env": {"name": "cartpole"}}, "m.pt", 4, {name: value})
    with pytest.raises(ValueError, match="--env.task-overrides is for isaaclab checkpoints, but CKPT 'm.pt' trained "
                                         "on gymnasium"):
        evaluation.saved_env({"env": {"name": "gymnasium", "task": "Hopper-v4"}}, "m.pt", 4, {"task_overrides": []})


def test_an_isaac_lab_checkpoint_without_isaac_lab_names_where_to_run_it(isaac_checkpoint, monkeypatch):
    """A GPU but no Isaac Lab in this environment (.venv): the adapter's install hint, then the make command that
    evaluates in Isaac Lab's environment. Mutant: the hint's `PRESET=isaaclab` tail left out."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # fails at the import, before touching a GPU
    for name in ("isaaclab", "isaaclab_tasks"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ValueError, match=r"--env.name isaaclab needs Isaac Lab 3.0 .*make setup-isaaclab.*; make eval "
                                         r"CKPT=\.\.\. PRESET=isaaclab runs it there$"):
        evaluation.evaluate(isaac_checkpoint, episodes=3, num_envs=3)


EVAL_UNDER_KIT = """
import runpy, sys
import torch
torch.cuda.is_available = lambda: False      # the fake simulates on the CPU
import tests.fake_isaaclab as fake
fake.install(rank=0)
close = fake.FakeKitLauncher.close

def said_close(kit, exit_code=0):            # Kit ends the process in its close: say with which status first
    print(f"[kit] closed with {exit_code}", flush=True)
    close(kit, exit_code)

fake.FakeKitLauncher.close = said_close
sys.argv[0] = "ppo/evaluate.py"
runpy.run_module("ppo.evaluate", run_name="__main__")
"""


@pytest.mark.slow      # two processes, each importing the project
def test_kit_ends_the_evaluation_with_its_status(isaac_checkpoint, tmp_path):
    """Under a physics preset that starts Kit (which ends the process when it closes, at exit), typed on the command
    line or saved with the run: a score is printed and Kit ends the process with 0; a policy that does not fit the
    built env (found after Kit started) is one `error:` line and Kit ends the process with 2, not 0. Mutants:
    evaluate's main not recording SystemExit(2) for the exit handlers -> 0; the typed --env.task-overrides not handed
    on -> no Kit."""
    kit = relabelled(isaac_checkpoint, tmp_path / "model_2.pt", task_overrides=["physics=isaacsim_physx"])
    typed = ["--env.task-overrides", "physics=isaacsim_physx"]         # the same physics, typed instead of saved
    result = run_python(["-c", EVAL_UNDER_KIT, isaac_checkpoint, "--episodes", "2", "--num-envs", "2", *typed],
                        cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("2 episodes (2 envs, mean action): return ") and lines[1:] == ["[kit] closed with 0"]
    unfit = relabelled(kit, tmp_path / "model_3.pt", actor_obs_groups=["policy", "critic"])
    result = run_python(["-c", EVAL_UNDER_KIT, unfit], cwd=REPO, timeout=120)
    assert result.returncode == 2 and result.stdout == "[kit] closed with 2\n", (result.stdout, result.stderr)
    assert result.stderr.startswith("error: CKPT ") and "its policy's actor observation size 3 (the env's: 7) does " \
        "not fit the isaaclab Isaac-Velocity-Rough-G1 env" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_make_eval_with_preset_isaaclab_runs_in_isaac_labs_environment(tmp_path):
    """PRESET=isaaclab: the command runs Isaac Lab's Python (ISAACLAB_VENV), as make train does; without it, one line
    naming make setup-isaaclab before anything runs. Mutants: .venv's python for Isaac Lab -> the adapter's import
    fails; the check left out -> make's own `No such file` error."""
    venv = tmp_path / "venv-isaaclab"
    os.makedirs(venv / "bin")
    os.symlink(sys.executable, venv / "bin" / "python")
    result = subprocess.run(["make", "--no-print-directory", "-n", "eval", "CKPT=m.pt", "PRESET=isaaclab",
                             f"ISAACLAB_VENV={venv}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert f"'{venv}'/bin/python -m ppo.evaluate 'm.pt'" in result.stdout, result.stdout
    result = subprocess.run(["make", "--no-print-directory", "eval", "CKPT=m.pt", "PRESET=isaaclab",
                             f"ISAACLAB_VENV={tmp_path / 'none'}"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and result.stderr.startswith(
        f"error: PRESET=isaaclab evaluates in {tmp_path / 'none'}/bin/python; it is not there: make setup-isaaclab "
        f"first"), result.stderr
