"""Refuse a flag the user typed that the resulting config never reads: "never a silent fallback".

`validate()` sees values only, and a value that does not apply is harmless when a preset set it (the mujoco
preset's --env.task under --env.name cartpole) but a mistake when the user typed it (--rollout.max-staleness 3
with --rollout.mode sync trains exactly as without it). So train.py passes the flags from the command line, and
`requirement` says, for every field that is read only under some condition, what that condition is. Each one
was checked in the code that reads the field (noted beside it); a field read in every configuration has no rule.
Kept apart from configs/config.py, which holds the fields and their value checks.
"""

import os

from dist.errors import UsageError

# Fields that only some envs read (envs/__init__.py passes each env its own).
ENV_ONLY = {
    "--env.episode-length-s": ("cartpole", "tracking"),   # the simulators take the task's own time limit
    "--env.num-motions": ("tracking",),
    "--env.sampling-uniform-floor": ("tracking",),
    "--dist.sampler-sync-every": ("tracking",),           # the others have no adaptive sampler (env.sampler None)
    "--env.task": ("gymnasium", "isaaclab"),
    "--env.action-scale": ("gymnasium", "isaaclab"),
    "--env.action-clip": ("gymnasium", "isaaclab"),
    "--env.actor-obs-groups": ("isaaclab",),
    "--env.critic-obs-groups": ("isaaclab",),
    "--env.launcher-args": ("isaaclab",),
    "--env.task-overrides": ("isaaclab",),
}
ADAPTIVE_ONLY = ("--ppo.desired-kl", "--ppo.lr-min", "--ppo.lr-max")    # ppo/update.py, ppo/minibatch_step.py
ROLLOUT_RANKS_ONLY = ("--rollout.mode", "--rollout.sync", "--rollout.dtype", "--rollout.recompute",
                      "--rollout.max-staleness")                          # read by rollout_ranks.py alone


def typed_flags(argv: list[str]) -> frozenset[str]:
    """The flags on a command line, spelled as in the errors: `--ppo.reward_clip=5` -> `--ppo.reward-clip`; a flag
    given more than once is refused (tyro keeps the last value, unsaid).

    tyro accepts `--a.b-c V`, `--a.b-c=V` and underscores; a boolean's off switch is `--a.no-b` (no field's
    name starts with no_). `--help`, or a value that starts with --, names no field: no rule refers to it.
    """
    given: dict[str, list[tuple[str, str]]] = {}     # flag -> (spelling, value as typed) per occurrence
    for i, token in enumerate(argv):
        if token.startswith("--"):
            spelling, equals, value = token.partition("=")
            section, _, name = spelling[2:].replace("_", "-").rpartition(".")
            name = name.removeprefix("no-")
            if equals:
                value = value or "''"      # --log.experiment= is an empty name, and shown as one
            else:   # tyro refuses a value that starts with -- (the preset comes before every flag)
                values = argv[i + 1:]
                value = " ".join(values[:next((j for j, v in enumerate(values) if v.startswith("--")), len(values))])
            given.setdefault(f"--{section}.{name}" if section else f"--{name}", []).append((spelling, value))
    repeated = next((repeated_message(flag, uses) for flag, uses in given.items() if len(uses) > 1), None)
    if repeated:
        raise UsageError(repeated)
    return frozenset(given)


def repeated_message(flag: str, uses: list[tuple[str, str]]) -> str:
    """`--seed is given twice (1, then 2); keep one`: each value as typed, with its spelling where the spellings
    differ or a switch has no value (`--ppo.normalize-rewards, then --ppo.no-normalize-rewards`)."""
    bare = len({spelling for spelling, _ in uses}) == 1 and all(value for _, value in uses)
    shown = [value if bare else f"{spelling} {value}".rstrip() for spelling, value in uses]
    times = "twice" if len(uses) == 2 else f"{len(uses)} times"
    return f"{flag} is given {times} ({', '.join(shown[:-1])}, then {shown[-1]}); keep one"


def typed_task(cfg, typed: frozenset[str] | None) -> str | None:
    """The --env.task typed for an env that reads it (what --resume auto looks for), after the refusals of the
    command line that need no checkpoint: before resolve_resume, whose "no checkpoint" would hide the thing to fix.
    Of the typed-flag rules only the env's: --env.name is never the checkpoint's (a launch setting), while the other
    rules read settings a resume may take from it (validate() checks those once it has)."""
    check_typed_flags(cfg, frozenset(flag for flag in typed or () if not env_reads(cfg, flag)))
    return cfg.env.task if "--env.task" in (typed or ()) and env_reads(cfg, "--env.task") else None


