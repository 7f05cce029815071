"""configs/config.py's checks at their bounds, flag by flag, configs/presets.py, and train.py's loop.

Each "must be positive" flag is refused at 0 (every entry of the table, one by one); the bounds are tried on both
sides (seed 0, a 256-byte experiment name, --dist.verify-every 0, the init-noise-std whose square leaves float32, and
the one whose square is float32's smallest normal; --dist.timeout-s's top, int64's lowest value and the log section's
64-bit integers); a backslash in --log.experiment; a simulator package that is not installed; the simulator adapters'
checks, the global env budget's sign and int64 bound, and validate() alone refusing a global budget with rollout
ranks (train.py's resolve_num_envs says it first, bench_train calls validate alone); train.py's linear LR at the last
iteration, its last console line, each rank's own seeds and the checkpoint's learner count; the isaaclab preset as
docs/simulators.md lists it, and preset()'s refusal. No mutant of config.py, presets.py or train.py was found
equivalent (those of other files: tests/test_update_step_rules.py).
"""

import glob
import importlib.util
import os
import re

import pytest
import torch

import train
from configs import preset, resolve_num_envs, validate
from dist.errors import UsageError
from tests.multirank import run_ranks
from tests.test_config_errors import cfg_with
from tests.test_train import small_tracking, train_body

POSITIVE = [   # (field, flag) of every entry of validate()'s "must be positive" table
    ("env__num_envs", "--env.num-envs"), ("ppo__num_steps", "--ppo.num-steps"),
    ("ppo__num_epochs", "--ppo.num-epochs"), ("ppo__num_mini_batches", "--ppo.num-mini-batches"),
    ("max_iterations", "--max-iterations"), ("log__save_every", "--log.save-every"),
    ("log__print_every", "--log.print-every"), ("ppo__learning_rate", "--ppo.learning-rate"),
    ("ppo__clip_param", "--ppo.clip-param"), ("ppo__max_grad_norm", "--ppo.max-grad-norm"),
    ("policy__init_noise_std", "--policy.init-noise-std"), ("env__num_motions", "--env.num-motions"),
    ("ppo__desired_kl", "--ppo.desired-kl"), ("ppo__num_micro_batches", "--ppo.num-micro-batches"),
    ("dist__bucket_mb", "--dist.bucket-mb"), ("dist__sampler_sync_every", "--dist.sampler-sync-every"),
    ("ppo__adam_eps", "--ppo.adam-eps"), ("ppo__reward_clip", "--ppo.reward-clip"),
    ("ppo__lr_min", "--ppo.lr-min"), ("ppo__lr_max", "--ppo.lr-max"),    # lr-max 0 blamed lr-min, which was typed
]


@pytest.mark.parametrize("field, flag", POSITIVE, ids=[flag for _, flag in POSITIVE])
def test_every_flag_that_must_be_positive_refuses_0_naming_itself(field, flag):
    default = getattr(getattr(preset("tracking"), field.split("__")[0]), field.split("__")[-1]) \
        if "__" in field else getattr(preset("tracking"), field)
    zero = 0.0 if isinstance(default, float) else 0
    with pytest.raises(UsageError, match=f"^{flag} must be positive, got {zero}$"):
        validate(cfg_with(**{field: zero}))


def test_the_episode_length_of_0_is_refused_naming_it():
    # 0 is shorter than one step: refused by that check first, still naming the flag
    with pytest.raises(UsageError, match=r"^--env.episode-length-s 0.0 is shorter than one control step"):
        validate(cfg_with(env__episode_length_s=0.0))


def test_bounds_accepted_on_their_inclusive_side():
    validate(cfg_with(seed=0))                            # "[0, 4294967295]"
    validate(cfg_with(dist__verify_every=0))              # "0 = only after loads"
    validate(cfg_with(policy__init_noise_std=2e-19))      # variance 4e-38, above float32's smallest normal 1.18e-38
    validate(cfg_with(policy__init_noise_std=1.8e18))     # a 10-std draw's squared deviation 3.24e38 < 3.4e38


