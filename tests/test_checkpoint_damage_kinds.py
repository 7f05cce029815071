"""Damage that passes the archive's CRC-32s (a file rewritten by torch.save) but holds state no healthy run saves,
found by fuzzing real checkpoints: each is one UsageError naming the file and the entry, where it used to be a
traceback from the first optimizer step, a sampler draw, or a resume that silently carried it on."""

import builtins
import re

import pytest
import torch

import train
from dist.checkpoint_read import load_checkpoint
from dist.errors import UsageError
from tests.test_checkpoint_read_rules import _config, _saved, _state, _with_group, _with_moments
from tests.test_checkpoint_values import SMALL, damaged, trained  # noqa: F401 (trained: a fixture)
from tests.test_config_errors import cfg_with


def _two_parameters(state: dict) -> dict:
    """Adam's state for parameters 0 and 1 (groups list both), then `state` entries keyed as given replace it."""
    moments = {"step": torch.tensor(3.0), "exp_avg": torch.tensor([0.1, -0.2]),
               "exp_avg_sq": torch.tensor([0.01, 0.04])}
    base = _state(model={"w": torch.tensor([0.5, -1.0]), "v": torch.tensor([2.0, 1.0])})
    base["optimizer"] = {"param_groups": [{"params": [0, 1], "lr": 1e-3, "betas": (0.9, 0.999)}],
                         "state": {k: dict(moments) for k in state}}
    return base


def _without_moment(name: str) -> dict:
    state = _state()
    del state["optimizer"]["state"][0][name]
    return state


def _config_with_key(key) -> dict:
    config = _config()
    config["ppo"] = {**config["ppo"], key: 1}
    return config


DIVERGED = ": the file is damaged or its run diverged; resume from an earlier model_<k>.pt"


@pytest.mark.parametrize("state, what", [
    (_without_moment("exp_avg_sq"), "is damaged (its optimizer state for parameter 0 is not Adam's (tensors exp_avg, "
                                    "exp_avg_sq and a one-element step), got ['exp_avg', 'step'])"),
    (_with_moments(exp_avg=0.5), "is damaged (its optimizer state for parameter 0 is not Adam's"),
    (_with_moments(step=torch.tensor([3.0, 3.0])), "is damaged (its optimizer state for parameter 0 is not Adam's"),
    (_two_parameters([1]), "is damaged (its optimizer state covers parameters [1], its param groups [0, 1] (every "
                           "one after the first step, none before))"),
    (_two_parameters(["0", 1]), "is damaged (its optimizer state covers parameters ['0', 1], its param groups"),
    (_with_group(betas="x"), "is damaged (its optimizer param group 0 has betas 'x' and weight_decay 0.0, not "
                             "Adam's settings)"),
    (_with_group(betas=(2.0, -1.0)), "is damaged (its optimizer param group 0 has betas (2.0, -1.0)"),
    # a beta of exactly 1: Adam's bias correction 1 - beta ** step is 0, and the first step divides by it (nan)
    (_with_group(betas=(0.9, 1.0)), "is damaged (its optimizer param group 0 has betas (0.9, 1.0)"),
    (_with_group(weight_decay="x"), "is damaged (its optimizer param group 0 has betas (0.9, 0.999) and "
                                    "weight_decay 'x'"),
    # loaded as saved: amsgrad fails the first step (no max_exp_avg_sq moment), maximize ascends the loss silently
    (_with_group(amsgrad=True), "is damaged (its optimizer param group 0 has {'amsgrad': True}, which the Adam "
                                "syncppo builds never has)"),
    (_with_group(maximize=True, differentiable=None), "is damaged (its optimizer param group 0 has {'maximize': "
                                                      "True, 'differentiable': None}"),
    (_state(config=_config_with_key(5)), "is damaged (its config has a setting named 5, not a name)"),
    (_with_moments(step=torch.tensor(-5.0)),
     "has a negative value (-5) in its optimizer['state'][0]['step'], a step count" + DIVERGED),
    (_state(model={"w": torch.tensor([0.5]), "obs_normalizer.count": torch.tensor(-5.0, dtype=torch.float64)}),
     "has a negative value (-5) in its model['obs_normalizer.count'], a count" + DIVERGED),
    (_state(reward_normalizer={"count": torch.tensor(4.0), "m2": torch.tensor([-1.0])}),
     "has a negative value (-1) in its reward_normalizer['m2'], a sum of squares" + DIVERGED),
    (_state(env={"sampler": {"global_counts": torch.tensor([3.0, -5.0], dtype=torch.float64)}}),
     "has a negative value (-5) in its env['sampler']['global_counts'], a count" + DIVERGED),
], ids=["moment-missing", "moment-a-float", "two-element-step", "state-for-some", "string-index", "betas-a-string",
        "betas-out-of-range", "beta-of-one", "weight-decay-a-string", "amsgrad", "maximize",
        "config-key-not-a-name", "negative-step",
        "negative-count", "negative-m2", "negative-sampler-count"])
