"""Gaps found by a mutation audit of configs/ (config.py, presets.py, ranges.py, resume.py, typed_flags.py) and
ppo/env_check.py: 299 hand-made mutants, each run against the tests of those modules (test_config_errors,
test_loop_config_rules, test_bad_input, test_setup_flags_rules, test_typed_flags, test_startup_errors, test_resume_*,
test_checkpoint_*, test_env_check* and others). 252 were killed by existing tests; each test below fails on a mutant
that every earlier test let through. Expected values are written by hand or taken from their stated source.

Pinned (28): a backslash in --log.experiment (os.sep is "/" here); --dist.timeout-s's upper bound 1e9 (1e10
passed); the init-noise-std whose variance is exactly float32's smallest normal (2**-63 squared); the simulator
package's find_spec check; the defaults the cartpole and tracking presets inherit (Adam eps as torch's, KL target,
gamma, lambda, clip, initial std, gradient norm, reward clip, collective timeout) and cartpole's entropy 0; the
isaaclab preset's lr bounds (RSL-RL's) and mujoco's unscaled actions; each preset's experiment named after it;
int64's lowest value reaching the sign check; the log section's integers held to 64 bits; --env.task in MUST_MATCH;
--ppo.capture-step and --log.experiment in LAUNCH; a typed flag equal to the checkpoint's not listed as changed;
saved_env reading a start config of another JSON layout as unknown; each half of the sampler check; reset()
returning three items; a complex number logged by the env.

Equivalent: the defaults of num-envs, num-steps, num-epochs, learning-rate (every preset sets them), episode-length-s
and num-motions (every preset that reads them sets them); bools let into the int64 check (True and False fit);
in_experiment_dir without rstrip("/") (os.path.abspath drops a trailing slash already: removed since); --dry-run out
of LAUNCH (a dry run writes no checkpoint, so a checkpoint's run never had it); check_resume_fits without `theirs is
not None` (no MUST_MATCH field is Optional; a missing one goes through setting_before: only a hand-edited null
differs).
Not worth a test: step_checker checking every step in full and a falsy non-None sampler skipped (only an env that
breaks the protocol tells); defaults that are cadence or cost with no documented value (verify-every 100,
sampler-sync-every 10, bucket-mb 25, save-every 50, mujoco's print-every 10) and undocumented tuning (tracking's
sampling-uniform-floor 0.2, cartpole's 64x64 critic): a test would only copy the code."""

import dataclasses
import importlib.util
import re
from types import SimpleNamespace

import pytest
import torch

from configs import preset, validate
from configs.resume import check_resume_fits, continue_saved_config, saved_env
from dist.errors import RunError, UsageError
from envs import CartPole
from ppo.env_check import check_built, check_extras, check_reset
from tests.test_config_errors import cfg_with


def test_a_backslash_in_the_experiment_name_is_refused_on_posix_too():
    """Mutant: the separators ("/", os.sep) without the backslash. On Linux os.sep is "/": only the backslash entry
    refuses a Windows-style name; the same name without it is accepted."""
    with pytest.raises(UsageError, match="^--log.experiment " + re.escape(repr("a\\b")) + " must be a plain name "):
        validate(cfg_with(log__experiment="a\\b"))
    validate(cfg_with(log__experiment="ab"))


def test_a_collective_timeout_just_past_1e9_seconds_is_refused():
    """Mutant: the timeout's upper bound 1e10. 1e9 s is the documented top of [0.001, 1e9]; 1.5e9 is past it."""
    validate(cfg_with(dist__timeout_s=1e9))
    with pytest.raises(UsageError, match=r"^--dist.timeout-s must be in \[0.001, 1e9\] seconds .* got 1500000000.0$"):
        validate(cfg_with(dist__timeout_s=1.5e9))


def test_an_init_noise_std_whose_square_is_float32_s_smallest_normal_is_accepted():
    """Mutant: FLOAT32_TINY < std**2 (strict). std 2**-63 squares exactly to 2**-126 = 1.1754943508222875e-38, the
    smallest normal float32: the inclusive bound takes it."""
    std = 2.0 ** -63
    assert std * std == 2.0 ** -126 == 1.1754943508222875e-38      # exact in float64: powers of two
    validate(cfg_with(policy__init_noise_std=std))
    with pytest.raises(UsageError, match=r"^--policy.init-noise-std 5.4"):
        validate(cfg_with(policy__init_noise_std=std / 2))