@pytest.mark.parametrize("changes, message", [
    ({"log__experiment": "x" * 256},
     r"^--log.experiment is 256 bytes long; a directory name can have at most 255: use a shorter name$"),
    ({"log__experiment": "é" * 128}, r"^--log.experiment is 256 bytes long"),       # bytes, not characters
    # the std fits float32 but its square, the variance log_prob divides by, does not
    ({"policy__init_noise_std": 1e-20}, r"^--policy.init-noise-std 1e-20: the action variance \(its square, or "),
    ({"policy__init_noise_std": 1.9e18}, r"^--policy.init-noise-std 1.9e\+18: the action variance \(its square, or "
                                          r"that of a draw 10 std away\) is 0 or inf in float32; use a value in "
                                          r"\[1.1e-19, 1.8e\+18\]$"),   # 1e19 trained nothing: every step skipped
    # each coefficient and hidden-size flag is named alone: blame_checkpoint blames the first flag of the message
    ({"ppo__entropy_coef": -0.01}, r"^--ppo.entropy-coef must be >= 0, got -0.01$"),
    ({"ppo__value_loss_coef": -1.0}, r"^--ppo.value-loss-coef must be >= 0, got -1.0$"),
    ({"policy__actor_hidden": (64, 0)}, r"^--policy.actor-hidden sizes must be positive, got 64 0$"),
    ({"policy__critic_hidden": (-1,)}, r"^--policy.critic-hidden sizes must be positive, got -1$"),
])
def test_values_just_past_a_bound_are_refused(changes, message):
    with pytest.raises(UsageError, match=message):
        validate(cfg_with(**changes))


@pytest.mark.parametrize("field, value, message", [
    ("action_scale", 0.0, r"^--env.action-scale must be positive, got 0.0$"),
    ("action_clip", 0.0, r"^--env.action-clip must be positive \(or None for no clip\), got 0.0$"),
    ("action_clip", -1.0, r"^--env.action-clip must be positive \(or None for no clip\), got -1.0$"),
    ("critic_obs_groups", (), r"^--env.critic-obs-groups is empty; name at least one observation group "
                              r"\(e.g. policy\)$"),
    ("actor_obs_groups", (), r"^--env.actor-obs-groups is empty; name at least one observation group \(e.g. policy\)$"),
])
def test_the_simulator_adapter_settings_are_checked_before_a_simulator_starts(field, value, message):
    cfg = preset("mujoco")           # gymnasium, installed with the dev requirements
    setattr(cfg.env, field, value)
    with pytest.raises(UsageError, match=message):
        validate(cfg)
    validate(preset("mujoco"))


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


