"""Bad input found by sweeping every flag of every preset with --dry-run: each one is a single line naming the
flag (or the --resume file) and exit status 2, where it used to be a traceback or a run that could not learn.
tests/test_config_errors.py holds the earlier cases; none is repeated here."""

import dataclasses
import os
import re
import struct
import zipfile

import numpy as np
import pytest
import torch

import train
from configs import preset, resolve_num_envs, validate
from configs.config import POSITIVE_FLOATS, UNIT_INTERVAL
from dist.checkpoint import rng_states, save_checkpoint
from dist.checkpoint_read import load_checkpoint
from dist.errors import UsageError
from envs import make_env
from ppo.actor_critic import build_actor_critic
from ppo.minibatch_step import build_optimizer
from test_config_errors import cfg_with


@pytest.mark.parametrize("changes, flag", [
    # int64 overflow of the step counter in the env: "ValueError: Overflow when unpacking long long"
    ({"env__episode_length_s": 1e20}, "--env.episode-length-s"),
    # sizes beyond int64: torch raised deep inside the build
    ({"ppo__num_steps": 10**20}, "--ppo.num-steps"),
    ({"env__num_motions": 10**20}, "--env.num-motions"),
    ({"policy__actor_hidden": (64, 10**20)}, "--policy.actor-hidden"),
    # positive, but 0 or inf once in float32: log_std = -inf (every log-prob nan), Adam's eps = 0 (0/0 = nan)
    ({"policy__init_noise_std": 1e-300}, "--policy.init-noise-std"),
    ({"policy__init_noise_std": 1e300}, "--policy.init-noise-std"),
    ({"ppo__adam_eps": 1e-300}, "--ppo.adam-eps"),
])
def test_values_that_overflow_or_vanish_in_the_build_name_the_flag(changes, flag):
    with pytest.raises(UsageError, match=flag.replace(".", r"\.")):
        validate(cfg_with(**changes))


def test_the_new_bounds_keep_ordinary_values_and_the_seed_range_message():
    validate(cfg_with(env__episode_length_s=1e6, policy__init_noise_std=1e-6, ppo__adam_eps=1e-12))
    with pytest.raises(UsageError, match=r"--seed must be in \[0, 4294967295\]"):   # not the 64-bit message
        validate(cfg_with(seed=2**64))


def test_cli_says_an_overflowing_episode_length_in_one_line(tmp_path, capsys):
    cfg = cfg_with(env__episode_length_s=1e20, dry_run=True, log__root=str(tmp_path))
    assert train.cli(cfg) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --env.episode-length-s 1e+20 is too long") and err.count("\n") == 1, err


# ---- damaged checkpoints: the right format tag, but entries that ppo.restore cannot use ---------------

def fresh_checkpoint(path, num_envs=16):
    """What train.main saves after an iteration, built without training (model, optimizer, env, RNG)."""
    cfg = cfg_with(env__num_envs=num_envs, ppo__num_steps=8)
    env = make_env(cfg.env, torch.device("cpu"), seed=cfg.seed, base_seed=cfg.seed)
    model = build_actor_critic(cfg.policy, env.obs_dims, env.num_actions)
    optimizer = build_optimizer(model.parameters(), cfg.ppo, torch.device("cpu"))
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "env": env.state_dict(),
             "iteration": 2, "learning_rate": 1e-3, "config": dataclasses.asdict(cfg),
             "rng": [rng_states(env, torch.Generator().manual_seed(1))], "layout": [1, 0]}
    save_checkpoint(str(path), state)
    return state


def flip_a_byte_of_tensor_data(path):
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 64)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_flipped_bit_in_the_weights_is_refused_not_loaded(tmp_path):
    path = tmp_path / "model_2.pt"
    fresh_checkpoint(path)
    assert load_checkpoint(str(path))["iteration"] == 2          # the undamaged file loads
    flip_a_byte_of_tensor_data(path)
    torch.load(path, weights_only=True)                          # torch alone loads it, with a wrong weight
    with pytest.raises(UsageError, match=r"--resume .* is damaged \(archive/data/\d+ does not match its CRC-32\)"):
        load_checkpoint(str(path))


