"""Which checkpoint a run starts from, and whether it fits the config: decided before anything is built.

Four ways to continue, all resolved here on every rank from the file system alone (no communication):
- `--resume PATH`: that checkpoint, continued in a new run directory;
- `--resume auto`: the newest checkpoint of this experiment, continued in its own run directory;
- `--resume RUN_DIR`: that run directory's newest checkpoint, continued in place (what a stopped run prints);
- a torchrun restart (`--max-restarts`, TORCHELASTIC_RESTART_COUNT > 0): the last complete checkpoint
  of the run directory the first attempt created (found by TORCHELASTIC_RUN_ID), continued in place.
From the command line, a resumed run keeps the settings of the checkpoint's run: only the flags typed now,
and the launch settings (LAUNCH: ranks, devices, where runs go), come from this command line.
"""

import dataclasses
import glob
import json
import os
import re
import shlex
import sys
import types
import typing

from configs.config import FLOAT32_MAX, check_experiment_name
from configs.presets import PRESETS
from configs.typed_flags import env_reads, requirement
from dist.checkpoint import find_run_dir, latest_checkpoint, newest_run_with_checkpoint
from dist.errors import UsageError
from dist.log_root import undecodable
from dist.setup import launch_int

# Fields that decide tensor shapes or which states a checkpoint holds, or that only shape a new policy (its
# initial weights and action std, which the checkpoint's replace): a mismatch fails before build.
MUST_MATCH = {
    "--env.name": ("env", "name"), "--env.task": ("env", "task"), "--env.num-envs": ("env", "num_envs"),
    "--env.num-motions": ("env", "num_motions"), "--policy.actor-hidden": ("policy", "actor_hidden"),
    "--policy.critic-hidden": ("policy", "critic_hidden"), "--policy.activation": ("policy", "activation"),
    "--policy.normalize-actor-obs": ("policy", "normalize_actor_obs"),
    "--policy.normalize-critic-obs": ("policy", "normalize_critic_obs"),
    "--ppo.normalize-rewards": ("ppo", "normalize_rewards"),
    "--policy.init-noise-std": ("policy", "init_noise_std"), "--policy.orthogonal-init": ("policy", "orthogonal_init"),
}


# What a resumed run never takes from its checkpoint: how this launch finds and writes runs, how many ranks do
# what (--dist.*, --rollout.ranks: resume works across layouts), how a step runs or Kit starts, and the env kind
# (the preset's). How rollout ranks collect (--rollout.mode, dtype, ...) is the run's and continues.
LAUNCH = {"--resume", "--dry-run", "--env.name", "--env.launcher-args", "--log.root", "--log.experiment",
          "--ppo.capture-step", "--rollout.ranks"}
LAUNCH_SECTIONS = ("dist",)