def requirement(cfg, flag: str) -> str | None:
    """What `flag` needs to have any effect under `cfg`, and what the run uses instead; None when it applies."""
    if flag in ENV_ONLY and cfg.env.name not in ENV_ONLY[flag]:
        return f"--env.name {' or '.join(ENV_ONLY[flag])} (the run uses {cfg.env.name})"
    if flag == "--env.num-envs" and cfg.env.global_num_envs:      # resolve_num_envs overwrites it
        return f"--env.global-num-envs 0 (the run uses {cfg.env.global_num_envs}, split across the ranks)"
    if flag in ADAPTIVE_ONLY and cfg.ppo.schedule != "adaptive":
        return f"--ppo.schedule adaptive (the run uses {cfg.ppo.schedule})"
    # adaptive, but every step clamps the LR to [lr-min, lr-max], one value: the KL target never changes it
    # (ppo/kl_schedule.py, ppo/minibatch_step.py device_adaptive_lr)
    if flag == "--ppo.desired-kl" and cfg.ppo.lr_min == cfg.ppo.lr_max:
        return (f"--ppo.lr-min below --ppo.lr-max (the run uses {cfg.ppo.lr_min:g} for both: the adaptive LR cannot "
                f"move)")
    if flag == "--ppo.lam" and cfg.ppo.gamma == 0:     # ppo/gae.py: the trace decays by gamma * lam * not_done
        return "--ppo.gamma above 0 (the run uses 0: each advantage is its own step's TD error, lambda times 0)"
    if flag == "--ppo.reward-clip" and not cfg.ppo.normalize_rewards:   # train.py: the RewardNormalizer's clip
        return "--ppo.normalize-rewards (the run does not normalize rewards)"
    if flag == "--dist.bucket-mb" and cfg.dist.grad_sync != "bucketed":   # dist/grad_sync.py
        return f"--dist.grad-sync bucketed (the run uses {cfg.dist.grad_sync})"
    if flag == "--policy.activation" and not (cfg.policy.actor_hidden or cfg.policy.critic_hidden):   # actor_critic.mlp
        return ("a hidden layer in --policy.actor-hidden or --policy.critic-hidden (both are empty: the actor and "
                "critic are linear)")
    if flag in ROLLOUT_RANKS_ONLY and not cfg.rollout.ranks:
        return f"--rollout.ranks K > 0 (the run uses {cfg.rollout.ranks}: every rank collects and learns)"
    if flag == "--rollout.max-staleness" and cfg.rollout.mode != "async":   # sync mode allows lag 0, always
        return f"--rollout.mode async (the run uses {cfg.rollout.mode})"
    if flag in ("--log.root", "--log.experiment") and cfg.resume != "auto" and os.path.isdir(cfg.resume) \
            and not in_experiment_dir(cfg):
        return (f"--resume auto, a checkpoint file, or a run directory under --log.root/--log.experiment (here "
                f"{experiment_dir(cfg)!r}; the run continues in place in {cfg.resume!r})")
    return None


def in_experiment_dir(cfg) -> bool:
    """Whether the run directory --resume names lies in --log.root/--log.experiment (where the stop message's command,
    which repeats the run's own flags, points), as named or, through a symbolic link, as it really lies."""
    parents = {os.path.realpath(os.path.dirname(path))     # abspath and realpath drop a trailing slash
               for path in (os.path.abspath(cfg.resume), os.path.realpath(cfg.resume))}
    return os.path.realpath(experiment_dir(cfg)) in parents


def experiment_dir(cfg) -> str:
    """--log.root/--log.experiment (default: the env's name): where a run's directory is made and --resume auto
    looks."""
    return os.path.join(cfg.log.root, cfg.log.experiment or cfg.env.name)


def check_typed_flags(cfg, typed: frozenset[str]) -> None:
    """Raise UsageError for the first typed flag (in sorted order) that has no effect under `cfg`."""
    for flag in sorted(typed):
        needs = requirement(cfg, flag)
        if needs is not None:
            raise UsageError(f"{flag} applies only with {needs}")


def env_reads(cfg, flag: str) -> bool:
    """Whether the configured env reads `flag` (True for flags of every env): a resume compares only those."""
    return cfg.env.name in ENV_ONLY.get(flag, (cfg.env.name,))


def env_label(cfg) -> str:
    """The env as messages name it: the task for the envs that read --env.task, else --env.name (a preset's
    task left over under another --env.name would name an env the run does not simulate)."""
    return cfg.env.task if env_reads(cfg, "--env.task") and cfg.env.task else cfg.env.name
