"""Check that an env keeps the VecEnv protocol (envs/base.py) where the runner first meets it, so that a mistake in
a new env is one line naming the field to fix rather than a shape error deep in the model, or silently wrong numbers.

Run once: on the env as built, on its reset (one host sync: its values are finite), and on the first step of a
run (no host sync). Every later step's extras too, host-side only (names, types, shapes: no sync): an env fills them
on the steps where episodes end, so a mistake there can first show mid-run.
"""

import numbers

import torch

from dist.errors import RunError

GROUPS = ("policy", "critic")
ATTRIBUTES = ("num_envs", "num_actions", "obs_dims", "log_keys", "sampler", "generator")   # what the runner reads
METHODS = ("reset", "step", "state_dict", "load_state_dict")
PROTOCOL = "see the VecEnv protocol in envs/base.py"


def fail(name: str, what: str) -> None:
    raise RunError(f"env {name!r}: {what} ({PROTOCOL})")


def a_type(value) -> str:
    """'an int', 'a list': the type of `value` as a message names it."""
    kind = type(value).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


RUNNER_PREFIXES = ("Train/", "Loss/", "Policy/", "Perf/", "Comm/", "Control/")   # what train.py logs itself


def check_built(env, name: str, num_envs: int) -> None:
    """The env's declared sizes, before anything is built from them."""
    missing = [what for what in ATTRIBUTES + METHODS if not hasattr(env, what)]
    if missing:                       # else an AttributeError from wherever the runner first reads one
        fail(name, f"the env has no {', '.join(missing)} (the runner reads the attributes {', '.join(ATTRIBUTES)} "
                   f"and calls {', '.join(METHODS)})")
    if not isinstance(env.generator, torch.Generator):
        fail(name, f"env.generator is {a_type(env.generator)}, not a torch.Generator (the env's RNG, seeded "
                   f"with the seed make_env passes; checkpoints save its state per rank)")
    if not isinstance(env.num_envs, numbers.Integral) or isinstance(env.num_envs, bool) or env.num_envs != num_envs:
        fail(name, f"env.num_envs is {env.num_envs!r}, but {num_envs} envs were asked for (make_env passes "
                   f"--env.num-envs per rank; the env must build exactly that many, an int)")
    missing = [g for g in GROUPS if g not in env.obs_dims]
    if missing:
        fail(name, f"env.obs_dims has no {' or '.join(map(repr, missing))} group (it has {sorted(env.obs_dims)}); "
                   f"declare both, giving the critic the policy's observation when it has nothing privileged")
    if isinstance(env.log_keys, str):      # ("Episode/x") is a str: its letters became metric names, a KeyError later
        fail(name, f"env.log_keys is the str {env.log_keys!r}, not a tuple of names; a tuple of one name needs its "
                   f"comma: ({env.log_keys!r},)")
    # The runner's own metrics share the env's (sum, count) vector: a name twice, or one of the runner's, added the
    # env's values into it (a reward of 1e6 logged as the episode reward).
    taken = [k for i, k in enumerate(env.log_keys) if k in env.log_keys[:i] or k == "Episode/return"
             or k.startswith(RUNNER_PREFIXES)]
    if taken:
        fail(name, f"env.log_keys names {taken[0]!r} twice or as one of the runner's metrics (its names: "
                   f"Episode/return and those under {', '.join(RUNNER_PREFIXES)}); give the env's metric another name")
    sampler = env.sampler
    if sampler is not None and not (isinstance(getattr(sampler, "local_counts", None), torch.Tensor)
                                    and callable(getattr(sampler, "commit_global", None))):
        fail(name, f"env.sampler is {a_type(sampler)} without a tensor local_counts and a commit_global(summed) "
                   f"method (the runner sums the counts over ranks; see envs/motions.py), or set it to None")
    # An empty action space or observation group (a Box of shape (0,), a group whose every term is left out) made
    # the model and its normalizers of width 0: a broadcast error inside the rollout, after the start-up lines.
    sizes = {"env.num_actions": env.num_actions, **{f"env.obs_dims[{g!r}]": env.obs_dims[g] for g in GROUPS}}
    for what, size in sizes.items():
        # A gym space's shape, (3,), is the usual slip (Isaac Lab's spaces are shaped): it failed as a TypeError
        # in the comparison below, or later inside nn.Linear for a float.
        if not isinstance(size, numbers.Integral) or isinstance(size, bool):
            fail(name, f"{what} is {a_type(size)} ({size!r}), not an int: the width of a [num_envs, width] tensor "
                       f"(e.g. space.shape[-1], not space.shape)")
        if not size > 0:
            fail(name, f"{what} is {size}; the policy needs at least one action and one observation feature in each "
                       f"group: check the env's action space and observation groups")
    check_state(env.state_dict(), name)


def check_state(state, name: str, where: str = "env.state_dict()") -> None:
    """The env's checkpointed state: tensors in (nested) dicts under names without '/'. Rollout ranks send it as
    named tensors ({'a': {'b': t}} as 'a/b'), where anything else was a traceback, and only there."""
    if not isinstance(state, dict):
        fail(name, f"{where} must be a dict of tensors ({{}} when the env has no sampler or curriculum), got "
                   f"{type(state).__name__}")
    for key, value in state.items():
        if not isinstance(key, str) or "/" in key:
            fail(name, f"{where} has the key {key!r}; a key must be a str without '/' (nested names are nested dicts)")
        if isinstance(value, dict):
            check_state(value, name, f"{where}[{key!r}]")
        elif not isinstance(value, torch.Tensor):
            fail(name, f"{where}[{key!r}] is {a_type(value)}, not a tensor: the sampler or curriculum state "
                       f"that checkpoints save is tensors in (nested) dicts")