@pytest.mark.parametrize("damage, message", [
    ({"config": None}, r"its 'config' is a NoneType, not a dict"),                  # was AttributeError
    ({"model": torch.zeros(3)}, r"its 'model' is a Tensor, not a dict"),             # was TypeError
    ({"optimizer": {}}, r"its 'optimizer' has no 'param_groups' list"),              # was KeyError
    ({"iteration": "2"}, r"its iteration is '2', not an integer >= 0"),              # was TypeError
    ({"iteration": -1}, r"its iteration is -1, not an integer >= 0"),                # was a silent run from -1
    ({"rng": []}, r"its 'rng' is not a non-empty list"),                             # was IndexError
    ({"layout": None}, r"its layout None does not say \[1 learner"),                 # was TypeError
    ({"layout": [1, 1]}, r"1 rollout rank\(s\) but not as many 'rollout_rng' dicts"),
])
def test_a_checkpoint_with_malformed_entries_is_one_line_exit_2(tmp_path, capsys, damage, message):
    path = tmp_path / "model_2.pt"
    state = fresh_checkpoint(path)
    save_checkpoint(str(path), {**state, **damage})
    with pytest.raises(UsageError, match=message):
        load_checkpoint(str(path))
    cfg = cfg_with(env__num_envs=16, ppo__num_steps=8, resume=str(path), dry_run=True, log__root=str(tmp_path))
    assert train.cli(cfg) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --resume {str(path)!r} is damaged") and err.count("\n") == 1, err


@pytest.mark.parametrize("unit, message", [
    ("trajectory", r"--env.num-envs \(510 = --env.global-num-envs 1020 / 2 rank\(s\)\) must be divisible"),
    ("transition", r"\(255 = --env.global-num-envs 510 / 2 rank\(s\) x 24 = 6120\) must be divisible"),
])
def test_an_indivisible_split_of_the_global_env_budget_names_the_flag_that_was_given(unit, message):
    cfg = cfg_with(env__global_num_envs=1020 if unit == "trajectory" else 510, ppo__minibatch_unit=unit,
                   ppo__num_mini_batches=4 if unit == "trajectory" else 80)
    resolve_num_envs(cfg, 2)
    with pytest.raises(UsageError, match=message):
        validate(cfg, world_size=2)


def test_a_global_env_budget_beyond_int64_names_that_flag_not_the_per_rank_one():
    with pytest.raises(UsageError, match=r"^--env.global-num-envs must fit in 64 bits"):
        resolve_num_envs(cfg_with(env__global_num_envs=10**20), 1)


@pytest.mark.parametrize("timeout_s", [1e300, 8.6e13, 1e-4])
def test_a_collective_timeout_torch_cannot_represent_names_the_flag(timeout_s):
    # 2-rank torchrun --dry-run: 1e300 was "OverflowError: Python int too large to convert to C int" from timedelta,
    # 8.6e13 gloo's "timeout.count() >= 0. Invalid timeout", 1e-4 (0 ms) a TCPStore time-out after 0ms
    with pytest.raises(UsageError, match=r"--dist.timeout-s must be in \[0.001, 1e9\] seconds"):
        validate(cfg_with(dist__timeout_s=timeout_s), world_size=2)
    validate(cfg_with(dist__timeout_s=1e9), world_size=2)        # ran a 2-rank --dry-run


@pytest.mark.parametrize("changes, flag", [
    ({"ppo__clip_param": 1e39}, "--ppo.clip-param 1e+39"),            # RuntimeError from clamp at the first update
    ({"ppo__reward_clip": 1e300}, "--ppo.reward-clip 1e+300"),        # the same from the reward normalizer
    ({"env__action_clip": -1e300}, "--env.action-clip -1e+300"),
    ({"ppo__max_grad_norm": 1e-320}, "--ppo.max-grad-norm 1e-320"),   # 0 in float32: every step changed nothing
    ({"ppo__entropy_coef": 1e300}, "--ppo.entropy-coef 1e+300"),      # every step skipped as non-finite
])
def test_floats_outside_float32_name_the_flag(changes, flag):
    with pytest.raises(UsageError, match="^" + re.escape(f"{flag} is 0 or inf in float32, where it is used")):
        validate(cfg_with(**changes))