def test_a_simulator_package_that_is_not_installed_is_refused_before_anything_starts(monkeypatch):
    """Mutant: the find_spec check dropped. With the package reported missing, the mujoco preset is refused naming
    the package and the make target that installs it; with it found, the same config passes."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "gymnasium" else object())
    with pytest.raises(UsageError, match=r"^--env.name gymnasium needs the gymnasium package, which is not installed: "
                                         r"`make setup-mujoco`$"):
        validate(preset("mujoco"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    validate(preset("mujoco"))


def test_the_embedded_presets_inherit_the_documented_field_defaults():
    """Mutants: the dataclass defaults adam-eps 1e-5, desired-kl 0.02, gamma 0.98, lam 0.9, clip 0.3, init-noise-std
    0.5, reward-clip 5, timeout-s 300, max-grad-norm 0.5 (the cartpole and tracking presets set none of them), and
    cartpole's entropy coefficient 0 dropped from its preset (the default 0.005 instead). Sources: the help strings
    (Adam's eps is PyTorch's default, read from torch here; CleanRL clips rewards at 10), docs/simulators.md's RSL-RL
    values the defaults share (KL target 0.01, gamma 0.99, lambda 0.95, clip 0.2, initial std 1, gradient norm 1)
    and docs/fault_tolerance.md's "--dist.timeout-s 600"."""
    torch_eps = torch.optim.Adam([torch.zeros(1, requires_grad=True)]).defaults["eps"]
    for name in ("cartpole", "tracking"):
        cfg = preset(name)
        p = cfg.ppo
        assert p.adam_eps == torch_eps and p.reward_clip == 10.0 and cfg.dist.timeout_s == 600.0, name
        assert p.max_grad_norm == 1.0, name
        assert (p.desired_kl, p.gamma, p.lam, p.clip_param, cfg.policy.init_noise_std) == (0.01, 0.99, 0.95, 0.2, 1.0)
    # no entropy bonus for cartpole (as the mujoco preset, CleanRL): the README's cartpole curve was measured so
    assert preset("cartpole").ppo.entropy_coef == 0.0 and preset("tracking").ppo.entropy_coef > 0


def test_the_simulator_presets_inherit_rsl_rl_s_lr_bounds_and_cleanrl_s_unscaled_actions():
    """Mutants: the defaults lr-min 1e-6 and action-scale 2. The isaaclab preset's adaptive schedule is RSL-RL's,
    which clamps the rate to [1e-5, 1e-2]; the mujoco preset is CleanRL's, whose actions reach the env unscaled and
    clipped only to the action space's bounds (docs/simulators.md: ClipAction)."""
    p = preset("isaaclab").ppo
    assert (p.schedule, p.lr_min, p.lr_max) == ("adaptive", 1e-5, 1e-2)
    env = preset("mujoco").env
    assert env.action_scale == 1.0 and env.action_clip is None


def test_int64_s_lowest_value_passes_the_64_bit_range_and_meets_the_sign_check():
    """Mutant: -2**63 < v (strict). -2**63 fits int64, so the 64-bit check lets it through and the error is the
    one that names the fix, --dist.verify-every's sign; -2**63 - 1 does not fit and is refused as such."""
    with pytest.raises(UsageError, match=r"^--dist.verify-every must be >= 0, got -9223372036854775808$"):
        validate(cfg_with(dist__verify_every=-2**63))
    with pytest.raises(UsageError, match=r"^--dist.verify-every must fit in 64 bits"):
        validate(cfg_with(dist__verify_every=-2**63 - 1))


@pytest.mark.parametrize("field, flag", [("save_every", "--log.save-every"), ("print_every", "--log.print-every")])
def test_the_log_section_s_integers_must_fit_64_bits(field, flag):
    """Mutant: check_finite's sections without "log.". 2**63 = 9223372036854775808 is one past int64's top."""
    with pytest.raises(UsageError, match=f"^{flag} must fit in 64 bits \\(\\[-2\\*\\*63, 2\\*\\*63 - 1\\]\\), "
                                         f"got 9223372036854775808$"):
        validate(cfg_with(**{f"log__{field}": 2**63}))
    validate(cfg_with(**{f"log__{field}": 2**63 - 1}))


def test_a_resume_refuses_another_env_task_naming_both():
    """Mutant: --env.task left out of MUST_MATCH. A Hopper-v4 checkpoint under --env.task HalfCheetah-v4 (other
    observation and action sizes) is refused before the build, naming the flag and the checkpoint's value."""
    cfg = preset("mujoco")
    saved = {"config": dataclasses.asdict(preset("mujoco")), "iteration": 5}      # a Hopper-v4 run's checkpoint
    assert check_resume_fits(saved, cfg, "ckpt.pt", restarted=False) is True
    cfg.env.task = "HalfCheetah-v4"
    with pytest.raises(UsageError, match=r"^--env.task HalfCheetah-v4 does not match the checkpoint's --env.task "
                                         r"Hopper-v4 \('ckpt.pt'\)"):
        check_resume_fits(saved, cfg, "ckpt.pt", restarted=False)


@pytest.mark.parametrize("section, field, theirs", [("ppo", "capture_step", True), ("log", "experiment", "old")])
def test_a_resume_keeps_this_launch_s_capture_step_and_experiment(section, field, theirs):
    """Mutants: --ppo.capture-step, --log.experiment left out of LAUNCH. How a step runs and where runs go are this
    command line's (the preset's here), not the checkpoint run's, even untyped."""
    cfg = preset("tracking")
    ours = getattr(getattr(cfg, section), field)
    assert ours != theirs
    saved = dataclasses.asdict(preset("tracking"))     # the checkpoint run's full config, one launch setting other
    saved[section][field] = theirs
    changed, kept = continue_saved_config(cfg, saved, frozenset())
    assert getattr(getattr(cfg, section), field) == ours and changed == [] and kept == []