def test_a_simulator_package_that_is_not_installed_is_refused_before_anything_starts(monkeypatch):
    """Mutant: the find_spec check dropped. With the package reported missing, the mujoco preset is refused naming
    the package and the make target that installs it; with it found, the same config passes."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "gymnasium" else object())
    with pytest.raises(UsageError, match=r"^--env.name gymnasium needs the gymnasium package, which is not installed: "
                                         r"`make setup-mujoco`$"):
        validate(preset("mujoco"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    validate(preset("mujoco"))


def test_isaaclab_on_cpu_names_the_devices_to_use(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())      # as if Isaac Lab were installed
    cfg = preset("isaaclab")
    cfg.dist.device = "cpu"
    with pytest.raises(UsageError, match=r"^--env.name isaaclab simulates on GPUs \(one per rank\); it cannot run with "
                                         r"--dist.device cpu: use --dist.device cuda or auto$"):
        validate(cfg)


@pytest.mark.parametrize("total, world, message", [
    (-4, 2, r"^--env.global-num-envs must be >= 0, got -4$"),    # -4 % 2 == 0: would split into -2 per rank
    (-1, 1, r"^--env.global-num-envs must be >= 0, got -1$"),    # the first value below the bound
    (2**63, 1, r"^--env.global-num-envs must fit in 64 bits \(\[0, 2\*\*63 - 1\]\), got 9223372036854775808$"),
])
def test_a_global_env_budget_out_of_range_names_that_flag_not_the_per_rank_one(total, world, message):
    with pytest.raises(UsageError, match=message):
        resolve_num_envs(cfg_with(env__global_num_envs=total), world)


def test_validate_alone_refuses_a_global_env_budget_with_rollout_ranks():
    cfg = cfg_with(env__global_num_envs=1024, rollout__ranks=2)
    with pytest.raises(UsageError, match=r"^--env.global-num-envs with --rollout.ranks: give --env.num-envs per "):
        validate(cfg, world_size=3)



def test_micro_batches_must_divide_one_minibatch_not_only_the_whole_rollout():
    """4 envs x 3 steps in 2 minibatches: 6 transitions each. 4 micro-batches divide the rollout's 12 transitions but
    not a minibatch's 6 (unequal micro-batches would weight the accumulated gradient wrongly); 3 divide both."""
    envs, steps, minibatches = 4, 3, 2
    per_minibatch = envs * steps // minibatches
    assert (envs * steps) % 4 == 0 and per_minibatch % 4 and per_minibatch % 3 == 0
    changes = {"env__num_envs": envs, "ppo__num_steps": steps, "ppo__num_mini_batches": minibatches}
    with pytest.raises(UsageError, match=f"^--ppo.num-micro-batches \\(4\\) does not divide a minibatch of "
                                         f"{per_minibatch} transitions per rank"):
        validate(cfg_with(ppo__num_micro_batches=4, **changes))
    validate(cfg_with(ppo__num_micro_batches=3, **changes))


@pytest.mark.parametrize("name", [".", ".."])
def test_an_experiment_name_that_is_a_directory_reference_is_refused(name):
    """'.' would put the runs in --log.root itself and '..' above it: neither is a plain name."""
    with pytest.raises(UsageError, match=f"^--log.experiment '{re.escape(name)}' must be a plain name without path "):
        validate(cfg_with(log__experiment=name))
    validate(cfg_with(log__experiment=name + "x"))


def test_integers_of_the_rollout_section_must_fit_64_bits_too():
    """check_finite covers every section: a --rollout.max-staleness past int64 (read only in async mode, so nothing
    later would refuse it) is named with the 64-bit bound; 2**63 - 1 passes that check."""
    with pytest.raises(UsageError, match=r"^--rollout.max-staleness must fit in 64 bits \(\[-2\*\*63, 2\*\*63 - 1\]\), "
                                         r"got 9223372036854775808$"):
        validate(cfg_with(rollout__max_staleness=2**63))
    validate(cfg_with(rollout__max_staleness=2**63 - 1))


def test_a_simulator_env_without_a_task_is_refused_naming_the_flag():
    """gymnasium (installed with the dev requirements) needs --env.task before anything is built."""
    cfg = preset("mujoco")
    cfg.env.task = ""
    with pytest.raises(UsageError, match=r"^--env.name gymnasium needs --env.task, a registered task id "):
        validate(cfg)

def test_an_episode_longer_than_2_to_the_62_steps_is_refused():
    """The bound the message states: 2**62 steps of 0.02 s. 1.5 x 2**62 steps still fit int64 (2**63) but not the
    stated bound; 2**61 steps are accepted."""
    with pytest.raises(UsageError, match=r"^--env.episode-length-s .* is too long: the episode step counter is int64, "
                                         r"so at most 9.2e\+16 s of 0.02 s steps$"):
        validate(cfg_with(env__episode_length_s=1.5 * 2**62 * 0.02))
    validate(cfg_with(env__episode_length_s=2**61 * 0.02))

