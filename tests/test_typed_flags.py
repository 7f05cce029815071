"""A flag the user typed that the resulting config never reads is refused by name (configs/typed_flags.py), before
--resume looks for a run; the same value set by a preset, or the flag where it applies, is accepted. A flag typed
twice is refused with every value it was given. Which env reads each --env.* flag (READ_BY, ENVS: every --env.name,
and the help strings that name the envs), which of several refused flags is named, and a run directory reached
through a symlinked --log.root."""

import ast
import dataclasses
import inspect
import os
import textwrap
import typing

import pytest
import torch

import train
from configs import Config, preset, validate
from configs.config import EnvConfig
from configs.resume import check_resume_fits
from configs.typed_flags import check_typed_flags, env_label, env_reads, experiment_dir, typed_flags
from dist.errors import UsageError
from ppo.gae import compute_gae
from ppo.kl_schedule import adaptive_lr
from test_cli_adversarial import assert_one_line_error
from test_config_errors import cfg_with, run_cli


def all_field_flags() -> set[str]:
    """Every flag tyro makes from Config, spelled as the errors spell it."""
    cfg, flags = Config(), set()
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section):
            flags |= {f"--{f.name}.{g.name.replace('_', '-')}" for g in dataclasses.fields(section)}
        else:
            flags.add(f"--{f.name.replace('_', '-')}")
    return flags


# (typed flag, config where it has no effect, what the error says it needs, config where it applies)
RULES = [
    ("--env.episode-length-s", {"env__name": "gymnasium"}, "--env.name cartpole or tracking (the run uses gymnasium)",
     {"env__name": "cartpole"}),
    ("--env.num-motions", {"env__name": "cartpole"}, "--env.name tracking (the run uses cartpole)", {}),
    ("--env.sampling-uniform-floor", {"env__name": "isaaclab"}, "--env.name tracking (the run uses isaaclab)", {}),
    ("--dist.sampler-sync-every", {"env__name": "gymnasium"}, "--env.name tracking (the run uses gymnasium)", {}),
    ("--env.task", {}, "--env.name gymnasium or isaaclab (the run uses tracking)", {"env__name": "gymnasium"}),
    ("--env.action-scale", {"env__name": "cartpole"}, "--env.name gymnasium or isaaclab (the run uses cartpole)",
     {"env__name": "isaaclab"}),
    ("--env.action-clip", {}, "--env.name gymnasium or isaaclab (the run uses tracking)", {"env__name": "gymnasium"}),
    ("--env.actor-obs-groups", {"env__name": "gymnasium"}, "--env.name isaaclab (the run uses gymnasium)",
     {"env__name": "isaaclab"}),
    ("--env.critic-obs-groups", {}, "--env.name isaaclab (the run uses tracking)", {"env__name": "isaaclab"}),
    ("--env.launcher-args", {"env__name": "cartpole"}, "--env.name isaaclab (the run uses cartpole)",
     {"env__name": "isaaclab"}),
    ("--env.task-overrides", {"env__name": "gymnasium"}, "--env.name isaaclab (the run uses gymnasium)",
     {"env__name": "isaaclab"}),
    ("--env.num-envs", {"env__global_num_envs": 1024}, "--env.global-num-envs 0 (the run uses 1024", {}),
    ("--ppo.desired-kl", {"ppo__schedule": "fixed"}, "--ppo.schedule adaptive (the run uses fixed)", {}),
    ("--ppo.lr-min", {"ppo__schedule": "linear"}, "--ppo.schedule adaptive (the run uses linear)", {}),
    ("--ppo.lr-max", {"ppo__schedule": "fixed"}, "--ppo.schedule adaptive (the run uses fixed)", {}),
    ("--ppo.reward-clip", {}, "--ppo.normalize-rewards (the run does not normalize rewards)",
     {"ppo__normalize_rewards": True}),
    ("--dist.bucket-mb", {}, "--dist.grad-sync bucketed (the run uses flat)", {"dist__grad_sync": "bucketed"}),
    ("--rollout.mode", {}, "--rollout.ranks K > 0 (the run uses 0", {"rollout__ranks": 1}),
    ("--rollout.sync", {}, "--rollout.ranks K > 0 (the run uses 0", {"rollout__ranks": 1}),
    ("--rollout.dtype", {}, "--rollout.ranks K > 0 (the run uses 0", {"rollout__ranks": 1}),
    ("--rollout.recompute", {}, "--rollout.ranks K > 0 (the run uses 0", {"rollout__ranks": 1}),
    ("--rollout.max-staleness", {"rollout__mode": "async"}, "--rollout.ranks K > 0 (the run uses 0",
     {"rollout__ranks": 1, "rollout__mode": "async"}),
    ("--rollout.max-staleness", {"rollout__ranks": 1}, "--rollout.mode async (the run uses sync)",
     {"rollout__ranks": 1, "rollout__mode": "async"}),
]