def test_a_typed_flag_equal_to_the_checkpoint_s_value_is_not_listed_as_a_change():
    """Mutant: `elif ours != theirs` made `else`. --ppo.num-epochs 5 typed on a run that had 5 changes nothing; on a
    run that had 3 it is listed with the checkpoint's value."""
    saved = dataclasses.asdict(preset("tracking"))
    cfg = preset("tracking")
    assert continue_saved_config(cfg, saved, frozenset({"--ppo.num-epochs"})) == ([], [])
    saved["ppo"]["num_epochs"] = 3
    changed, kept = continue_saved_config(cfg, saved, frozenset({"--ppo.num-epochs"}))
    assert changed == ["--ppo.num-epochs 5 (the checkpoint's run: --ppo.num-epochs 3)"] and kept == []
    assert cfg.ppo.num_epochs == 5


@pytest.mark.parametrize("text", ["[]", '{"config": null}', '{"config": ["env"]}'])
def test_a_start_config_of_another_layout_reads_as_an_unknown_env(tmp_path, text):
    """Mutant: saved_env's except without TypeError. A config_<iteration>.json that is JSON but not a dict of dicts
    (subscripting a list with "config", or None with "env", is a TypeError) is an unknown env, {}, not a crash of
    --resume auto; a well-formed one is read."""
    (tmp_path / "config_3.json").write_text(text)
    assert saved_env(str(tmp_path)) == {}
    (tmp_path / "config_4.json").write_text('{"config": {"env": {"name": "cartpole"}}}')
    assert saved_env(str(tmp_path)) == {"name": "cartpole"}


@pytest.mark.parametrize("sampler, fits", [
    (SimpleNamespace(local_counts=torch.zeros(3), commit_global=lambda summed: None), True),
    (SimpleNamespace(local_counts=[0.0, 0.0, 0.0], commit_global=lambda summed: None), False),   # not a tensor
    (SimpleNamespace(local_counts=torch.zeros(3)), False),                                      # no commit_global
    (SimpleNamespace(local_counts=torch.zeros(3), commit_global=torch.zeros(3)), False),        # not callable
], ids=["both", "counts_list", "no_commit", "commit_not_callable"])
def test_a_sampler_needs_both_a_tensor_local_counts_and_a_commit_global_method(sampler, fits):
    """Mutants: the sampler check without its local_counts tensor test, or without its commit_global test. Each half
    is tried alone: a sampler that has one of the two is refused, naming what the runner needs."""
    env = CartPole(2, "cpu", 0)
    env.sampler = sampler
    if fits:
        check_built(env, "mine", 2)
        return
    with pytest.raises(RunError, match=r"^env 'mine': env.sampler is a SimpleNamespace without a tensor local_counts "
                                       r"and a commit_global\(summed\) method"):
        check_built(env, "mine", 2)


def test_reset_returning_three_items_is_refused():
    """Mutant: check_reset's `len(result) == 2` dropped. (obs, extras, info), a tuple whose first item is a valid obs,
    is refused as not (obs, extras); the pair itself is accepted."""
    env = CartPole(2, "cpu", 0)
    obs, extras = env.reset()
    assert check_reset(env, (obs, extras), "mine", torch.device("cpu")) is obs
    with pytest.raises(RunError, match=r"^env 'mine': reset\(\) must return \(obs, extras\)"):
        check_reset(env, (obs, extras, {}), "mine", torch.device("cpu"))


def test_a_complex_number_logged_by_the_env_is_refused():
    """Mutant: numbers.Real widened to numbers.Number. A complex log value adds into no float sum: refused naming the
    key and the type; a float and a 0-d tensor under the same key are accepted."""
    env = CartPole(2, "cpu", 0)
    env.log_keys = ("Episode/height",)
    for fine in (0.5, torch.tensor(0.5)):
        check_extras(env, {"log": {"Episode/height": fine}}, "mine", False, torch.device("cpu"))
    with pytest.raises(RunError, match=r"^env 'mine': step\(\)'s extras\['log'\]\['Episode/height'\] must be a "
                                       r"scalar .* got a complex"):
        check_extras(env, {"log": {"Episode/height": 1 + 2j}}, "mine", False, torch.device("cpu"))


def test_each_preset_writes_its_runs_under_its_own_name():
    """Mutant: the mujoco preset's experiment "gymnasium". A preset's runs go to runs/PRESET (docs/design.md:
    runs/cartpole/; docs/simulators.md: runs/isaaclab/), so --resume auto of one preset never meets another's."""
    for name in ("cartpole", "tracking", "mujoco", "isaaclab"):
        assert preset(name).log.experiment == name
