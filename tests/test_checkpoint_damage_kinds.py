"""Damage that passes the archive's CRC-32s (a file rewritten by torch.save) but holds state no healthy run saves
(optimizer settings and moments that are not those of the Adam syncppo builds, an LR that is no number, an RNG state
that fits no generator, a negative std or count): each is one UsageError naming the file and the entry, where it used
to be a traceback from the first optimizer step, a sampler draw, or a resume that silently carried it on."""

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
    """As root the tests cannot lose read permission, so open() is made to refuse the file as it would (mode 000).
    The line reads as a sentence after `--resume PATH is` (it read `is cannot be read`, found with a mode-000 newest
    checkpoint under `--resume auto`).
    Mutant: the reason back to "cannot be read (...)" fails the match on "is a file this process cannot read"."""
    path = _saved(tmp_path, _state())
    real_open = builtins.open

    def refusing(name, *args, **kwargs):
        if str(name) == path:
            raise PermissionError(13, "Permission denied", name)
        return real_open(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", refusing)
    with pytest.raises(UsageError, match=r"^--resume '.*' is a file this process cannot read \(Permission denied\): "
                                         r"check its permissions$"):
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


def test_adam_betas_of_three_numbers_are_damage(tmp_path):
    """Adam unpacks `beta1, beta2 = group["betas"]` at its first step: a third number, each in [0, 1), is not Adam's
    settings and must be refused when the file is read, not as a ValueError traceback after the first rollout."""
    path = _saved(tmp_path, _with_group(betas=(0.9, 0.999, 0.5)))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its optimizer param group 0 has betas (0.9, 0.999, 0.5) "
                              f"and weight_decay 0.0, not Adam's settings); resume from another checkpoint")


def test_an_integer_tensor_lr_is_not_a_number(tmp_path):
    """A run saves its LR as a number, or under --ppo.capture-step as a one-element float tensor: an integer tensor is
    no LR any run writes (a damaged file), refused by name like a two-element one."""
    path = _saved(tmp_path, _with_group(lr=torch.tensor(3)))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its optimizer param group 0 has lr tensor(3), not a "
                              f"number); resume from another checkpoint")


def test_adam_moments_with_an_extra_tensor_are_not_adam_s(tmp_path):
    """Adam's state per parameter is exactly step, exp_avg and exp_avg_sq: a fourth tensor (AMSGrad's
    max_exp_avg_sq, which this version never writes) is refused, not carried into the resumed optimizer."""
    path = _saved(tmp_path, _with_moments(max_exp_avg_sq=torch.zeros(2)))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its optimizer state for parameter 0 is not Adam's "
                              f"(tensors exp_avg, exp_avg_sq and a one-element step), got ['exp_avg', 'exp_avg_sq', "
                              f"'max_exp_avg_sq', 'step']); resume from another checkpoint")


def test_a_weight_decay_of_true_is_not_adam_s_setting(tmp_path):
    """A bool is no number here (True is 1 to Python, and Adam would decay every weight by 1.0 per step): the group
    is refused as not Adam's settings."""
    path = _saved(tmp_path, _with_group(weight_decay=True))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its optimizer param group 0 has betas (0.9, 0.999) and "
                              f"weight_decay True, not Adam's settings); resume from another checkpoint")


def test_an_rng_state_shorter_than_a_gpu_generator_s_is_refused(tmp_path):
    """A cuda generator's state is exactly 16 bytes (Philox seed and offset), a CPU one's 5056: a 12-byte state (a
    truncated one, whose bytes past the 8th read as an offset of 0) fits neither generator."""
    path = _saved(tmp_path, _state(rng=[{"torch": torch.get_rng_state(), "env": torch.zeros(12, dtype=torch.uint8)}]))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its rng[0]['env'] (12 bytes) is not the state of a torch "
                              f"generator); resume from another checkpoint")


@pytest.mark.parametrize("changes, what", [
    # the observation normalizer's std, a model buffer: a negative one flips the sign of a normalized observation
    ({"model": {"w": torch.tensor([0.5, -1.0]), "obs_normalizer.std": torch.tensor([1.0, -0.5])}},
     "a negative value (-0.5) in its model['obs_normalizer.std'], a standard deviation"),
    ({"reward_normalizer": {"count": torch.tensor(4.0, dtype=torch.float64), "std": torch.tensor(-2.0)}},
     "a negative value (-2) in its reward_normalizer['std'], a standard deviation"),
    # the motion sampler's counts of this rank's episodes, saved beside the summed ones (envs/motions.py)
    ({"env": {"sampler": {"global_counts": torch.zeros(3, dtype=torch.float64),
                          "local_counts": torch.tensor([1.0, -3.0, 0.0], dtype=torch.float64)}}},
     "a negative value (-3) in its env['sampler']['local_counts'], a count"),
], ids=["obs-std", "reward-std", "local-counts"])
def test_a_negative_std_or_local_sampler_count_is_refused_naming_it(tmp_path, changes, what):
    path = _saved(tmp_path, _state(**changes))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == f"--resume {path!r} has {what}{DIVERGED}"


def test_an_optimizer_group_with_decoupled_weight_decay_is_refused(tmp_path):
    """decoupled_weight_decay=True turns torch's Adam into AdamW, which no syncppo run builds: loaded as saved, it
    would change how the weight decay acts.

    Mutant: "decoupled_weight_decay" dropped from ADAM_VARIANTS."""
    path = _saved(tmp_path, _with_group(decoupled_weight_decay=True))
    with pytest.raises(UsageError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == (f"--resume {path!r} is damaged (its optimizer param group 0 has "
                              f"{{'decoupled_weight_decay': True}}, which the Adam syncppo builds never has); resume "
                              f"from another checkpoint")