def settings(cfg):
    """(flag, owner, field, path in the saved config) of every setting: `--ppo.num-epochs` is
    (cfg.ppo, its `num_epochs` field, ("ppo", "num_epochs"))."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            for g in dataclasses.fields(value):
                yield f"--{f.name}.{g.name.replace('_', '-')}", value, g, (f.name, g.name)
        else:
            yield f"--{f.name.replace('_', '-')}", cfg, f, (f.name,)


def continue_saved_config(cfg, saved: dict, typed: frozenset[str], checkpoint: str | None = None
                          ) -> tuple[list[str], list[str]]:
    """Give `cfg` every setting of the checkpoint's run that the command line did not type (launch settings
    excepted), so that a resumed run continues as it was started, not with the preset's defaults; a field the
    checkpoint's version did not have takes what its run did (setting_before: the default, or BEFORE's). Returns the
    typed flags that change a setting, each as `FLAG VALUE (the checkpoint's run: FLAG VALUE)`, and the settings
    taken from the checkpoint that differ from what `cfg` had (the preset's), as `FLAG VALUE` (`(not read by this
    run)` added where this run leaves it unread), followed by the saved settings this version does not know (a newer
    version's), which are dropped, so the start-up says so. A refusal names the `checkpoint` file when given."""
    name = saved.get("env", {}).get("name")
    if name is not None and name != cfg.env.name:      # every other env setting would be the wrong env's
        refuse_other_env(cfg.env.name, name, checkpoint, picked_by_auto(cfg, checkpoint, "--env.name"))
    changed, taken, kept = [], [], []
    # one setting in two fields; a typed --env.global-num-envs 0 sets no count (the per-rank one continues)
    env_count_typed = "--env.num-envs" in typed or ("--env.global-num-envs" in typed and cfg.env.global_num_envs != 0)
    for flag, owner, field, path in settings(cfg):
        section = saved if len(path) == 1 else saved.get(path[0], {})
        if flag in LAUNCH or path[0] in LAUNCH_SECTIONS:
            continue
        if env_count_typed and flag in ("--env.num-envs", "--env.global-num-envs"):
            if flag == "--env.num-envs" and env_count(saved.get("env", {})) != env_count(vars(cfg.env)):
                changed.append(f"{as_flag(*env_count(vars(cfg.env)))} (the checkpoint's run: "
                               f"{as_flag(*env_count(saved.get('env', {})))})")
            continue
        ours = getattr(owner, field.name)
        if path[-1] not in section:
            theirs = setting_before(field, ours, flag, saved)
        else:
            theirs = section[path[-1]]
            theirs = tuple(theirs) if isinstance(ours, tuple) and isinstance(theirs, list) else theirs
            if flag not in typed and not fits_type(theirs, field.type):   # a typed value replaces it
                if requirement(cfg, flag) is not None:
                    # a value this run would not read (--rollout.recompute None of 2026-11-30 on a colocated run):
                    # left at this run's, and said, since typing the flag would be refused as unread
                    kept.append(f"{flag} {theirs} (not accepted by this version, not read by this run: left at "
                                f"{as_flag(flag, ours)})")
                    continue
                origin = typing.get_origin(field.type)
                kind = ("one of " + ", ".join(map(str, typing.get_args(field.type))) if origin is typing.Literal
                        else field.type if origin is tuple else getattr(field.type, "__name__", field.type))
                shown = f"{flag} {theirs}" if isinstance(theirs, bool) else as_flag(flag, theirs)   # not a switch
                where = f"--resume {checkpoint!r}: " if checkpoint else ""
                raise UsageError(f"{where}the checkpoint's run has {shown}, which this version does not accept "
                                 f"({kind}); pass {flag} to choose")
        if flag not in typed:
            setattr(owner, field.name, theirs)
            if ours != theirs:
                why = f" ({BEFORE[flag][1]})" if flag in BEFORE and path[-1] not in section else ""
                taken.append((flag, as_flag(flag, theirs) + why))
        elif ours != theirs:
            changed.append(f"{as_flag(flag, ours)} (the checkpoint's run: {as_flag(flag, theirs)})")
    # Said of a setting this run leaves unread (an async run's --rollout.mode, resumed colocated), once `cfg` is whole:
    # kept all the same, so that its next checkpoint continues it wherever a resume reads it.
    kept = [text + (" (not read by this run)" if requirement(cfg, flag) is not None else "") for flag, text in taken] \
        + kept
    known = {path for *_, path in settings(cfg)}
    saved_settings = [((key, sub), item) for key, section in saved.items() if isinstance(section, dict)
                      for sub, item in section.items()]
    saved_settings += [((key,), value) for key, value in saved.items() if not isinstance(value, dict)]
    kept += [f"{as_flag('--' + '.'.join(path).replace('_', '-'), item)} (not known to this version: dropped)"
             for path, item in saved_settings if path not in known]
    return changed, kept


# Settings whose default is not what a run from before the setting did: flag -> (the value that does it, given the
# checkpoint run's config, or None for the default; why, as the start-up says it). Rewards normalized before
# --ppo.reward-clip (942d2f1, 2026-11-30) were not clipped: the preset's clip at 10 would silently change what a
# resumed run trains on, and the largest float32 clip is none.
BEFORE = {"--ppo.reward-clip": (lambda saved: FLOAT32_MAX if saved.get("ppo", {}).get("normalize_rewards") else None,
                                "the checkpoint's run predates the flag and did not clip its normalized rewards: no "
                                "clip; pass --ppo.reward-clip to clip")}


def setting_before(field: dataclasses.Field, ours, flag: str = "", saved: dict | None = None):
    """A setting newer than a checkpoint, as the checkpoint's run (`saved`: its config) had it: what BEFORE says for
    `flag`, else the field's default (the behaviour before the setting existed), or `ours` for a field without a
    plain default."""
    then = BEFORE[flag][0](saved or {}) if flag in BEFORE else None
    if then is not None:
        return then
    return field.default if field.default is not dataclasses.MISSING else ours


def env_count(env: dict) -> tuple[str, int]:
    """The env count a run was given, as typed: (--env.global-num-envs, total) when set, else the per-rank one."""
    if env.get("global_num_envs"):
        return "--env.global-num-envs", env["global_num_envs"]
    return "--env.num-envs", env.get("num_envs")


def blame_checkpoint(error: UsageError, kept: list[str], path: str) -> UsageError:
    """A validate() error about a setting this resume took from the checkpoint (`kept`), saying so: it would read as
    if typed (`--ppo.num-epochs must be positive, got 0`). A typed flag refused for want of another setting blames
    that setting (`--ppo.desired-kl applies only with --ppo.schedule adaptive (the run uses linear)`)."""
    words = [word.strip("(),:;") for word in str(error).split(" ")]
    flags = [word for word in words if word.startswith("--")]    # "a minibatch of ... --ppo.num-micro-batches (6)"
    named = [words[4]] if words[1:4] == ["applies", "only", "with"] else flags
    # The first named flag the checkpoint set, not just the first flag: `--env.num-envs (512) must be divisible by
    # --ppo.num-mini-batches (3)` with the preset's env count and the checkpoint's minibatch count read as if typed.
    # Past the first, not --env.global-num-envs: a split names it as where the per-rank count came from.
    kept_as = {setting.split(" ", 1)[0]: setting for setting in kept}
    flag = next((word for i, word in enumerate(named) if word in kept_as
                 and (i == 0 or word != "--env.global-num-envs")), "")
    if not flag:
        return error
    if flag in MUST_MATCH:      # a resume keeps it (check_resume_fits): passing it would be refused, change the others
        others = [f for f in dict.fromkeys(flags) if f not in MUST_MATCH and f != "--env.global-num-envs"]
        way_out = f"change {' or '.join(others)}" if others else "start a new run to change it"
        return UsageError(f"{error} ({flag} is the checkpoint's run's, {path!r}, which a resume keeps: {way_out})")
    if flag == "--env.global-num-envs":   # 0 turns the split off and the checkpoint's per-rank count continues
        where = "" if repr(path) in str(error) else f", {path!r}"
        way_out = "" if f"pass {flag} " in str(error) else f": pass {flag} 0 to keep its per-rank --env.num-envs"
        return UsageError(f"{error} ({kept_as[flag]} is the checkpoint's run's{where}{way_out})")
    if flag != named[0]:      # the error leads with another flag: say which of its flags came from the checkpoint
        return UsageError(f"{error} ({kept_as[flag]} is the value of the checkpoint's run, {path!r}: pass {flag} to "
                          f"change it)")
    return UsageError(f"{error} (the value of the checkpoint's run, {path!r}: pass {flag} to change it)")


