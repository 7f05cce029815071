"""Any registered Isaac Lab 3.0 task behind the VecEnv protocol of envs/base.py:

    torchrun --nproc-per-node 8 train.py isaaclab --env.task Isaac-Velocity-Rough-G1 --env.num-envs 4096

Start-up follows Isaac Lab 3.0.0. The task's env config is parsed first (with --env.task-overrides, the
Hydra-style selectors such as physics=isaacsim_physx that pick one of the task's own backend presets),
because it decides which runtime must start (Isaac Sim/Kit for PhysX or RTX cameras, nothing for kitless
Newton); `launch_simulation` then starts that runtime and the env is built inside it. The runtime lives
as long as the process and is closed at exit with the process's exit status (Kit ends the process with
the status it is given). Each rank simulates its own envs on its own GPU (cuda:LOCAL_RANK) with seed
rank_seed(--seed, rank); nothing about the simulation crosses ranks. With more than one rank the launcher is told
`distributed`, so Kit pins its renderer to the rank's GPU too.

Isaac Lab resets finished envs inside `step` (same-step autoreset) and, with the env config's
`compute_final_obs` set, hands the observation from before that reset in `extras["final_obs"]`: exactly
what a time-out must be bootstrapped from, so the adapter requires it.
"""

import argparse
import atexit
import contextlib
import difflib
import inspect
import numbers
import shlex
import sys
import warnings

import torch

from envs.base import MissingSimulator
from envs.gymnasium import import_task_module

INSTALL_HINT = ("make setup-isaaclab   (Isaac Lab 3.0 next to this repo in .venv-isaaclab, Python 3.12: run there, as "
                "make train PRESET=isaaclab does; see docs/simulators.md)")


def simulation_device(device: torch.device) -> str:
    """This rank's simulation device: the learner's GPU. Isaac Lab has no distributed CPU mode."""
    if device.type != "cuda":
        raise ValueError(f"--env.name isaaclab simulates on GPUs (cuda:LOCAL_RANK per rank), but this rank's device "
                         f"is {device}: run on a CUDA machine (train.py: with --dist.device auto or cuda)")
    return str(device)


def import_isaaclab():
    """Isaac Lab 3.0's launch and config API, with its tasks registered in gymnasium."""
    try:
        import gymnasium
        import isaaclab_tasks  # noqa: F401  (registers the Isaac-* tasks with gymnasium)
        from isaaclab.app import add_launcher_args, launch_simulation
        from isaaclab_tasks.utils import parse_env_cfg
    except ImportError as exc:
        raise MissingSimulator(f"--env.name isaaclab needs Isaac Lab 3.0 (isaaclab, isaaclab_tasks; {exc}): "
                               f"{INSTALL_HINT}") from exc
    return gymnasium, add_launcher_args, launch_simulation, parse_env_cfg


class LauncherParser(argparse.ArgumentParser):
    """A launcher flag's bad value (--livestream 5, --viz with no value) is a ValueError naming --env.launcher-args,
    which the runner says in one line; argparse's own error printed its usage and exited the process from inside
    the env's build, past the runner's error handling."""

    def error(self, message):
        raise ValueError(f"--env.launcher-args: {message}")


def launcher_namespace(add_launcher_args, extra_args: str, sim_device: str, distributed: bool) -> argparse.Namespace:
    """Isaac Lab's launcher flags (--viz, --kit_args, --livestream, ...) from --env.launcher-args, with this
    rank's device and `distributed` (more than one rank: Kit pins its renderer to that device) filled in."""
    parser = LauncherParser(prog="--env.launcher-args", add_help=False)
    add_launcher_args(parser)
    try:
        tokens = shlex.split(extra_args)
    except ValueError as exc:       # an unclosed quote
        raise ValueError(f"--env.launcher-args: cannot split {extra_args!r} into flags ({exc}); close its "
                         f"quotes") from exc
    if any(token == "--device" or token.startswith("--device=") for token in tokens):
        raise ValueError("--env.launcher-args must not set --device: each rank simulates on its own GPU "
                         "(cuda:LOCAL_RANK, from torchrun)")
    namespace, unknown = parser.parse_known_args(tokens)
    if any(token == "--physics" or token.startswith("--physics=") for token in unknown):
        raise ValueError("--env.launcher-args: Isaac Lab 3.0's launcher has no --physics flag; choose the task's "
                         "physics preset with --env.task-overrides physics=NAME (e.g. physics=isaacsim_physx)")
    if unknown:
        raise ValueError(f"--env.launcher-args: Isaac Lab's launcher does not know {' '.join(unknown)}")
    namespace.device, namespace.distributed = sim_device, distributed
    return namespace


