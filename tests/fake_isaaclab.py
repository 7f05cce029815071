"""A fake `isaaclab`/`isaaclab_tasks` pair with the API surface of the released isaaclab 3.0.0 that
envs/isaaclab.py uses, so that a test against the fake fails where the release would:

- `isaaclab.app.add_launcher_args(parser)` adds exactly the flags 3.0.0's Kit launcher defines (same
  names, defaults, choices). There is no `--physics`: 3.0.0's `launch_simulation` reads a `physics` key
  only when the calling script adds one.
- `isaaclab.app.launch_simulation(cfg, launcher_args=None)` is a context manager that, when the namespace
  says `distributed`, puts the sim on cuda:LOCAL_RANK (as 3.0.0 does), starts a launcher and closes it
  with the block's exit status: the code of a SystemExit, 1 for any other exception, else 0 (also for a
  KeyboardInterrupt, which 3.0.0's block does not catch). A task config whose physics is Isaac Sim PhysX
  needs Kit; Kit's launcher ends the process with that status when it closes (and also closes from its
  own atexit handler); without Isaac Sim installed (`Record.kit_installed`) it logs 3.0.0's error and
  raises SystemExit(1) before yielding. Kitless physics (Newton, the G1 task's default) starts no runtime.
- `isaaclab_tasks.utils.parse_env_cfg(task_name, device=None, num_envs=None, use_fabric=None,
  overrides=None)`, where an override `physics=NAME` picks one of the task's physics presets. With
  overrides=None it reads them from sys.argv[1:], as 3.0's `isaaclab_tasks.utils.hydra.register_task` does
  (a script's own flags there are handed to Hydra, which refuses them); the fake refuses any it cannot apply.
- `import isaaclab_tasks` registers the task under 3.0.0's id `Isaac-Velocity-Rough-G1` with gymnasium
  (the id is real, the env is not: a point mass moved by its actions).

The env follows 3.0.0's ManagerBasedRLEnv where the adapter relies on it: `reset() -> (obs_dict,
extras)`, `step() -> (obs_dict, rew, terminated, truncated, extras)` with same-step autoreset, reward and
flag buffers reused in place, `extras["final_obs"]` refreshed only on steps that reset some env (and only
with `compute_final_obs`), `extras["log"]` kept between resets, `observation_manager.compute()` observing the
current state (the policy group's last column is episode progress, so a stale observation shows). It simulates
on the CPU: `install` and the tests replace `envs.isaaclab.simulation_device`, so the adapter asks for
"cuda:<rank>" while running here.
"""

import argparse
import atexit
import contextlib
import importlib.machinery
import os
import sys
import types

import gymnasium
import torch

TASK = "Isaac-Velocity-Rough-G1"
PHYSICS_PRESETS = ("isaacsim_physx", "ovphysx", "physx", "newton_mjwarp", "newton_kamino")   # the task's, in 3.0.0
DEFAULT_PHYSICS = "newton_mjwarp"
MAX_EPISODE_LENGTH = 8
TERMINATE_ABOVE = 1.0     # the fake "falls" when its first coordinate passes this


class Record:
    """What the fake saw: launches (with the runtime's open/closed state and exit status) and the envs it built."""

    def __init__(self):
        self.launches, self.envs, self.runtime_open, self.finite_horizon = [], [], False, False
        self.kit_installed = True
        self.entry_point = lambda cfg, **kw: FakeRLEnv(cfg, self, **kw)   # a test may build another env instead


class FakeEnvCfg:
    def __init__(self, finite_horizon):
        self.sim = types.SimpleNamespace(device="cuda:0", physics=DEFAULT_PHYSICS, use_fabric=True)
        self.scene = types.SimpleNamespace(num_envs=4096)
        self.seed = None
        self.compute_final_obs = False
        self.is_finite_horizon = finite_horizon


class FakeObservationManager:
    """3.0.0's ObservationManager as far as the adapter uses it: `compute()` returns every group's observation
    from the env's current state (episode time included), without updating history terms by default."""

    def __init__(self, env):
        self.env = env

    def compute(self, update_history: bool = False):
        return self.env._observe()      # looked up per call: a test may replace _observe