@pytest.mark.parametrize("flag, off, needs, on", RULES)
def test_each_rule_refuses_the_typed_flag_where_it_has_no_effect_and_accepts_it_where_it_does(flag, off, needs, on):
    with pytest.raises(UsageError) as exc:
        check_typed_flags(cfg_with(**off), frozenset({flag}))
    assert str(exc.value).startswith(f"{flag} applies only with {needs}"), exc.value
    check_typed_flags(cfg_with(**on), frozenset({flag}))
    check_typed_flags(cfg_with(**off), frozenset())          # the same value from a preset or a default


def test_every_rule_names_a_real_flag_and_the_other_flags_apply_everywhere():
    flags = all_field_flags()
    ruled = {flag for flag, *_ in RULES}
    assert ruled <= flags, ruled - flags                      # a misspelt rule would never fire
    configs = [cfg_with(env__name=name, ppo__schedule=schedule)
               for name in ("cartpole", "tracking", "gymnasium", "isaaclab") for schedule in ("fixed", "linear")]
    for cfg in configs:
        check_typed_flags(cfg, frozenset(flags - ruled))      # no rule beyond those listed above
    assert not any(flag.removeprefix("--").rsplit(".", 1)[-1].startswith("no-") for flag in flags), \
        "typed_flags strips no- as a boolean's off switch: a field may not start with no_"


def test_validate_checks_typed_flags_first_and_keeps_its_old_signature():
    with pytest.raises(UsageError, match=r"^--rollout\.max-staleness applies only with --rollout\.ranks"):
        validate(cfg_with(rollout__max_staleness=0), 1, frozenset({"--rollout.max-staleness"}))
    with pytest.raises(UsageError, match=r"^--rollout\.max-staleness must be >= 1"):   # untyped: the value check
        validate(cfg_with(rollout__max_staleness=0))
    validate(preset("cartpole"), 1, frozenset({"--env.episode-length-s", "--dry-run", "--help", "--seed"}))


def test_command_line_spellings_are_normalized():
    argv = ["tracking", "--ppo.reward_clip=5", "--env.num-motions", "8", "--ppo.no-normalize-rewards", "--no-dry-run",
            "--env.launcher-args=--viz kit", "--ppo.no_capture_step", "--seed", "-1", "--ppo.schedule", "fixed"]
    assert typed_flags(argv) == {"--ppo.reward-clip", "--env.num-motions", "--ppo.normalize-rewards", "--dry-run",
                                 "--env.launcher-args", "--ppo.capture-step", "--seed", "--ppo.schedule"}


def test_a_resume_compares_only_the_fields_the_env_reads():
    # A cartpole run started from the mujoco preset saved --env.task Hopper-v4; typing it to resume is refused,
    # so the comparison must not ask for it.
    envs = cfg_with().env.num_envs      # every checkpoint records it (a setting it lacked would count as the default)
    saved = {"config": {"env": {"name": "cartpole", "task": "Hopper-v4", "num_envs": envs, "num_motions": 8}},
             "iteration": 1}
    assert check_resume_fits(saved, cfg_with(env__name="cartpole"), "ckpt.pt", restarted=False)
    saved = {"config": {"env": {"name": "tracking", "task": "", "num_envs": envs, "num_motions": 8}},
             "iteration": 1}
    with pytest.raises(UsageError, match="--env.num-motions 64 does not match the checkpoint's --env.num-motions 8 "):
        check_resume_fits(saved, cfg_with(), "ckpt.pt", restarted=False)