def check_obs(obs, env, name: str, where: str, device: torch.device) -> None:
    if not isinstance(obs, dict):
        fail(name, f"{where} must be a dict of observation groups, got {type(obs).__name__}")
    for group in GROUPS:
        if group not in obs:
            fail(name, f"{where} has no observation group {group!r} (it has {sorted(obs)})")
        value, expected = obs[group], (env.num_envs, env.obs_dims[group])
        if not isinstance(value, torch.Tensor):
            fail(name, f"{where}[{group!r}] must be a torch.Tensor, got {type(value).__name__}")
        if tuple(value.shape) != expected:
            fail(name, f"{where}[{group!r}] has shape {list(value.shape)}, expected [num_envs, obs_dims[{group!r}]] "
                       f"= {list(expected)}")
        check_tensor(name, f"{where}[{group!r}]", value, torch.float32, device)


def check_tensor(name: str, what: str, value, dtype: torch.dtype, device: torch.device) -> None:
    if value.dtype != dtype:
        fail(name, f"{what} has dtype {value.dtype}, expected {dtype}")
    if value.device != device:
        fail(name, f"{what} is on {value.device}, expected the run's device {device} (the env gets it from make_env)")


def check_reset(env, result, name: str, device: torch.device) -> dict:
    """reset()'s (obs, extras), checked, its values finite too (one host sync): a NaN or inf would reach the
    normalizers' first shift before the first rollout's check_finite; returns obs."""
    if not (isinstance(result, tuple) and len(result) == 2):
        fail(name, "reset() must return (obs, extras)")
    check_obs(result[0], env, name, "reset()'s obs", device)
    for group in GROUPS:
        bad = ~torch.isfinite(result[0][group])
        if bad.any():
            n, feature = (int(i) for i in bad.nonzero()[0])
            fail(name, f"reset()'s obs[{group!r}] holds {result[0][group][n, feature].item()} at env {n} feature "
                       f"{feature}; make the env's reset produce finite observations")
    return result[0]


def check_step(env, result, name: str, device: torch.device, bootstrap: bool) -> None:
    """One step's (obs, reward, terminated, truncated, extras); `bootstrap`: time-outs need extras['final_obs']."""
    obs, reward, terminated, truncated, extras = unpack_step(result, name)
    check_obs(obs, env, name, "step()'s obs", device)
    for what, value, dtype in (("reward", reward, torch.float32), ("terminated", terminated, torch.bool),
                               ("truncated", truncated, torch.bool)):
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (env.num_envs,):
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            fail(name, f"step()'s {what} must be a [num_envs] = [{env.num_envs}] tensor, got {shape}")
        check_tensor(name, f"step()'s {what}", value, dtype, device)
    check_extras(env, extras, name, bootstrap, device)


def unpack_step(result, name: str) -> tuple:
    if not (isinstance(result, tuple) and len(result) == 5):
        fail(name, "step() must return (obs, reward, terminated, truncated, extras)")
    return result


def check_extras(env, extras, name: str, bootstrap: bool, device: torch.device) -> None:
    """A step's extras: 'log' (names declared, values scalars) and 'final_obs' (there when time-outs bootstrap; its
    groups, shapes, dtype and device as the obs'). No host sync."""
    if not isinstance(extras, dict) or not isinstance(extras.get("log"), dict):   # not None: {} when nothing logged
        fail(name, "step()'s extras must be a dict with 'log', a dict ({} when the env logs nothing)")
    if bootstrap and "final_obs" not in extras:
        fail(name, "step()'s extras has no 'final_obs': the observation groups before the auto-reset, which a "
                   "time-out is bootstrapped from (or train with --ppo.no-bootstrap-time-outs)")
    for key, value in extras["log"].items():
        if key not in env.log_keys:
            fail(name, f"step() logged {key!r}, which env.log_keys {tuple(env.log_keys)} does not declare")
        # A 0-d tensor or a number adds into the iteration's sums; a [1] tensor does not broadcast into one of them.
        if isinstance(value, torch.Tensor) and value.dim() != 0 or \
                not isinstance(value, (torch.Tensor, numbers.Real)):
            got = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else a_type(value)
            fail(name, f"step()'s extras['log'][{key!r}] must be a scalar (a 0-d tensor or a number: one value per "
                       f"step, e.g. a mean over the envs), got {got}")
    if "final_obs" in extras:   # often built only on the steps where episodes end: a mistake shows mid-run
        check_obs(extras["final_obs"], env, name, "step()'s extras['final_obs']", device)


def step_checker(env, name: str, device: torch.device, bootstrap: bool):
    """`collect_rollout`'s `check`, for every step of a run: `check_step` on the first, `check_extras` on the others."""
    checked_first = False

    def check(result) -> None:
        nonlocal checked_first
        if not checked_first:
            check_step(env, result, name, device, bootstrap)
            checked_first = True
        else:
            check_extras(env, unpack_step(result, name)[4], name, bootstrap, device)
    return check