def process_exit_code() -> int:
    """The status this process is ending with, as seen from an atexit handler: n when `sys.last_exc` is a
    `SystemExit(n)` (what `train.cli` records before it returns n to `sys.exit`; 0 for None, 1 for a message), 130
    after an uncaught KeyboardInterrupt, 1 after any other uncaught exception, else 0. (A plain `sys.exit(n)` leaves
    no trace there, so other code that exits with n after building the env should record it so, or call
    `IsaacLabEnv.close(n)` first.)"""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)   # last_exc: Python >= 3.12
    if isinstance(exc, SystemExit):
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1   # as CPython exits
    return 0 if exc is None else 130 if isinstance(exc, KeyboardInterrupt) else 1


def group_error(flag: str, group: str, value) -> str:
    """Why Isaac Lab's observation group `group` cannot be an input, and what in the task config fixes it."""
    if hasattr(value, "keys"):      # a dict (or TensorDict) of separate terms
        return (f"{flag}: observation group {group!r} is a dict of terms; set its concatenate_terms=True in the task "
                f"config")
    what = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    return (f"{flag}: observation group {group!r} is {what}, not a [num_envs, ...] tensor; fix the group in the task "
            f"config or leave it out of {flag}")


class IsaacLabEnv:
    def __init__(self, task: str, num_envs: int, device: torch.device, seed: int,
                 actor_obs_groups: tuple[str, ...] = ("policy",), critic_obs_groups: tuple[str, ...] = ("policy",),
                 action_scale: float = 1.0, action_clip: float | None = None, launcher_args: str = "",
                 task_overrides: tuple[str, ...] = ()):
        sim_device = simulation_device(device)
        gym, add_launcher_args, launch_simulation, parse_env_cfg = import_isaaclab()
        name = import_task_module(task)     # module:TaskId, a task of an extension project that its package registers
        if name not in gym.registry:
            close = difflib.get_close_matches(name, [other for other in gym.registry if other.startswith("Isaac")], n=5)
            raise ValueError(f"unknown --env.task {task!r} for Isaac Lab; "
                             + (f"did you mean: {', '.join(close)}" if close else "a task of an extension project is "
                                "written package:TaskId (importing the package registers it)"))
        distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        launcher = launcher_namespace(add_launcher_args, launcher_args, sim_device, distributed)
        self.action_scale, self.action_clip = action_scale, action_clip

        # Always an explicit list where parse_env_cfg takes one, even empty: isaaclab_tasks' Hydra resolution
        # (hydra.register_task) reads sys.argv[1:] when handed overrides=None, i.e. this script's own flags.
        # An isaaclab_tasks whose parse_env_cfg takes none still runs the task's defaults; one taking **kwargs (a
        # wrapper) is handed it too.
        parameters = inspect.signature(parse_env_cfg).parameters
        takes_overrides = "overrides" in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values())
        overrides = {"overrides": list(task_overrides)} if takes_overrides else {}
        if task_overrides and not takes_overrides:
            raise MissingSimulator(f"--env.task-overrides: this isaaclab_tasks' parse_env_cfg takes no overrides "
                                   f"(signature {inspect.signature(parse_env_cfg)}); leave the flag out for the "
                                   f"task's defaults, or {INSTALL_HINT}")
        env_cfg = parse_env_cfg(name, device=sim_device, num_envs=num_envs, **overrides)
        env_cfg.seed = seed
        if not hasattr(env_cfg, "compute_final_obs"):
            raise ValueError("this Isaac Lab has no `compute_final_obs` env option (isaac-sim/IsaacLab#6219), so the "
                             "observation before an auto-reset is lost and time-outs cannot be bootstrapped: "
                             "update Isaac Lab")
        env_cfg.compute_final_obs = True
        # From here on the runtime lives as long as the process, also when building the env fails: Kit ends the
        # process when its runtime closes, so closing it here would end the process before the error (e.g. an
        # --env.*-obs-groups that does not fit) reached the runner's one line on stderr. `close` at exit ends it
        # with the process's status.
        self.env, self._runtime = None, contextlib.ExitStack()
        try:
            self._runtime.enter_context(launch_simulation(env_cfg, launcher))
        except SystemExit as exc:       # 3.0.0 logs why Isaac Sim (Kit) cannot start (e.g. not installed), then exits
            raise MissingSimulator(f"--env.task {task}: Isaac Lab could not start the Isaac Sim (Kit) runtime that "
                                   f"this task's physics or renderer needs (its error above, exit {exc.code or 1}); "
                                   f"if Isaac Sim is not installed there, install it or pick a kitless physics preset "
                                   f"of the task (G1's: --env.task-overrides physics=newton_mjwarp)") from exc
        atexit.register(self.close)
        self.env = gym.make(name, cfg=env_cfg)
        self._describe(task, device, seed, actor_obs_groups, critic_obs_groups)

    def _describe(self, task, device, seed, actor_obs_groups, critic_obs_groups) -> None:
        """Read sizes, limits and metric names off the built env; check it runs where the learner does."""
        self.unwrapped = self.env.unwrapped
        self.device = torch.device(self.unwrapped.device)
        if self.device != torch.device(device):
            raise ValueError(f"Isaac Lab built {task} on {self.device}, but this rank learns on {device}: check "
                             f"--env.launcher-args for options that move the simulation")
        space = self.unwrapped.single_action_space
        if space.shape is None or len(space.shape) != 1 or space.dtype.kind != "f":   # a 1-D float Box
            raise ValueError(f"--env.task {task}: needs a 1-D continuous (Box) action space, got {space}")
        self.num_envs, self.num_actions = self.unwrapped.num_envs, space.shape[0]
        self.max_episode_length = int(self.unwrapped.max_episode_length)
        # A finite-horizon task asks for time-outs to be treated as terminal (no bootstrap).
        self.finite_horizon = bool(self.unwrapped.cfg.is_finite_horizon)
        self.group_names = {"policy": tuple(actor_obs_groups), "critic": tuple(critic_obs_groups)}
        self.sampler = None
        # Draws the initial episode lengths at reset; the runner checkpoints its state with the other RNGs.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # Isaac Lab fills extras["log"] in its first reset, so that reset names every metric this task
        # logs; the runner needs the names up front (same metric layout on every rank).
        obs, extras = self.env.reset()
        # The runner's first reset() takes this reset instead of resetting again: a second full reset runs every
        # reset event and curriculum term twice (a terrain curriculum demotes robots that have not moved yet), and
        # RSL-RL's wrapper resets once too.
        self._just_reset = True
        self.obs_dims = {name: group.shape[1] for name, group in self._groups(obs).items()}
        if "critic" in obs and "critic" not in actor_obs_groups + critic_obs_groups:   # RSL-RL would feed it the critic
            warnings.warn(f"--env.task {task} has a privileged observation group 'critic' that no input uses: the "
                          f"critic sees {list(critic_obs_groups)}; --env.critic-obs-groups policy critic gives it both")
        self.log_keys = tuple(extras.get("log", {}))
        self._warned_keys: set[str] = set()
        self.task = task
        self._log(extras)      # a metric that is not one number is named here, at start-up

    def _groups(self, obs: dict) -> dict[str, torch.Tensor]:
        """Our `policy`/`critic` inputs: the configured Isaac Lab groups, each flattened, concatenated in order."""
        groups = {}
        for name, flag in (("policy", "--env.actor-obs-groups"), ("critic", "--env.critic-obs-groups")):
            parts = []
            for group in self.group_names[name]:
                if group not in obs:
                    raise ValueError(f"{flag}: this task has no observation group {group!r}; it has {sorted(obs)}")
                value = obs[group]
                if not isinstance(value, torch.Tensor) or value.dim() < 2:
                    raise ValueError(group_error(flag, group, value))
                parts.append(value.flatten(1))
            groups[name] = torch.cat(parts, dim=1)
        return groups

    def env_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """What the simulator receives for the policy's `actions`: scaled, then clipped if configured."""
        actions = actions * self.action_scale
        return actions.clamp(-self.action_clip, self.action_clip) if self.action_clip is not None else actions

    def reset(self):
        if not self._just_reset:
            self.env.reset()
        self._just_reset = False
        # Spread episode ends over the time limit (as RSL-RL does for Isaac Lab): otherwise every env times
        # out at the same step and the rollouts see synchronized resets.
        self.unwrapped.episode_length_buf.copy_(torch.randint(
            0, self.max_episode_length, (self.num_envs,), generator=self.generator, device=self.device))
        # The reset's observations predate the spread: terms that read episode time (phase, time left) would show
        # step 0 to the first action. RSL-RL's runner fetches them again after the spread, through the wrapper's
        # get_observations, which is this (no history update: the reset already filled history terms).
        if hasattr(self.unwrapped, "observation_manager"):
            obs = self.unwrapped.observation_manager.compute()
        else:       # a DirectRLEnv task has no manager
            obs = self.unwrapped._get_observations()
        return self._groups(obs), {"log": {}}

    def step(self, actions: torch.Tensor):
        obs, reward, terminated, truncated, extras = self.env.step(self.env_actions(actions))
        if self.finite_horizon:
            terminated, truncated = terminated | truncated, torch.zeros_like(truncated)
        # Isaac Lab may flag a failure and a time-out in the same step; a failure is never bootstrapped.
        truncated = truncated & ~terminated
        done = terminated | truncated
        groups = self._groups(obs)
        if "final_obs" not in extras and bool(done.any()):
            raise RuntimeError("Isaac Lab reset envs without extras['final_obs'] although compute_final_obs is set")
        # extras["final_obs"] is only refreshed on steps that reset some env: take it where an env finished.
        final = self._groups(extras["final_obs"]) if "final_obs" in extras else groups
        final_obs = {name: torch.where(done[:, None], final[name], groups[name]) for name in groups}
        # Isaac Lab writes rewards and flags into buffers it reuses next step: hand out copies.
        return groups, reward.clone(), terminated.clone(), truncated, {"final_obs": final_obs, "log": self._log(extras)}

    def _log(self, extras: dict) -> dict[str, torch.Tensor]:
        """extras["log"] as scalar tensors. Isaac Lab keeps the last reset's values there between resets;
        the runner averages them over every step, exactly as RSL-RL does."""
        log = extras.get("log", {})
        new = set(log) - set(self.log_keys) - self._warned_keys
        if new:
            warnings.warn(f"Isaac Lab logged {sorted(new)}, which its first reset did not name; they are not "
                          f"reported (the cross-rank metric layout is fixed at start-up)")
            self._warned_keys |= new
        return {key: self._scalar(key, log[key]) for key in self.log_keys if key in log}

    def _scalar(self, key: str, value) -> torch.Tensor:
        """One logged value as a 0-d tensor. A task's own code may log a per-env tensor (RSL-RL's logger takes its
        mean) or None: that is named, not a reshape error from inside torch."""
        try:
            if isinstance(value, numbers.Real):
                # Filled in on the device: Isaac Lab logs some metrics as Python numbers (.item()s) and keeps them
                # between resets, and torch.as_tensor(number, device=cuda) copies from the host, a device sync per
                # such metric at every step. Through float64, so rounded to float32 (inf on overflow) as as_tensor does.
                tensor = torch.full((), float(value), dtype=torch.float64, device=self.device).to(torch.float32)
            else:
                tensor = torch.as_tensor(value, dtype=torch.float32, device=self.device)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            tensor = None
        if tensor is None or tensor.numel() != 1:
            what = type(value).__name__ if tensor is None else f"a tensor of shape {list(tensor.shape)}"
            raise ValueError(f"--env.task {self.task}: extras['log'][{key!r}] is {what}, not one number; make the "
                             f"task log one value per name (e.g. the mean over its envs)")
        return tensor.reshape(())

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"the Isaac Lab adapter has no checkpointed state, got keys {sorted(state)}")

    def close(self, exit_code: int | None = None) -> None:
        """Close the env, then the simulation runtime with `exit_code` (default: the status the process is
        ending with). Kit ends the process here, with that status. Safe to call twice."""
        if self._runtime is None:
            return
        atexit.unregister(self.close)
        runtime, self._runtime = self._runtime, None
        code = process_exit_code() if exit_code is None else exit_code
        try:
            if self.env is not None:      # None when building it failed
                self.env.close()
        finally:
            # launch_simulation hands its launchers the status of a SystemExit raised in its block, and Kit
            # exits with it; leaving the block normally would end every run with status 0.
            if code:
                runtime.__exit__(SystemExit, SystemExit(code), None)
            else:
                runtime.close()