def test_messages_name_the_env_the_run_simulates():
    mujoco = preset("mujoco")
    assert env_label(mujoco) == mujoco.env.task == "Hopper-v4"
    mujoco.env.name = "cartpole"                # the preset's task stays behind, unread
    assert env_label(mujoco) == "cartpole"
    assert env_label(cfg_with(env__name="gymnasium", env__task="")) == "gymnasium"


# ---- through the command line: a few processes (~1 s each, forked: tests/forked_python.py) -----------------

@pytest.mark.parametrize("args", [
    ["tracking", "--rollout.max-staleness", "3"],
    ["cartpole", "--env.num-motions=8"],                      # --flag=value
    ["tracking", "--ppo.reward_clip", "5"],                   # underscores
])
def test_cli_refuses_a_typed_flag_that_does_not_apply(tmp_path, args):
    out = run_cli(*args, "--dry-run", "--log.root", str(tmp_path / "runs"))
    flag = args[1].split("=")[0].replace("_", "-")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"error: {flag} applies only with ") and out.stderr.count("\n") == 1, out.stderr
    assert out.stdout == "" and not (tmp_path / "runs").exists()


def test_cli_accepts_the_flag_where_it_applies_and_a_preset_value_that_does_not(tmp_path):
    # the mujoco preset normalizes rewards (so --ppo.reward-clip applies) and sets --env.task Hopper-v4, which
    # the typed --env.name cartpole does not read: not typed, so not refused
    out = run_cli("mujoco", "--env.name", "cartpole", "--ppo.reward-clip", "5", "--dry-run",
                  "--log.root", str(tmp_path / "runs"))
    assert out.returncode == 0, out.stderr
    assert "1 rank x 1 envs x 2048 steps" in out.stdout and "sync plan" in out.stdout, out.stdout


def test_log_flags_that_do_not_hold_the_resumed_run_directory_are_refused(tmp_path, monkeypatch):
    """--resume RUN_DIR continues in place: a typed --log.root or --log.experiment elsewhere was silently ignored
    (the checkpoints went on into RUN_DIR). Flags that do hold it (the stop message's command repeats the run's
    own) and --resume with a checkpoint file (a new run directory under them) are accepted."""
    run_dir = tmp_path / "runs" / "tracking" / "2026-12-01_09-00-00"
    run_dir.mkdir(parents=True)
    (run_dir / "model_3.pt").write_bytes(b"")
    for changes, flag, where in (({"log__root": str(tmp_path / "elsewhere")}, "--log.root",
                                  (str(tmp_path / "elsewhere"), "tracking")),     # the experiment defaults to the env
                                 ({"log__root": str(tmp_path / "runs"), "log__experiment": "other"}, "--log.experiment",
                                  (str(tmp_path / "runs"), "other"))):
        with pytest.raises(UsageError) as exc:
            check_typed_flags(cfg_with(resume=str(run_dir), **changes), frozenset({flag}))
        assert str(exc.value) == (f"{flag} applies only with --resume auto, a checkpoint file, or a run directory "
                                  f"under --log.root/--log.experiment (here {os.path.join(*where)!r}; the run "
                                  f"continues in place in {str(run_dir)!r})")
    for resume in (str(run_dir), str(run_dir) + "/", str(run_dir / "model_3.pt")):
        check_typed_flags(cfg_with(resume=resume, log__root=str(tmp_path / "runs"), log__experiment="tracking"),
                          frozenset({"--log.root", "--log.experiment"}))
    check_typed_flags(cfg_with(resume=str(run_dir / "model_3.pt"), log__root=str(tmp_path / "elsewhere")),
                      frozenset({"--log.root"}))
    (tmp_path / "auto").mkdir()            # --resume auto searches --log.root, whatever the working directory holds
    monkeypatch.chdir(tmp_path)
    check_typed_flags(cfg_with(resume="auto", log__root=str(tmp_path / "elsewhere")), frozenset({"--log.root"}))