class FakeRLEnv(gymnasium.Env):
    """A point mass moved by actions: policy obs (x, y, episode progress), critic obs a 2-step history."""

    def __init__(self, cfg, record, render_mode=None):
        assert record.runtime_open, "Isaac Lab envs can only be built inside launch_simulation"
        record.envs.append(self)
        self.cfg, self.record, self.closed = cfg, record, False
        self.num_envs, self.device = cfg.scene.num_envs, torch.device("cpu")
        self.max_episode_length = MAX_EPISODE_LENGTH
        self.single_action_space = gymnasium.spaces.Box(-float("inf"), float("inf"), (2,))
        self.action_space = self.observation_space = self.single_action_space
        self.pos, self.prev = torch.zeros(self.num_envs, 2), torch.zeros(self.num_envs, 2)
        self.episode_length_buf = torch.zeros(self.num_envs, dtype=torch.long)
        self.reward_buf = torch.zeros(self.num_envs)
        self.reset_terminated = torch.zeros(self.num_envs, dtype=torch.bool)
        self.reset_time_outs = torch.zeros(self.num_envs, dtype=torch.bool)
        self.extras, self.received_actions, self.extra_log, self.full_resets = {}, [], {}, 0
        self.observation_manager = FakeObservationManager(self)

    def _observe(self):
        progress = (self.episode_length_buf.float() / self.max_episode_length)[:, None]
        return {"policy": torch.cat([self.pos, progress], 1), "critic": torch.stack([self.pos, self.prev], 1)}

    def _reset_idx(self, ids):
        self.pos[ids], self.prev[ids], self.episode_length_buf[ids] = 0.0, 0.0, 0
        self.extras["log"] = {"Metrics/constant": 0.5, "Episode_Termination/time_out": torch.tensor(float(len(ids))),
                              **self.extra_log}

    def reset(self, seed=None, options=None):
        self.full_resets += 1
        self._reset_idx(torch.arange(self.num_envs))
        return self._observe(), self.extras

    def step(self, actions):
        self.received_actions.append(actions.clone())
        self.prev, self.pos = self.pos.clone(), self.pos + 0.1 * actions
        self.episode_length_buf += 1
        self.reward_buf[:] = -self.pos.square().sum(1)
        self.reset_terminated[:] = self.pos[:, 0] > TERMINATE_ABOVE
        self.reset_time_outs[:] = self.episode_length_buf >= self.max_episode_length
        done_ids = (self.reset_terminated | self.reset_time_outs).nonzero()[:, 0]
        if len(done_ids):
            if self.cfg.compute_final_obs:
                self.extras["final_obs"] = self._observe()
            self._reset_idx(done_ids)
        return self._observe(), self.reward_buf, self.reset_terminated, self.reset_time_outs, self.extras

    def close(self):
        self.closed = True


