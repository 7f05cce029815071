"""Any gymnasium task with a continuous action space (MuJoCo's Hopper-v4, HalfCheetah-v4, ...) behind
the VecEnv protocol of envs/base.py.

The adapter is deliberately thin: numpy <-> torch at the boundary, action scaling and clipping, and
gymnasium 1.x's autoreset semantics mapped onto ours. Observation and reward normalization live in the
learner (ppo/normalizer.py), where their statistics are merged across ranks and checkpointed.

Autoreset: the vector env runs in SAME_STEP mode, so a finished sub-env is reset inside `step` and its
last observation arrives in `infos["final_obs"]` (masked by `infos["_final_obs"]`). gymnasium's default
NEXT_STEP mode would instead return the last observation now and silently ignore the next action; that
is why the mode is set explicitly here.
"""

import difflib
import importlib

import numpy as np
import torch

from envs.base import MissingSimulator

INSTALL_HINT = "make setup-mujoco   (or: pip install 'gymnasium[mujoco]')"


def import_gymnasium():
    """The gymnasium package, or an error naming the install command."""
    try:
        import gymnasium
    except ImportError as exc:
        raise MissingSimulator(f"--env.name gymnasium needs gymnasium (and mujoco for MuJoCo tasks): "
                               f"{INSTALL_HINT}") from exc
    return gymnasium


def import_task_module(task: str) -> str:
    """gymnasium's `module:TaskId`: import `module` (another package, gymnasium-robotics or a lab's own robots,
    registers its tasks when it is imported); returns TaskId (the task alone when no module is given)."""
    module, colon, name = task.rpartition(":")
    # gymnasium splits at every ":" and imports the module itself: an empty or relative one fails there (a ValueError
    # or TypeError of importlib's that names no flag), after this function found TaskId registered
    if colon and (not module or not name or ":" in module or module.startswith(".")):
        raise ValueError(f"--env.task {task!r} is not TaskId or module:TaskId (one ':', an absolute module name and a "
                         f"task id on either side, e.g. gymnasium_robotics:AdroitHandDoor-v1)")
    if module:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            raise MissingSimulator(f"--env.task {task}: cannot import {module} ({exc}); install the package that "
                                   f"registers {name}, or correct the module's name") from exc
    return name


def check_task(gym, task: str) -> None:
    """Refuse a task gymnasium does not know, naming the close ones (`module:TaskId` imports `module` first)."""
    module, name = task.rpartition(":")[0], import_task_module(task)
    if name not in gym.registry:
        known = sorted(other for other in gym.registry if other.split("-")[0].lower() == name.split("-")[0].lower())
        close = known or difflib.get_close_matches(name, list(gym.registry), n=3)
        hint = (f"registered: {', '.join(close)}" if close else
                f"importing {module} registered no such task" if module else
                "a task of another package is written module:TaskId (e.g. gymnasium_robotics:AdroitHandDoor-v1): "
                "importing the module registers it")
        raise ValueError(f"unknown --env.task {task!r} for gymnasium; {hint}")


OLD_API = ("the env is written for the old gym API; port it to gymnasium's (reset -> (obs, info), step -> (obs, "
           "reward, terminated, truncated, info))")


def returned(result) -> str:
    """What a reset or step returned, as the old-API message names it: 'a tuple of 4', 'ndarray'."""
    return f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__


def check_reset_and_step(env, task: str) -> None:
    """What broke the vector env's first reset or step with an error from inside gymnasium or numpy, after the
    model was built: an env written for gym < 0.26 (reset -> obs, step -> (obs, reward, done, info)), or half ported
    (reset only), an unpacking or attribute error; an observation of another shape than the space declares, "Output
    array is the wrong shape". One unseeded reset and one step (the action nearest 0 in bounds) of a sub-env's own
    env, while the env is built, name them; the run's own reset reseeds every sub-env."""
    result = env.unwrapped.reset()     # not through the env checker, which asserts on an info that is no dict
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
        raise ValueError(f"--env.task {task}: reset() returned {returned(result)}, not gymnasium's (obs, info dict): "
                         f"{OLD_API}")
    declared = env.unwrapped.observation_space    # the env's own: a wrapper may reshape what it returns, and say so
    if np.shape(result[0]) != declared.shape:
        raise ValueError(f"--env.task {task}: reset()'s observation has shape {np.shape(result[0])}, but the env "
                         f"declares observation_space {declared}; make the two agree")
    space = env.unwrapped.action_space       # the action goes to the env beneath the wrappers: in its own bounds
    result = env.unwrapped.step(np.clip(np.zeros(space.shape), space.low, space.high).astype(space.dtype))
    if not (isinstance(result, tuple) and len(result) == 5):   # gymnasium's wrappers would unpack it, and fail
        raise ValueError(f"--env.task {task}: step() returned {returned(result)}, not gymnasium's (obs, reward, "
                         f"terminated, truncated, info): {OLD_API}")
    reward = np.asarray(result[1])
    if reward.shape != () or reward.dtype.kind not in "fiu":  # the vector env's float array takes one number per env
        raise ValueError(f"--env.task {task}: step()'s reward is {type(result[1]).__name__} of shape "
                         f"{list(reward.shape)}, dtype {reward.dtype}, not a single number: return float(reward)")