@pytest.mark.parametrize("name", ["cartpole", "mujoco"])
def test_an_empty_experiment_name_puts_runs_under_the_env_name_even_where_a_task_is_set(name):
    """--log.experiment '' means the env's name (--env.name, as its help says), never its task: the mujoco preset's
    runs of every task share ROOT/gymnasium, where --resume auto looks for them."""
    cfg = preset(name)
    cfg.log.experiment, cfg.log.root = "", "some/root"
    assert experiment_dir(cfg) == os.path.join("some/root", cfg.env.name)
    assert cfg.env.name == {"cartpole": "cartpole", "mujoco": "gymnasium"}[name]


def test_a_typed_env_task_the_env_does_not_read_is_refused_as_such_on_resume_auto(tmp_path):
    """Mutant: a typed --env.task narrowing `--resume auto`'s search even where the env does not read it. Cart-pole
    has no task: the run is found, and the flag is refused as one that applies only to the simulator adapters, not
    as a missing checkpoint of that task."""
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 8, 8, 1
    cfg.log.root, cfg.log.print_every = str(tmp_path), 100
    train.main(cfg)
    cfg.max_iterations, cfg.resume, cfg.env.task = 2, "auto", "Hopper-v4"
    with pytest.raises(UsageError, match=r"^--env.task applies only with --env.name gymnasium or isaaclab \(the run "
                                         r"uses cartpole\)"):
        train.main(cfg, frozenset({"--env.task", "--resume", "--max-iterations"}))


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
    """Mutant: typed_flags without the repeat check -> no UsageError."""
    with pytest.raises(UsageError) as refused:
        typed_flags(["cartpole", *argv])
    assert str(refused.value) == message
    once = typed_flags(["cartpole", "--seed", "1", "--policy.actor-hidden", "64", "64", "--dry-run"])
    assert once == {"--seed", "--policy.actor-hidden", "--dry-run"}


def test_cli_refuses_a_flag_given_twice_before_anything_is_written(tmp_path):
    """`train.py cartpole --seed 1 --seed 2` trained with seed 2, unsaid.
    Mutant: cli's typed_flags(argv) outside its try -> a UsageError traceback, status 1."""
    root = tmp_path / "runs"
    out = run_cli("cartpole", "--seed", "1", "--dry-run", "--log.root", str(root), "--seed", "2")
    assert_one_line_error(out, "error: --seed is given twice (1, then 2); keep one")
    assert not os.path.exists(root)


def test_a_flag_of_another_env_is_refused_before_resume_auto_looks_for_a_run(tmp_path):
    """`cartpole --env.num-motions 5 --resume auto` with no run said "--resume auto: no checkpoint": fixed, the run
    would still refuse the flag. --env.name is a launch setting, never the checkpoint's: no checkpoint is needed.
    Mutant: typed_task without check_typed_flags of the env's flags -> the first line is resume's."""
    out = run_cli("cartpole", "--env.num-motions", "5", "--resume", "auto", "--log.root", str(tmp_path / "runs"))
    assert_one_line_error(out, "error: --env.num-motions applies only with --env.name tracking (the run uses cartpole)")
    assert not os.path.exists(tmp_path / "runs")


def test_lam_typed_with_gamma_0_is_refused_since_gae_multiplies_it_by_gamma():
    """Mutant: the --ppo.lam rule removed from requirement() -> check_typed_flags raises nothing."""
    rewards, values, dones = torch.randn(5, 3), torch.randn(5, 3), torch.zeros(5, 3)
    last = torch.randn(3)
    a, _ = compute_gae(rewards, values, dones, last, gamma=0.0, lam=0.95)
    b, _ = compute_gae(rewards, values, dones, last, gamma=0.0, lam=0.0)
    assert torch.equal(a, b)                        # the premise: lambda is unread in value with gamma 0
    with pytest.raises(UsageError) as exc:
        check_typed_flags(cfg_with(ppo__gamma=0.0), frozenset({"--ppo.lam", "--ppo.gamma"}))
    assert str(exc.value) == ("--ppo.lam applies only with --ppo.gamma above 0 (the run uses 0: each advantage is its "
                              "own step's TD error, lambda times 0)")
    check_typed_flags(cfg_with(ppo__gamma=0.5), frozenset({"--ppo.lam"}))
    check_typed_flags(cfg_with(ppo__gamma=0.0), frozenset({"--ppo.gamma"}))     # the preset's lam: not typed