@pytest.mark.parametrize("floor", [-0.1, 1.5])
def test_a_uniform_sampling_floor_outside_0_to_1_is_refused(floor):
    """The floor is a share of the motion sampling: [0, 1], both ends accepted."""
    with pytest.raises(UsageError, match=f"^--env.sampling-uniform-floor must be in \\[0, 1\\], got {floor}$"):
        validate(cfg_with(env__sampling_uniform_floor=floor))
    for share in (0.0, 1.0):
        validate(cfg_with(env__sampling_uniform_floor=share))

def test_seconds_beyond_float32_get_their_own_range_not_the_float32_refusal():
    """--env.episode-length-s and --dist.timeout-s never meet a float32 tensor: a value past float32's range is
    refused by their own bound (the int64 step counter, torch.distributed's milliseconds), and an episode length
    the env does not read (gymnasium takes the task's time limit) is not refused at all."""
    with pytest.raises(UsageError, match=r"^--env.episode-length-s 1e\+39 is too long: the episode step counter"):
        validate(cfg_with(env__episode_length_s=1e39))
    with pytest.raises(UsageError, match=r"^--env.episode-length-s 1e-39 is shorter than one control step"):
        validate(cfg_with(env__episode_length_s=1e-39))
    with pytest.raises(UsageError, match=r"^--dist.timeout-s must be in \[0.001, 1e9\] seconds .* got 1e\+39$"):
        validate(cfg_with(dist__timeout_s=1e39))
    cfg = preset("mujoco")
    cfg.env.episode_length_s = 1e39
    validate(cfg)

# ---- train.py: the loop ----------------------------------------------------------------------------------------

def test_the_linear_schedule_runs_iteration_k_of_n_at_lr_times_1_minus_k_over_n(tmp_path, capsys):
    """Iteration 0 at the full LR, the last (k = n - 1) at LR / n, never 0; the checkpoint keeps that LR. The last
    iteration prints its console line whatever --log.print-every (100 here) says."""
    cfg = small_tracking(tmp_path, iterations=2)
    cfg.ppo.schedule, cfg.ppo.learning_rate = "linear", 1e-3
    _, scalars, _ = train.main(cfg)
    assert scalars["Loss/learning_rate"] == pytest.approx(1e-3 * (1 - 1 / 2), rel=1e-12)
    (ckpt,) = glob.glob(os.path.join(tmp_path, "tracking", "*", "model_2.pt"))
    assert torch.load(ckpt, weights_only=True)["learning_rate"] == pytest.approx(5e-4, rel=1e-12)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("it ")]
    assert len(lines) == 1 and lines[0].startswith("it     2/2 ") and " lr 5.0e-04 " in lines[0], lines


@pytest.mark.slow
def test_two_ranks_draw_their_own_streams_and_save_their_layout(tmp_path):
    """Data-parallel ranks must not sample the same action noise, env randomness or minibatch order: rank r seeds
    with rank_seed(--seed, r). The checkpoint records 2 learners, so resuming on 2 ranks restores each rank's
    streams."""
    run_ranks(train_body, 2, args=(small_tracking(tmp_path, iterations=1),))
    (ckpt,) = glob.glob(os.path.join(tmp_path, "tracking", "*", "model_1.pt"))
    saved = torch.load(ckpt, weights_only=True)
    assert saved["layout"] == [2, 0] and len(saved["rng"]) == 2
    for stream in ("torch", "env", "shuffle"):
        assert not torch.equal(saved["rng"][0][stream], saved["rng"][1][stream]), stream


# ---- configs/presets.py ----------------------------------------------------------------------------------------