def test_float32_s_smallest_normal_and_largest_finite_are_taken_exactly_and_a_half_below_is_not():
    tiny, big = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)   # 2**-126, (2 - 2**-23) * 2**127
    assert tiny == 2.0**-126 and big == (2 - 2.0**-23) * 2.0**127
    validate(cfg_with(ppo__entropy_coef=tiny, ppo__value_loss_coef=big))       # both ends of the range: taken
    with pytest.raises(UsageError, match=r"^--ppo\.entropy-coef .* is 0 or inf in float32"):
        validate(cfg_with(ppo__entropy_coef=tiny / 2))                           # subnormal in float32
    with pytest.raises(UsageError, match=r"^--ppo\.value-loss-coef .* is 0 or inf in float32"):
        validate(cfg_with(ppo__value_loss_coef=big * (1 + 2.0**-40)))           # past float32's largest


@pytest.mark.parametrize("changes, advice", [
    ({"ppo__learning_rate": 1e-45, "ppo__schedule": "fixed"}, "use a magnitude in [1.2e-38, 3.4e+38]"),   # offered 0
    ({"ppo__adam_eps": 1e-45}, "use a magnitude in [1.2e-38, 3.4e+38]"),
    ({"ppo__entropy_coef": 1e-45}, "use 0 or a magnitude in [1.2e-38, 3.4e+38]"),   # ">= 0"
    ({"ppo__gamma": 1e-300}, "use 0 or a magnitude in [1.2e-38, 1.0e+00]"),         # offered float32's range
])
def test_the_float32_advice_is_a_range_the_flag_then_takes(changes, advice):
    with pytest.raises(UsageError, match=re.escape(advice) + "$"):
        validate(cfg_with(**changes))
    field = next(iter(changes))                 # the flag; the others make its low end valid (a fixed-LR schedule)
    flag = f"--{field.replace('__', '.').replace('_', '-')}"
    taken = 0.0 if advice.startswith("use 0") else 1.2e-38     # the advice's low end, taken as it says
    validate(cfg_with(**{**changes, field: taken}))
    assert (flag in POSITIVE_FLOATS) == (not advice.startswith("use 0"))


@pytest.mark.parametrize("field", ["action_scale", "action_clip"])
def test_the_float32_advice_for_the_action_scale_and_clip_offers_no_0(field):
    """Both must be positive: the advice offered "0 or a magnitude", and 0 was then refused as not positive."""
    cfg = preset("mujoco")
    setattr(cfg.env, field, 1e-50)
    with pytest.raises(UsageError, match=r"is 0 or inf in float32, where it is used; use a magnitude in \[1.2e-38, "):
        validate(cfg)


@pytest.mark.parametrize("flag", UNIT_INTERVAL)
def test_every_unit_interval_flag_refuses_a_value_past_1_naming_itself(flag):
    field = flag[2:].replace(".", "__").replace("-", "_")
    with pytest.raises(UsageError, match=f"^{re.escape(flag)} must be in \\[0, 1\\], got 1.5$"):
        validate(cfg_with(**{field: 1.5}))
    validate(cfg_with(ppo__entropy_coef=0.0, ppo__clip_param=3e38, ppo__max_grad_norm=1.2e-38,   # 0, the range
                      env__action_scale=-1.0))                                                   # and a negative


def test_minibatch_advantage_norm_of_a_single_transition_is_refused():
    # mujoco (1 env, advantage-norm minibatch) --ppo.num-steps 32 --ppo.num-mini-batches 32: one transition per
    # minibatch, whose unbiased std is nan; the run was accepted and skipped every step as non-finite
    cfg = preset("mujoco")
    cfg.ppo.num_steps, cfg.ppo.num_mini_batches = 32, 32
    with pytest.raises(UsageError, match=r"--ppo.advantage-norm minibatch needs at least 2 transitions .* got 1"):
        validate(cfg)
    cfg.ppo.num_mini_batches = 16
    validate(cfg)