def test_cli_refuses_lam_with_gamma_0_in_one_line(tmp_path):
    """Mutant: the --ppo.lam rule removed -> the dry run succeeds (exit 0) and prints the plan."""
    out = run_cli("cartpole", "--ppo.gamma", "0", "--ppo.lam=0.9", "--dry-run", "--log.root", str(tmp_path / "runs"))
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: --ppo.lam applies only with --ppo.gamma above 0 ") \
        and out.stderr.count("\n") == 1, out.stderr
    assert out.stdout == "" and not (tmp_path / "runs").exists()


def test_desired_kl_typed_with_equal_lr_bounds_is_refused_since_the_lr_cannot_move():
    """Mutant: the --ppo.desired-kl bounds rule removed from requirement() -> check_typed_flags raises nothing."""
    for kl in (0.0, 1e-6, 0.05, 10.0):              # the premise: whatever the KL and its target, the LR is the bound
        for desired in (1e-3, 0.01, 1.0):
            assert adaptive_lr(1e-3, kl, desired, 1e-3, 1e-3) == 1e-3
    same = {"ppo__lr_min": 1e-3, "ppo__lr_max": 1e-3, "ppo__learning_rate": 1e-3}
    with pytest.raises(UsageError) as exc:
        validate(cfg_with(**same), 1, frozenset({"--ppo.desired-kl"}))
    assert str(exc.value) == ("--ppo.desired-kl applies only with --ppo.lr-min below --ppo.lr-max (the run uses 0.001 "
                              "for both: the adaptive LR cannot move)")
    validate(cfg_with(**same), 1, frozenset({"--ppo.lr-min", "--ppo.lr-max"}))   # a constant LR is fine, untyped KL
    validate(cfg_with(ppo__lr_min=1e-3), 1, frozenset({"--ppo.desired-kl"}))
    with pytest.raises(UsageError, match=r"^--ppo\.desired-kl applies only with --ppo\.schedule adaptive"):
        check_typed_flags(cfg_with(ppo__schedule="fixed", **same), frozenset({"--ppo.desired-kl"}))   # that first


# Which env reads each env-specific flag, read off make_env (envs/__init__.py) and train.py (the sampler).
READ_BY = {
    "--env.episode-length-s": {"cartpole", "tracking"},
    "--env.num-motions": {"tracking"},
    "--env.sampling-uniform-floor": {"tracking"},
    "--dist.sampler-sync-every": {"tracking"},
    "--env.task": {"gymnasium", "isaaclab"},
    "--env.action-scale": {"gymnasium", "isaaclab"},
    "--env.action-clip": {"gymnasium", "isaaclab"},
    "--env.actor-obs-groups": {"isaaclab"},
    "--env.critic-obs-groups": {"isaaclab"},
    "--env.launcher-args": {"isaaclab"},
    "--env.task-overrides": {"isaaclab"},
}
ENVS = ("cartpole", "tracking", "gymnasium", "isaaclab")


@pytest.mark.parametrize("env", ENVS)
def test_every_env_specific_flag_is_accepted_exactly_by_the_envs_that_read_it(env):
    cfg = cfg_with(env__name=env)
    for flag, envs in READ_BY.items():
        assert env_reads(cfg, flag) == (env in envs), flag
        if env in envs:
            check_typed_flags(cfg, frozenset({flag}))
        else:
            with pytest.raises(UsageError, match=rf"^{flag} applies only with --env\.name .*\(the run uses {env}\)"):
                check_typed_flags(cfg, frozenset({flag}))
    assert env_reads(cfg, "--ppo.gamma") and env_reads(cfg, "--env.num-envs")     # read by every env