def refuse_other_env(ours: str, theirs: str, path: str | None = None, picked: str = ""):
    """--env.name is the preset's choice, never taken from a checkpoint: another env kind cannot continue. `picked`:
    picked_by_auto's way out, when --resume auto chose that checkpoint."""
    where = f"--resume {path!r}: " if path else ""
    # Not "or pass --env.name": the run would go on under this preset's experiment, where its --resume auto never looks
    trained = " or ".join(f"train.py {name}" for name, make in PRESETS.items() if make().env.name == theirs)
    raise UsageError(f"{where}--env.name {ours} does not match the checkpoint's --env.name {theirs}: resume it with "
                     f"the preset it was trained with ({trained}){picked}")


def picked_by_auto(cfg, path: str | None, flag: str) -> str:
    """What to add to a refusal of the checkpoint `path` as another env's (`flag`: --env.name or --env.task) when
    --resume auto picked it ("" otherwise). resolve_resume passes over the runs whose config_<iteration>.json names
    another env, so such a pick is a run from before those files were written: its env was known only once loaded,
    and auto would pick it again at every start, so the way out is naming the run or another experiment."""
    if cfg.resume != "auto" or not path:
        return ""
    run_dir = os.path.dirname(os.path.abspath(path))
    value = cfg.env.name if flag == "--env.name" else cfg.env.task
    return (f"; --resume auto picked {run_dir!r}, the run under {os.path.dirname(run_dir)!r} whose checkpoint was "
            f"written last, which has no config_<iteration>.json to say its env: pass --resume RUN_DIR with a run of "
            f"{flag} {value}, or give each {'preset' if flag == '--env.name' else 'task'} its own --log.experiment")