def test_local_or_global_advantage_norm_over_a_single_transition_is_refused():
    """One env, one step, one rank: (a - mean) / (0 + 1e-8) is 0 for the only advantage, so the run trained on
    entropy alone (exit 0). Global pools every learner's: over 2 ranks there are 2 transitions, accepted."""
    cfg = cfg_with(env__num_envs=1, ppo__num_steps=1, ppo__num_mini_batches=1)
    for norm in ("local", "global"):
        cfg.ppo.advantage_norm = norm
        with pytest.raises(UsageError, match=rf"^--ppo.advantage-norm {norm} normalizes over 1 transition, which it "
                                             r"turns into 0 \(no policy gradient\)"):
            validate(cfg)
    validate(cfg, world_size=2)
    cfg.ppo.advantage_norm = "none"
    validate(cfg)


@pytest.mark.parametrize("changes, said", [
    ({"ppo__gamma": float("nan")}, "--ppo.gamma must be a finite number, got nan"),
    ({"ppo__entropy_coef": float("inf")}, "--ppo.entropy-coef must be a finite number, got inf"),
    ({"env__episode_length_s": float("nan")}, "--env.episode-length-s must be a finite number, got nan"),
    ({"dist__timeout_s": float("-inf")}, "--dist.timeout-s must be a finite number, got -inf"),
])
def test_a_nan_or_infinite_float_is_refused_as_not_finite_naming_the_flag(changes, said):
    """Not as "0 or inf in float32" (a nan is neither), nor "must be positive": the value is no number at all."""
    with pytest.raises(UsageError, match="^" + re.escape(said) + "$"):
        validate(cfg_with(**changes))


def test_global_advantage_norm_pools_the_learners_transitions_not_the_rollout_ranks_ones():
    """With rollout ranks only the learners normalize: 1 learner + 1 rollout rank of 1 env x 1 step pools 1
    transition (refused), not 2; 1 learner + 2 rollout ranks pools 2 x 1 = 2 (accepted)."""
    cfg = cfg_with(env__num_envs=1, ppo__num_steps=1, ppo__num_mini_batches=1, ppo__advantage_norm="global",
                   dist__device="cpu", rollout__ranks=1)
    with pytest.raises(UsageError, match=r"^--ppo.advantage-norm global normalizes over 1 transition"):
        validate(cfg, world_size=2)
    cfg.rollout.ranks = 2
    validate(cfg, world_size=3)


def test_lr_bounds_of_the_adaptive_schedule_do_not_cap_the_linear_or_fixed_rate():
    # mujoco (linear schedule) --ppo.learning-rate 0.02 was refused for exceeding --ppo.lr-max, which it never reads
    cfg = preset("mujoco")
    cfg.ppo.learning_rate = 0.02
    validate(cfg)
    cfg.ppo.lr_min, cfg.ppo.lr_max = 0.1, 0.01                       # inverted bounds stay an error everywhere
    with pytest.raises(UsageError, match=r"^--ppo.lr-min 0.1 must be positive and at most --ppo.lr-max 0.01$"):
        validate(cfg)
    with pytest.raises(UsageError, match=r"^--ppo.learning-rate 0.02 is outside \[--ppo.lr-min \S+, --ppo.lr-max "
                                         r"\S+\], the bounds of --ppo.schedule adaptive; pass a rate within them or "
                                         r"widen them$"):
        validate(cfg_with(ppo__learning_rate=0.02))                  # tracking: adaptive
    for absurd in (1e300, 1e-300):                                     # no longer capped by lr-max: float32 range
        cfg = preset("mujoco")
        cfg.ppo.learning_rate = absurd
        with pytest.raises(UsageError, match=r"--ppo.learning-rate .* is 0 or inf in float32"):
            validate(cfg)