class GymnasiumEnv:
    def __init__(self, task: str, num_envs: int, device: torch.device, seed: int,
                 action_scale: float = 1.0, action_clip: float | None = None):
        gym = import_gymnasium()
        check_task(gym, task)
        try:
            self.env = gym.make_vec(task, num_envs=num_envs, vectorization_mode="sync",
                                    vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
        # mujoco missing for a MuJoCo task, box2d for CarRacing; an ImportError for tasks moved to another package
        # (MuJoCo v2/v3 to gymnasium-robotics). gymnasium's message says what to install.
        except (gym.error.DependencyNotInstalled, ImportError) as exc:
            missing_mujoco = isinstance(exc, gym.error.DependencyNotInstalled) and "mujoco" in str(exc).lower()
            hint = f"; {INSTALL_HINT}" if missing_mujoco else ""
            raise MissingSimulator(f"--env.task {task}: {exc}{hint}") from exc
        action_space, obs_space = self.env.single_action_space, self.env.single_observation_space
        # A 1-D float Box. An integer Box is discrete too: the policy's actions would be cast to integers on their way.
        continuous = isinstance(action_space, gym.spaces.Box) and action_space.dtype.kind == "f"
        if not continuous or len(action_space.shape) != 1:
            raise ValueError(f"--env.task {task}: needs a 1-D continuous (Box) action space, got {action_space}")
        if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
            raise ValueError(f"--env.task {task}: needs a 1-D Box observation space, got {obs_space}")
        if self.env.spec.max_episode_steps is None:
            raise ValueError(f"--env.task {task}: has no time limit (max_episode_steps); PPO rollouts need one")
        check_reset_and_step(self.env.envs[0], task)

        self.num_envs, self.device = num_envs, torch.device(device)
        self.num_actions = action_space.shape[0]
        self.obs_dims = {"policy": obs_space.shape[0], "critic": obs_space.shape[0]}
        self.max_episode_length = self.env.spec.max_episode_steps
        self.log_keys, self.sampler = (), None
        self.action_scale, self.action_clip = action_scale, action_clip
        self.action_dtype = action_space.dtype
        # Actions outside the space are invalid input to a gymnasium env (CleanRL's ClipAction): always clip
        # to the bounds, after the optional symmetric --env.action-clip. The bounds keep the space's dtype: a
        # float64 bound rounded to float32 (0.3 -> 0.30000001) would clip to just outside the space.
        self.action_low = torch.as_tensor(action_space.low, device=self.device)
        self.action_high = torch.as_tensor(action_space.high, device=self.device)
        # Draws the sub-env seeds at reset; the runner checkpoints its state with the other RNGs.
        self.generator = torch.Generator().manual_seed(seed)

    def _to_torch(self, array) -> torch.Tensor:
        return torch.as_tensor(array, dtype=torch.float32).to(self.device)

    def _groups(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        # Plain gymnasium tasks have one observation; actor and critic both read it.
        return {"policy": obs, "critic": obs}

    def env_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """What the simulator receives for the policy's `actions`: scaled, clipped, then clipped to the bounds."""
        actions = actions * self.action_scale
        if self.action_clip is not None:
            actions = actions.clamp(-self.action_clip, self.action_clip)
        return torch.maximum(torch.minimum(actions, self.action_high), self.action_low)

    def reset(self):
        # One drawn seed per sub-env: gymnasium's `reset(seed=s)` would give sub-env i the seed s + i, so
        # rank r's env 1 and rank r + 1's env 0 would replay the same episode starts.
        seeds = torch.randint(0, 2**31 - 1, (self.num_envs,), generator=self.generator).tolist()
        obs, _ = self.env.reset(seed=seeds)
        return self._groups(self._to_torch(obs)), {"log": {}}

    def step(self, actions: torch.Tensor):
        env_actions = self.env_actions(actions).cpu().numpy().astype(self.action_dtype)
        obs, reward, terminated, truncated, infos = self.env.step(env_actions)
        final_obs = obs.copy()
        if "_final_obs" in infos:
            for i in infos["_final_obs"].nonzero()[0]:
                final_obs[i] = infos["final_obs"][i]
        terminated = torch.as_tensor(terminated, dtype=torch.bool).to(self.device)
        # gymnasium's TimeLimit flags a time-out even when the last step also failed; a failure must not be
        # bootstrapped, so it wins.
        truncated = torch.as_tensor(truncated, dtype=torch.bool).to(self.device) & ~terminated
        return (self._groups(self._to_torch(obs)), self._to_torch(reward), terminated, truncated,
                {"final_obs": self._groups(self._to_torch(final_obs)), "log": {}})

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"gymnasium envs have no checkpointed state, got keys {sorted(state)}")