def fits_type(value, annotation) -> bool:
    """Whether a saved value is one the field accepts: a Literal's options, int, float, bool, str, None, a tuple
    whose elements fit (`tuple[int, ...]`: each an int)."""
    origin, options = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return value in options
    if origin is tuple and options:
        if not isinstance(value, tuple):
            return False
        each = options[:1] * len(value) if options[-1] is Ellipsis else options
        return len(value) == len(each) and all(map(fits_type, value, each))
    if origin in (typing.Union, types.UnionType):
        return any(fits_type(value, option) for option in options)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is type(None):
        return value is None
    return isinstance(value, origin or annotation)


def resume_command(argv: list[str], run_dir: str) -> str:
    """The command that continues `run_dir` in place: this run's (preset and flags, launch ones included) with
    --resume RUN_DIR instead of any --resume; launcher options (torchrun's) are not in argv."""
    kept, skip = [], False
    for token in argv:
        if not skip and token != "--resume" and not token.startswith("--resume="):
            kept.append(token)
        skip = token == "--resume"
    return shlex.join(["train.py", *kept, "--resume", os.path.abspath(run_dir)])


def as_flag(flag: str, value) -> str:
    """`value` as it is typed on the command line: `--policy.actor-hidden 128 128`, `--ppo.no-normalize-rewards`."""
    if isinstance(value, bool):
        section, _, name = flag.rpartition(".")
        return flag if value else f"{section}.no-{name}" if section else f"--no-{name[2:]}"
    if isinstance(value, (list, tuple)):
        return " ".join([flag, *map(str, value)])
    return f"{flag} {value if value != '' else repr(value)}"


def resolve_resume(cfg, experiment_dir: str, task: str | None = None,
                   env: str | None = None) -> tuple[str, str | None]:
    """(checkpoint to load or "", existing run directory to continue in, or None for a new one). `task`: a typed
    --env.task, which `--resume auto` looks for among the experiment's runs (the mujoco preset's runs of every task
    share one experiment); `env`: this run's --env.name, likewise (two presets given one --log.experiment share
    it)."""
    if undecodable(cfg.resume):   # the start-up's "resuming ..." line failed on a strict stdout, after the load
        raise UsageError(f"--resume {cfg.resume!r} holds bytes that are not text in the file system's encoding "
                         f"({sys.getfilesystemencoding()}); rename the file or its folder, or copy it to a path that "
                         f"is text")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if launch_int("TORCHELASTIC_RESTART_COUNT", 0) > 0 and run_id:
        run_dir = find_run_dir(experiment_dir, run_id)
        if run_dir is not None:
            return latest_checkpoint(run_dir) or (cfg.resume if cfg.resume != "auto" else ""), run_dir
    if cfg.resume == "auto":
        # a name too long to exist is the thing to fix, not the missing checkpoint (validate() checks the rest)
        check_experiment_name(os.path.basename(experiment_dir), os.path.dirname(experiment_dir))

        def ours(run_dir: str) -> bool:    # a run of another env or task would be refused once loaded
            saved = saved_env(run_dir)
            return ((env is None or saved.get("name") in (None, env))
                    and (task is None or saved.get("task") in (None, task)))
        run_dir = newest_run_with_checkpoint(experiment_dir, ours)
        if run_dir is None:
            of = f" of --env.task {task}" if task else f" of --env.name {env}" if env else ""
            other, there = newest_run_with_checkpoint(experiment_dir, lambda run: not ours(run)), ""
            if other is not None:     # the folder is not empty: say whose runs it holds
                theirs = saved_env(other)
                kind = f"--env.name {theirs['name']}" if theirs.get("name") not in (None, env) else \
                    f"--env.task {theirs.get('task')}"
                there = f" (the last-saved run there, {other!r}, is of {kind})"
            raise UsageError(f"--resume auto: no checkpoint{of} under {experiment_dir!r}{there}; check --log.root and "
                             f"--log.experiment, or start without --resume")
        return latest_checkpoint(run_dir), run_dir
    if os.path.isdir(cfg.resume):
        path = latest_checkpoint(cfg.resume)
        if path is None:
            raise UsageError(f"--resume {cfg.resume!r} is a directory without a model_<iteration>.pt checkpoint; pass "
                             f"a run directory that has one, a checkpoint file, or auto")
        return path, cfg.resume
    return cfg.resume, None