def test_an_experiment_name_too_long_for_a_directory_fails_before_the_build(tmp_path):
    # the dry run passed and a real run raised OSError (File name too long) from mkdir once everything was built
    with pytest.raises(UsageError, match=r"--log.experiment is 300 bytes long; a directory name can have at most 255"):
        validate(cfg_with(log__experiment="x" * 300))
    validate(cfg_with(log__experiment="x" * 255))


def test_a_log_root_too_long_for_the_file_system_fails_before_the_build(tmp_path):
    """A --log.root name over NAME_MAX, or a path that leaves no room under PATH_MAX for the run's directory and file
    names: the dry run passed and a real run built everything, then raised OSError (File name too long) from mkdir.
    The path is measured as typed ('./' parts too). Nothing is created; a name at NAME_MAX is accepted."""
    from dist.log_root import check_writable_root
    name_max, path_max = os.pathconf(tmp_path, "PC_NAME_MAX"), os.pathconf(tmp_path, "PC_PATH_MAX")
    with pytest.raises(UsageError, match=rf"^--log.root: the name 'eeeeeeeeeeeeeeee'... \({name_max + 1} bytes\) is "
                                         rf"longer than the file system takes \({name_max} bytes a name\)"):
        check_writable_root(str(tmp_path / "runs" / ("e" * (name_max + 1))))
    deep = tmp_path.joinpath(*["d" * 200] * (path_max // 200))
    with pytest.raises(UsageError, match=rf"^--log.root: the path \({len(str(deep))} bytes, plus 64 for the run's "
                                         rf"directory and file names\) is longer than the file system takes"):
        check_writable_root(str(deep))
    dotted = "./" * (path_max // 2) + "runs"    # 'runs' once normalized, but the system calls get every './'
    with pytest.raises(UsageError, match=rf"^--log.root: the path \({len(dotted)} bytes, plus 64"):
        check_writable_root(dotted, write=False)
    check_writable_root(str(tmp_path / ("e" * name_max)))
    assert os.listdir(tmp_path) == []


def test_a_resume_path_that_is_a_device_is_not_called_a_directory():
    with pytest.raises(UsageError, match=r"^--resume '/dev/null' is not a regular file"):
        load_checkpoint("/dev/null")


@pytest.mark.parametrize("total", [128, 129, 132])
def test_a_global_env_budget_with_rollout_ranks_is_refused_first_whatever_the_budget(total):
    """3 ranks, 2 of them rollout ranks: 128 was 'not divisible by the world size 3', 129 'must be divisible by
    --ppo.num-mini-batches', and only 132 named the flag combination that cannot work."""
    cfg = cfg_with(env__global_num_envs=total, rollout__ranks=2)
    with pytest.raises(UsageError, match=r"^--env.global-num-envs with --rollout.ranks: give --env.num-envs per "):
        resolve_num_envs(cfg, 3)


def test_an_empty_log_root_is_refused_not_taken_for_the_working_directory(tmp_path, monkeypatch):
    # --log.root "$UNSET": the run went to ./tracking/<timestamp>/ in the working directory, exit 0, nothing said
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"^--log.root is empty; pass a directory \('\.' for the current one\)$"):
        train.main(cfg_with(log__root="", dist__device="cpu", max_iterations=1, env__num_envs=4, ppo__num_steps=4,
                            ppo__num_mini_batches=1))       # small: the old code trained it
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", [["--resume", ""], ["--resume="]])
def test_an_empty_resume_typed_is_refused_not_taken_for_a_new_run(tmp_path, argv):
    # --resume "$CKPT" with CKPT unset: "" is the default (no resume), so the old code trained a new run from scratch,
    # exit 0, nothing said; the run the user meant to continue was left where it was
    from configs.typed_flags import typed_flags
    cfg = cfg_with(log__root=str(tmp_path), dist__device="cpu", max_iterations=1, env__num_envs=4, ppo__num_steps=4,
                   ppo__num_mini_batches=1)
    with pytest.raises(UsageError, match=r"^--resume is empty; pass a model_<iteration>\.pt file, a run directory "):
        train.main(cfg, typed_flags(argv))
    assert os.listdir(tmp_path) == []