def test_the_isaaclab_preset_is_the_one_docs_simulators_md_describes():
    """Isaac Lab 3.0.0's G1RoughPPORunnerCfg as the docs list it; minibatches of transitions, as RSL-RL's storage
    shuffles them (whole trajectories would be another algorithm, silently)."""
    cfg = preset("isaaclab")
    p = cfg.ppo
    assert (cfg.env.task, cfg.env.num_envs, p.num_steps, cfg.max_iterations) == ("Isaac-Velocity-Rough-G1", 4096, 24,
                                                                                   5000)
    assert cfg.policy.actor_hidden == cfg.policy.critic_hidden == (512, 256, 128) and cfg.policy.activation == "elu"
    assert not cfg.policy.normalize_actor_obs and not cfg.policy.normalize_critic_obs
    assert (p.num_epochs, p.num_mini_batches, p.minibatch_unit) == (5, 4, "transition")
    assert (p.learning_rate, p.schedule, p.desired_kl, p.gamma, p.lam) == (1e-3, "adaptive", 0.01, 0.99, 0.95)
    assert (p.clip_param, p.clip_value_loss, p.value_loss_coef, p.entropy_coef, p.max_grad_norm) == \
        (0.2, True, 1.0, 0.008, 1.0)
    assert (p.advantage_norm, cfg.seed) == ("global", 1)


def test_the_mujoco_preset_is_cleanrl_s_setting_as_docs_simulators_md_describes():
    """1 env x 2048 steps for as many whole iterations as fit in 1M steps (999,424 steps); the rest as the docs list
    it: value coefficient 0.25 = CleanRL's vf_coef 0.5 x the 0.5 inside its loss, time-outs as terminations."""
    cfg = preset("mujoco")
    p, pol = cfg.ppo, cfg.policy
    steps = cfg.env.num_envs * p.num_steps
    assert (cfg.env.name, cfg.env.task, cfg.env.num_envs, p.num_steps) == ("gymnasium", "Hopper-v4", 1, 2048)
    assert cfg.max_iterations * steps == 999_424 <= 1_000_000 < (cfg.max_iterations + 1) * steps
    assert (p.num_epochs, p.num_mini_batches, p.minibatch_unit) == (10, 32, "transition")
    assert (p.learning_rate, p.schedule, p.adam_eps, p.gamma, p.lam) == (3e-4, "linear", 1e-5, 0.99, 0.95)
    assert (p.clip_param, p.clip_value_loss, p.value_loss_coef, p.entropy_coef, p.max_grad_norm) == \
        (0.2, True, 0.5 * 0.5, 0.0, 0.5)
    assert pol.actor_hidden == pol.critic_hidden == (64, 64) and pol.activation == "tanh" and pol.orthogonal_init
    assert pol.init_noise_std == 1.0 and pol.normalize_actor_obs and pol.normalize_critic_obs
    assert (p.normalize_rewards, p.reward_clip, p.advantage_norm) == (True, 10.0, "minibatch")
    assert not p.bootstrap_time_outs and cfg.log.episode_returns


def test_the_cartpole_and_tracking_presets_are_the_runs_the_readme_lists():
    """README's presets table: cartpole 64 envs, T=32, 100 iterations, episodes capped at 500 steps of 0.02 s;
    tracking 512 envs per rank, T=24, 5 epochs x 4 minibatches, 400 iterations, and the motion library whose
    sampler counts docs/design.md's sync table sizes."""
    cart = preset("cartpole")
    assert (cart.env.name, cart.env.num_envs, cart.ppo.num_steps, cart.max_iterations) == ("cartpole", 64, 32, 100)
    assert round(cart.env.episode_length_s / 0.02) == 500
    track = preset("tracking")
    assert (track.env.name, track.env.num_envs, track.ppo.num_steps, track.max_iterations) == ("tracking", 512, 24, 400)
    assert (track.ppo.num_epochs, track.ppo.num_mini_batches, track.ppo.minibatch_unit) == (5, 4, "trajectory")
    assert 2 * track.env.num_motions * 8 == 1024      # docs/design.md: sampler counts "2 x motions x 8 B = 1.0 KB"


def test_an_unknown_preset_is_a_value_error_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"^unknown preset 'walker'; choose one of: cartpole, tracking, mujoco, "
                                         r"isaaclab$"):
        preset("walker")