def saved_env(run_dir: str) -> dict:
    """The env settings (--env.name, --env.task, ...) a run directory's newest start wrote into its
    config_<iteration>.json ({} when unknown)."""
    starts = {int(m.group(1)): path for path in glob.glob(os.path.join(glob.escape(run_dir), "config_*.json"))
              if (m := re.search(r"config_(\d+)\.json$", path))}
    if not starts:
        return {}
    try:
        with open(starts[max(starts)]) as f:
            env = json.load(f)["config"]["env"]
    except (OSError, ValueError, KeyError, TypeError):      # unreadable, or not this layout
        return {}
    return env if isinstance(env, dict) else {}


def check_resume_fits(state: dict, cfg, path: str, restarted: bool) -> bool:
    """Raise UsageError naming the flag when the checkpoint cannot continue under `cfg`.

    Returns False when a restarted job finds its run already complete (nothing left to train).
    """
    saved = state["config"]
    for flag, (section, name) in MUST_MATCH.items():
        if not env_reads(cfg, flag):   # e.g. --env.task of a cartpole run: unused, and refused if typed to match
            continue
        ours, theirs = getattr(getattr(cfg, section), name), saved.get(section, {}).get(name)
        if name not in saved.get(section, {}):    # newer than the checkpoint: what its run did (setting_before)
            field = next(f for f in dataclasses.fields(getattr(cfg, section)) if f.name == name)
            theirs = setting_before(field, ours, flag, saved)
        if theirs is not None and tuple_or_value(ours) != tuple_or_value(theirs):
            total = cfg.env.global_num_envs
            if name == "num_envs" and total:      # split already: ours = total / ranks
                raise UsageError(f"--env.global-num-envs {total} gives {ours} envs per rank on {total // ours} "
                                 f"rank(s), the checkpoint {path!r} has {theirs} per rank; pass --env.global-num-envs "
                                 f"{theirs * (total // ours)} to resume it")
            if flag == "--env.name":
                refuse_other_env(ours, theirs, path, picked_by_auto(cfg, path, flag))
            hint = " per rank" if name == "num_envs" else ""      # a resume needs the same count per rank
            way_out = picked_by_auto(cfg, path, flag) if flag == "--env.task" else ""
            if not way_out and cfg.resume == "auto" and not restarted:   # a sweep's other arm: dropping the flag
                run_dir = os.path.dirname(os.path.abspath(path))          # would continue that arm, not this one
                way_out = (f"; --resume auto picked {run_dir!r}, the run under {os.path.dirname(run_dir)!r} "
                           f"whose checkpoint was written last: to continue a run of {as_flag(flag, ours)}, "
                           "pass --resume with its run directory")
            raise UsageError(f"{as_flag(flag, ours)} does not match the checkpoint's {as_flag(flag, theirs)}{hint} "
                             f"({path!r}); leave the flag out to keep the checkpoint's{way_out}")
    if state["iteration"] >= cfg.max_iterations:
        if restarted:
            return False
        raise UsageError(f"--max-iterations {cfg.max_iterations}: {path!r} is already at iteration "
                         f"{state['iteration']}; pass a larger --max-iterations to train further")
    return True


def shared_env_seed(cfg, checkpoint: dict | None) -> int:
    """The seed of what every rank's env shares (the tracking motion library): the checkpoint's when resuming,
    because its policy and sampler counts belong to those motions; a new --seed then restarts only the RNG
    streams. Saved as `env_seed`, so a run resumed with another --seed keeps its motions on every later resume."""
    if checkpoint is None:
        return cfg.seed
    return checkpoint.get("env_seed", checkpoint["config"].get("seed", cfg.seed))


def tuple_or_value(x):
    return tuple(x) if isinstance(x, (list, tuple)) else x