class _StoreAndMarkExplicit(argparse.Action):
    """3.0.0's `--device` action: store the value and note that it was given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_explicit", True)


def add_launcher_args(parser: argparse.ArgumentParser) -> None:
    """The launcher flags of isaaclab 3.0.0 (KitLauncher.add_launcher_args), nothing more."""
    group = parser.add_argument_group("launcher arguments")
    group.add_argument("--livestream", type=int, default=-1, choices={0, 1, 2})
    group.add_argument("--xr", action="store_true", default=False)
    group.add_argument("--device", type=str, action=_StoreAndMarkExplicit, default="cuda:0")
    group.add_argument("--visualizer", "--viz", type=lambda value: value.split(","), default=None)
    group.add_argument("--verbose", action="store_true")
    group.add_argument("--info", action="store_true")
    group.add_argument("--experience", type=str, default="")
    group.add_argument("--deterministic", action="store_true", default=False)
    group.add_argument("--kit_args", type=str, default="")
    group.add_argument("--anim_recording_enabled", action="store_true")
    group.add_argument("--anim_recording_start_time", type=float, default=0)
    group.add_argument("--anim_recording_stop_time", type=float, default=10)
    group.add_argument("--max_visible_envs", type=int, default=argparse.SUPPRESS)


class FakeKitLauncher:
    """Kit: closing it ends the process with the status it is given (also from its own atexit handler)."""

    def __init__(self, launch):
        self.launch = launch
        atexit.register(lambda: self.close(1 if getattr(sys, "last_exc", None) is not None else 0))

    def close(self, exit_code=0):
        self.launch["exit_code"] = exit_code
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


class FakeKitlessLauncher:
    def __init__(self, launch):
        self.launch = launch

    def close(self, exit_code=0):
        self.launch["exit_code"] = exit_code


def fake_modules(record: Record) -> dict[str, types.ModuleType]:
    def package(name):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        return module

    @contextlib.contextmanager
    def launch_simulation(cfg, launcher_args=None):
        args = vars(launcher_args) if isinstance(launcher_args, argparse.Namespace) else launcher_args
        args = {} if args is None else args
        if args.get("physics"):
            cfg.sim.physics = args["physics"]
        if args.get("distributed", False):
            args["device"] = cfg.sim.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        launch = {"device": args.get("device"), "distributed": args.get("distributed", False),
                  "visualizer": args.get("visualizer"), "physics": cfg.sim.physics, "seed": cfg.seed,
                  "num_envs": cfg.scene.num_envs, "compute_final_obs": cfg.compute_final_obs, "exit_code": None}
        record.launches.append(launch)
        kit = cfg.sim.physics == "isaacsim_physx"
        if kit and not record.kit_installed:    # 3.0.0's _ensure_isaac_sim_available: logs its hint, then exits
            print("[ERROR] Isaac Sim is not installed or not found on PYTHONPATH.", file=sys.stderr)
            raise SystemExit(1)
        launcher = FakeKitLauncher(launch) if kit else FakeKitlessLauncher(launch)
        record.runtime_open = True
        exit_code = 0
        try:
            yield None
        except SystemExit as exc:
            exit_code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            raise
        except Exception:
            exit_code = 1
            raise
        finally:
            record.runtime_open = False
            launcher.close(exit_code)

    def parse_env_cfg(task_name, device=None, num_envs=None, use_fabric=None, overrides=None):
        if isinstance(overrides, str):
            raise TypeError(f"'overrides' must be a list or tuple of 'key=value' strings, not a bare string: "
                            f"{overrides!r}")
        if task_name not in gymnasium.registry:
            raise ValueError(f"task {task_name!r} is not registered")
        cfg = FakeEnvCfg(record.finite_horizon)
        for override in sys.argv[1:] if overrides is None else overrides:
            key, _, value = override.partition("=")
            if key != "physics" or value not in PHYSICS_PRESETS:
                raise ValueError(f"the fake knows only physics=<one of {PHYSICS_PRESETS}>, got {override!r}")
            cfg.sim.physics = value
        if device is not None:
            cfg.sim.device = device
        if use_fabric is not None:
            cfg.sim.use_fabric = use_fabric
        if num_envs is not None:
            cfg.scene.num_envs = num_envs
        return cfg

    isaaclab, app = package("isaaclab"), types.ModuleType("isaaclab.app")
    app.add_launcher_args, app.launch_simulation, isaaclab.app = add_launcher_args, launch_simulation, app
    tasks, utils = package("isaaclab_tasks"), types.ModuleType("isaaclab_tasks.utils")
    utils.parse_env_cfg, tasks.utils = parse_env_cfg, utils
    return {"isaaclab": isaaclab, "isaaclab.app": app, "isaaclab_tasks": tasks, "isaaclab_tasks.utils": utils}


def spec(record: Record) -> gymnasium.envs.registration.EnvSpec:
    # What `import isaaclab_tasks` does for every task: register it with gymnasium, env checker off.
    return gymnasium.envs.registration.EnvSpec(TASK, entry_point=lambda cfg, **kw: record.entry_point(cfg, **kw),
                                               disable_env_checker=True)


def install(rank: int) -> Record:
    """For spawned ranks and subprocesses: install the fake for the whole process; this rank 'simulates'
    on cuda:<rank>."""
    import envs.isaaclab

    record = Record()
    sys.modules.update(fake_modules(record))
    gymnasium.registry[TASK] = spec(record)
    envs.isaaclab.simulation_device = lambda device: f"cuda:{rank}"
    return record


def install_for_test(monkeypatch) -> Record:
    """For one test (undone after it): the fake modules and task, simulating on cuda:0."""
    import envs.isaaclab

    record = Record()
    for name, module in fake_modules(record).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(gymnasium.registry, TASK, spec(record))
    monkeypatch.setattr(envs.isaaclab, "simulation_device", lambda device: "cuda:0")
    return record