def test_envs_and_read_by_cover_every_env_name_and_its_help_strings_name_the_envs_that_read_them():
    """An env added by docs/design.md's five edits must be in ENVS (and READ_BY), so that the test above checks its
    ENV_ONLY entries; and --env.name's help and every env flag's help name the envs (`cartpole/tracking: ...`)."""
    assert set(ENVS) == set(typing.get_args(typing.get_type_hints(EnvConfig)["name"]))
    helps = field_helps(EnvConfig)
    assert all(env in helps["name"] for env in ENVS), helps["name"]
    for flag, envs in READ_BY.items():
        if flag.startswith("--env."):
            named = helps[flag.removeprefix("--env.").replace("-", "_")].split(":")[0].removesuffix(" only")
            assert set(named.split("/")) == envs, (flag, named)


def field_helps(cls) -> dict[str, str]:
    """{field: the help string under it} read off the class's source, as tyro reads it."""
    (tree,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    return {field.target.id: doc.value.value for field, doc in zip(tree.body, tree.body[1:])
            if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)}


def test_of_several_refused_flags_the_first_in_sorted_order_is_named():
    cfg = cfg_with(env__name="cartpole", ppo__schedule="fixed")
    typed = frozenset({"--rollout.mode", "--ppo.lr-max", "--env.num-motions", "--seed"})
    with pytest.raises(UsageError, match=r"^--env\.num-motions applies only with --env\.name tracking"):
        check_typed_flags(cfg, typed)
    with pytest.raises(UsageError, match=r"^--ppo\.lr-max applies only with --ppo\.schedule adaptive"):
        check_typed_flags(cfg, typed - {"--env.num-motions"})


def test_a_global_env_count_of_one_still_overrides_a_typed_env_count():
    with pytest.raises(UsageError, match=r"^--env\.num-envs applies only with --env\.global-num-envs 0 \(the run "
                                         r"uses 1, split across the ranks\)"):
        check_typed_flags(cfg_with(env__global_num_envs=1), frozenset({"--env.num-envs"}))
    check_typed_flags(cfg_with(env__global_num_envs=0), frozenset({"--env.num-envs"}))


def test_a_run_directory_reached_through_a_symlinked_log_root_is_in_the_experiment(tmp_path):
    """The comparison is of real paths: --log.root given as a link to where the run directory lies holds it."""
    run_dir = tmp_path / "real" / "tracking" / "2026-12-01_09-00-00"
    run_dir.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    flags = frozenset({"--log.root", "--log.experiment"})
    check_typed_flags(cfg_with(resume=str(run_dir), log__root=str(tmp_path / "link"), log__experiment="tracking"),
                      flags)
    linked_run = tmp_path / "link" / "tracking" / run_dir.name
    check_typed_flags(cfg_with(resume=str(linked_run), log__root=str(tmp_path / "real")), flags)
    with pytest.raises(UsageError, match=r"^--log\.root applies only with --resume auto"):
        check_typed_flags(cfg_with(resume=str(linked_run), log__root=str(tmp_path)), frozenset({"--log.root"}))


def test_a_resumed_run_directory_named_through_a_symbolic_link_lies_where_its_target_does(tmp_path):
    """`--resume LINK --log.root ROOT`, LINK a symbolic link to a run under ROOT/cartpole, was refused as a run
    directory outside --log.root/--log.experiment (the link's own folder was compared), though the run continues in
    ROOT/cartpole (found resuming a sweep's run through a link). A link whose target lies elsewhere is still refused.
    Mutant: in_experiment_dir compares only os.path.dirname(os.path.abspath(cfg.resume)) (before the fix)."""
    run_dir = tmp_path / "runs" / "cartpole" / "2026-12-06_09-00-00"
    run_dir.mkdir(parents=True)
    (run_dir / "model_3.pt").write_bytes(b"")
    (tmp_path / "link").symlink_to(run_dir)
    for resume in (str(tmp_path / "link"), str(tmp_path / "link") + "/"):
        check_typed_flags(cfg_with(resume=resume, log__root=str(tmp_path / "runs"), log__experiment="cartpole"),
                          frozenset({"--log.root", "--log.experiment"}))
    with pytest.raises(UsageError, match="^--log.root applies only with --resume auto, a checkpoint file, or a run"):
        check_typed_flags(cfg_with(resume=str(tmp_path / "link"), log__root=str(tmp_path / "elsewhere"),
                                   log__experiment="cartpole"), frozenset({"--log.root"}))