def test_state_no_healthy_run_saves_is_refused_naming_it(tmp_path, state, what):
    path = _saved(tmp_path, state)
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value).startswith(f"--resume {path!r} {what}")


def test_an_optimizer_state_saved_before_the_first_step_is_empty_and_loads(tmp_path):
    state = _two_parameters([])
    assert load_checkpoint(_saved(tmp_path, state))["optimizer"]["state"] == {}


def test_an_unreadable_file_says_so_instead_of_a_traceback(tmp_path, monkeypatch):
    """As root the tests cannot lose read permission, so open() is made to refuse the file as it would (mode 000)."""
    path = _saved(tmp_path, _state())
    real_open = builtins.open

    def refusing(name, *args, **kwargs):
        if str(name) == path:
            raise PermissionError(13, "Permission denied", name)
        return real_open(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", refusing)
    with pytest.raises(UsageError, match=r"cannot be read \(Permission denied\): check its permissions"):
        load_checkpoint(path)


@pytest.mark.parametrize("log_std, shown", [(100.0, "inf"), (-200.0, "0")])
def test_a_finite_log_std_no_policy_can_act_with_is_refused_before_the_run_starts(trained, tmp_path, log_std, shown):
    """exp(100) is inf in float32 and exp(-200) is 0: the rollout's actions were nan and the env was blamed ("env
    produced nan ... fix the env"), after a whole rollout. Now the resume refuses the file before the run directory
    exists."""
    path = damaged(trained, tmp_path, lambda state: state["model"]["log_std"].fill_(log_std))
    root = tmp_path / "runs"
    expected = (f"--resume {path!r} has an action noise std of {shown} (exp of its model['log_std']), which no policy "
                f"can act with: the file is damaged or its run diverged; resume from an earlier model_<k>.pt")
    with pytest.raises(UsageError, match=f"^{re.escape(expected)}$"):
        train.main(cfg_with(max_iterations=2, resume=path, log__root=str(root), **SMALL))
    assert not root.exists()


@pytest.mark.parametrize("typed", [frozenset(), None], ids=["command-line", "program-config"])
def test_a_checkpoint_of_another_env_is_refused_naming_the_file(trained, tmp_path, typed):
    """The refusal read `--env.name cartpole does not match the checkpoint's --env.name tracking` without saying
    which file was passed (a --resume auto or a run directory picks it)."""
    expected = f"--resume {trained!r}: --env.name cartpole does not match the checkpoint's --env.name tracking: "
    with pytest.raises(UsageError, match=f"^{re.escape(expected)}"):
        train.main(cfg_with(env__name="cartpole", resume=trained, log__root=str(tmp_path)), typed=typed)


def test_a_saved_env_name_that_is_no_name_is_damage(trained, tmp_path):
    """A None skipped the check that the checkpoint is this env's."""
    path = damaged(trained, tmp_path, lambda state: state["config"]["env"].update(name=None))
    with pytest.raises(UsageError, match=r"is damaged \(its config's env.name is None, not an env's name\)"):
        load_checkpoint(path)
