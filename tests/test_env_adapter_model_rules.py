"""The gymnasium and Isaac Lab adapters and the actor-critic at their edges: the gymnasium adapter's clipping inside
float64 and float16 action spaces, its refusal of matrix and integer action spaces and of an observation of another
shape than its space, an unknown task version listing the registered ones, and the protocol sizes; the Isaac Lab
adapter's checks (one rank of a process group, the learner's device, the action space, compute_final_obs and the
final observations, a termination that survives the next step, observation groups, logged values); the actor's mean
and the value as the MLPs computed by hand, and build_actor_critic honouring every policy setting. Expected values
come from the spaces, the registry and the formulas, not from the code."""

import re
import sys

import gymnasium
import numpy as np
import pytest
import torch

import envs.isaaclab
from envs.gymnasium import GymnasiumEnv
from envs.isaaclab import IsaacLabEnv
from tests.fake_isaaclab import TASK, FakeRLEnv, install_for_test

pytestmark = pytest.mark.filterwarnings("ignore:.*is out of date:DeprecationWarning")


# ---- envs/gymnasium.py -----------------------------------------------------------------------------

class _Recorder(gymnasium.Env):
    """Records every action it receives; its action space is a Box with bounds float32 cannot hold."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (1,), dtype=np.float32)
    action_space = gymnasium.spaces.Box(-0.1, 0.3, (2,), dtype=np.float64)
    received: list = []

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, dtype=np.float32), {}

    def step(self, action):
        _Recorder.received.append(np.array(action))
        return np.zeros(1, dtype=np.float32), 0.0, False, False, {}


class _MatrixActions(_Recorder):
    action_space = gymnasium.spaces.Box(-1.0, 1.0, (2, 2), dtype=np.float32)


class _IntegerActions(_Recorder):
    action_space = gymnasium.spaces.Box(-3, 3, (2,), dtype=np.int64)


class _ObservesMoreThanDeclared(_Recorder):
    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, dtype=np.float32), {}


def register(monkeypatch, name, entry_point):
    spec = gymnasium.envs.registration.EnvSpec(name, entry_point=entry_point, max_episode_steps=5)
    monkeypatch.setitem(gymnasium.registry, name, spec)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_clipped_actions_stay_inside_a_float64_or_float16_action_space(monkeypatch, dtype):
    """The simulator gets its space's dtype, and an action clipped to the bounds is inside the space: for float64
    -0.1 and 0.3 exactly, not their float32 roundings -0.10000000149 and 0.30000001192, which lie outside."""
    register(monkeypatch, "Recorder-v0", _Recorder)
    monkeypatch.setattr(_Recorder, "received", [])
    monkeypatch.setattr(_Recorder, "action_space", gymnasium.spaces.Box(-0.1, 0.3, (2,), dtype=dtype))
    env = GymnasiumEnv("Recorder-v0", 2, torch.device("cpu"), seed=0)
    assert [a.tolist() for a in _Recorder.received] == [[0.0, 0.0]]     # the build's probe step (one sub-env)
    _Recorder.received.clear()
    env.reset()
    env.step(torch.tensor([[-5.0, 5.0], [0.25, -0.05]]))
    first, second = _Recorder.received
    assert first.dtype == dtype and second.dtype == dtype
    assert first.tolist() == [dtype(-0.1), dtype(0.3)]            # the bounds themselves
    assert second.tolist() == [dtype(np.float32(0.25)), dtype(np.float32(-0.05))]    # inside: untouched
    assert all(_Recorder.action_space.contains(a) for a in (first, second))


def test_a_matrix_action_space_is_refused(monkeypatch):
    """A Box action space must be 1-D: a (2, 2) Box would reach the policy as 2 actions and crash the simulator."""
    register(monkeypatch, "MatrixActions-v0", _MatrixActions)
    with pytest.raises(ValueError, match=r"MatrixActions-v0: needs a 1-D continuous \(Box\) action space"):
        GymnasiumEnv("MatrixActions-v0", 1, torch.device("cpu"), seed=0)


def test_an_integer_action_space_is_refused(monkeypatch):
    """An integer Box is a discrete action space: it was accepted, and the policy's Gaussian actions reached the
    simulator cast to integers (0.7 -> 0, -2.9 -> -2), silently. The Isaac Lab adapter already refused it."""
    register(monkeypatch, "IntegerActions-v0", _IntegerActions)
    with pytest.raises(ValueError, match=r"^--env.task IntegerActions-v0: needs a 1-D continuous \(Box\) action space, "
                                         r"got Box\(-3, 3, \(2,\), int64\)$"):
        GymnasiumEnv("IntegerActions-v0", 1, torch.device("cpu"), seed=0)


@pytest.mark.filterwarnings("ignore:.*is not within the observation space:UserWarning")   # gymnasium's env checker
def test_an_observation_of_another_shape_than_the_space_is_named_while_the_env_is_built(monkeypatch):
    """A 3-value observation from an env that declares Box (1,) broke the vector env's first reset, after the model
    was built, with numpy's "Output array is the wrong shape" (a traceback)."""
    register(monkeypatch, "ObservesMore-v0", _ObservesMoreThanDeclared)
    message = ("--env.task ObservesMore-v0: reset()'s observation has shape (3,), but the env declares "
               "observation_space Box(-1.0, 1.0, (1,), float32); make the two agree")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        GymnasiumEnv("ObservesMore-v0", 2, torch.device("cpu"), seed=0)


def test_an_unknown_version_in_any_case_lists_every_registered_version_of_that_task():
    """The family match ignores case and lists every version, not difflib's best three (which, case-sensitive,
    finds nothing for HOPPER)."""
    versions = sorted(name for name in gymnasium.registry if name.startswith("Hopper-"))
    assert len(versions) >= 4                                     # v2 ... v5: more than difflib would list
    with pytest.raises(ValueError) as exc:
        GymnasiumEnv("HOPPER-v9", 1, torch.device("cpu"), seed=0)
    assert str(exc.value) == f"unknown --env.task 'HOPPER-v9' for gymnasium; registered: {', '.join(versions)}"



def test_the_protocol_sizes_are_the_tasks():
    """num_actions, obs_dims and max_episode_length are Pendulum-v1's documented 1 torque, 3 observations (cos,
    sin, angular velocity) and 200-step time limit."""
    env = GymnasiumEnv("Pendulum-v1", 2, torch.device("cpu"), seed=0)
    assert (env.num_envs, env.num_actions, env.max_episode_length) == (2, 1, 200)
    assert env.obs_dims == {"policy": 3, "critic": 3}

# ---- envs/isaaclab.py ------------------------------------------------------------------------------

@pytest.fixture
def fake(monkeypatch):
    """The fake Isaac Lab 3.0 (tests/fake_isaaclab.py); every adapter built is closed at the end."""
    record = install_for_test(monkeypatch)
    closers = []
    monkeypatch.setattr(envs.isaaclab.atexit, "register", closers.append)   # the adapter's close, also on failure
    yield record
    for close in closers:
        close()


def test_one_rank_of_an_initialized_process_group_is_not_distributed(fake, monkeypatch):
    """`distributed` (Kit pins its renderer to the rank's GPU) means more than one rank, not just an initialized
    process group: torchrun with one process must launch like a plain run."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)
    assert fake.launches[-1]["distributed"] is False and fake.launches[-1]["device"] == "cuda:0"
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)
    assert fake.launches[-1]["distributed"] is True


def test_an_env_built_on_another_device_than_the_learner_is_refused(fake):
    """The fake simulates on the CPU; a learner on cuda:0 (nothing is allocated there) must be told, not handed
    CPU tensors."""
    with pytest.raises(ValueError, match=f"Isaac Lab built {TASK} on cpu, but this rank learns on cuda:0"):
        IsaacLabEnv(TASK, 2, torch.device("cuda:0"), 0)


@pytest.mark.parametrize("space", [gymnasium.spaces.Box(-1, 1, (2,), dtype=np.int64),
                                   gymnasium.spaces.Box(-1.0, 1.0, (2, 2)), gymnasium.spaces.Discrete(3)],
                         ids=["integer-box", "matrix-box", "discrete"])
def test_a_non_continuous_or_non_flat_action_space_is_refused(fake, space):
    """Only a 1-D float Box is a PPO Gaussian's action space."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)
        env.single_action_space = space
        return env

    fake.entry_point = entry_point
    with pytest.raises(ValueError, match=rf"--env.task {TASK}: needs a 1-D continuous \(Box\) action space"):
        IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)


def test_a_returned_termination_survives_the_next_step(fake):
    """Isaac Lab reuses its termination buffer: a termination handed out must still read True after the next
    step clears that buffer (the existing test only saw all-False flags, where aliasing is invisible)."""
    env = IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)
    env.reset()
    env.unwrapped.episode_length_buf.zero_()
    env.unwrapped.pos[0, 0] = 0.95                                # +0.1 * 1.0 crosses TERMINATE_ABOVE = 1.0
    _, _, terminated, truncated, _ = env.step(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    assert terminated.tolist() == [True, False] and truncated.tolist() == [False, False]
    _, _, later, _, _ = env.step(torch.zeros(2, 2))
    assert later.tolist() == [False, False] and terminated.tolist() == [True, False]


def test_an_isaac_lab_without_compute_final_obs_is_refused_before_launch(fake, monkeypatch):
    """An Isaac Lab whose env config has no `compute_final_obs` loses the observation before every auto-reset, so
    time-outs could not be bootstrapped: refused, naming the fix, before any runtime starts. The wrapper takes **kwargs,
    so it is handed `overrides` too. Mutant: a **kwargs parse_env_cfg taken for one without overrides -> the fake reads
    pytest's own argv as Hydra overrides, as 3.0's does on overrides=None."""
    utils = sys.modules["isaaclab_tasks.utils"]
    parse = utils.parse_env_cfg

    def older_isaac_lab(*args, **kwargs):
        cfg = parse(*args, **kwargs)
        del cfg.compute_final_obs
        return cfg

    monkeypatch.setattr(utils, "parse_env_cfg", older_isaac_lab)
    with pytest.raises(ValueError, match=r"no `compute_final_obs` env option.*update Isaac Lab"):
        IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)
    assert fake.launches == []


def test_a_reset_without_final_obs_is_an_error_not_a_silent_bootstrap_from_the_new_episode(fake):
    """Should Isaac Lab reset an env without handing extras['final_obs'], the adapter must fail, not substitute
    the new episode's first observation for the last one."""
    env = IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)
    env.reset()
    env.unwrapped.cfg.compute_final_obs = False                  # the fake then leaves final_obs out
    env.unwrapped.episode_length_buf.zero_()
    env.step(torch.zeros(2, 2))                                  # nothing finishes: fine without final_obs
    env.unwrapped.episode_length_buf[:] = env.max_episode_length - 1
    with pytest.raises(RuntimeError, match=r"reset envs without extras\['final_obs'\]"):
        env.step(torch.zeros(2, 2))



def test_an_observation_group_of_separate_terms_names_the_config_fix(fake):
    """A group left as a dict of terms (concatenate_terms=False) gets the flag and the fix, not an AttributeError
    from inside the adapter."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)
        env._observe = lambda: {"policy": {"pos": env.pos.clone()}, "critic": torch.stack([env.pos, env.prev], 1)}
        return env

    fake.entry_point = entry_point
    with pytest.raises(ValueError, match=r"^--env.actor-obs-groups: observation group 'policy' is a dict of terms; "
                                         r"set its concatenate_terms=True"):
        IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)

@pytest.mark.parametrize("make_group, what", [(lambda pos: pos.numpy(), "ndarray"),
                                               (lambda pos: pos[:, 0], "a tensor of shape [2]")],
                         ids=["numpy", "one-dim"])
def test_an_observation_group_that_is_no_batch_of_tensors_is_named_as_such(fake, make_group, what):
    """A group that is neither a dict of terms nor a [num_envs, ...] tensor: a numpy array was called "a dict of terms"
    (set concatenate_terms=True, which would not help), a [num_envs] tensor was an IndexError from flatten(1)."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)
        env._observe = lambda: {"policy": make_group(env.pos.clone()), "critic": torch.stack([env.pos, env.prev], 1)}
        return env

    fake.entry_point = entry_point
    message = (f"--env.actor-obs-groups: observation group 'policy' is {what}, not a [num_envs, ...] tensor; fix the "
               f"group in the task config or leave it out of --env.actor-obs-groups")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)


@pytest.mark.parametrize("value, what", [(torch.ones(2), "a tensor of shape [2]"), (None, "NoneType")])
def test_a_logged_value_that_is_not_one_number_is_named_at_start_up(fake, value, what):
    """A task's own code may log a per-env tensor (RSL-RL's logger averages it) or None in extras['log']: the
    adapter failed in its first step with torch's "shape '[]' is invalid for input of size 2" (or "must be real
    number, not NoneType"), where env_check's message about log scalars never got the chance."""
    def entry_point(cfg, **kw):
        env = FakeRLEnv(cfg, fake, **kw)
        env.extra_log = {"Metrics/per_env": value}
        return env

    fake.entry_point = entry_point
    message = (f"--env.task {TASK}: extras['log']['Metrics/per_env'] is {what}, not one number; make the task log "
               f"one value per name (e.g. the mean over its envs)")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        IsaacLabEnv(TASK, 2, torch.device("cpu"), 0)


# ---- ppo/actor_critic.py ---------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ["elu", "tanh"])
def test_actor_mean_and_value_are_the_mlps_computed_by_hand(activation):
    """Hidden layers are Linear + activation, the heads plain Linear (an activation on the head would bound the
    action mean and the value); the value of a batch of one env is [1], not a 0-d tensor."""
    torch.manual_seed(0)
    from ppo.actor_critic import ActorCritic
    model = ActorCritic(3, 4, 2, (5, 6), (7,), activation=activation, normalize_critic_obs=False)
    act = {"elu": lambda z: np.where(z > 0, z, np.expm1(np.minimum(z, 0))), "tanh": np.tanh}[activation]

    def by_hand(net, x):
        linears = [m for m in net if isinstance(m, torch.nn.Linear)]
        h = x.double().numpy()
        for i, layer in enumerate(linears):
            h = h @ layer.weight.detach().double().numpy().T + layer.bias.detach().double().numpy()
            h = act(h) if i < len(linears) - 1 else h
        return h

    g = torch.Generator().manual_seed(1)
    xa, xc = torch.randn(9, 3, generator=g) * 4, torch.randn(9, 4, generator=g) * 4
    for layer in (model.actor[-1], model.critic[-1]):             # heads below -1: outside tanh's and ELU's range
        torch.nn.init.constant_(layer.bias, -3.0)                 # (+3 left ELU, the identity above 0, unseen)
    with torch.no_grad():
        mean, value = model.distribution(xa).mean, model.value(xc)
    np.testing.assert_allclose(mean.double().numpy(), by_hand(model.actor, xa), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value.double().numpy(), by_hand(model.critic, xc)[:, 0], rtol=1e-5, atol=1e-5)
    assert value.shape == (9,) and model.value(xc[:1]).shape == (1,)


def test_build_actor_critic_honours_every_policy_setting():
    """Each --policy.* setting reaches the model: layer sizes per network, activation, initial std, orthogonal
    init (actor head gain 0.01: its rows orthonormal times 0.01, zero bias) and which observations are normalized
    (both flags off their defaults, so neither a default nor a swap of the two passes)."""
    from configs import PolicyConfig
    from ppo.actor_critic import build_actor_critic
    from ppo.normalizer import ObsNormalizer
    torch.manual_seed(0)
    cfg = PolicyConfig(actor_hidden=(6,), critic_hidden=(9, 4), activation="tanh", init_noise_std=0.25,
                       orthogonal_init=True, normalize_critic_obs=False, normalize_actor_obs=True)
    model = build_actor_critic(cfg, {"policy": 3, "critic": 5}, 2)
    assert isinstance(model.actor_normalizer, ObsNormalizer) and not isinstance(model.critic_normalizer, ObsNormalizer)
    sizes = {name: [(m.in_features, m.out_features) for m in net if isinstance(m, torch.nn.Linear)]
             for name, net in (("actor", model.actor), ("critic", model.critic))}
    assert sizes == {"actor": [(3, 6), (6, 2)], "critic": [(5, 9), (9, 4), (4, 1)]}
    assert all(isinstance(m, torch.nn.Tanh) for net in (model.actor, model.critic) for m in net[1::2])
    torch.testing.assert_close(model.distribution(torch.zeros(1, 3)).stddev, torch.full((1, 2), 0.25))
    head = model.actor[-1].weight.detach().double()                # [2, 6]: orthonormal rows times 0.01
    torch.testing.assert_close(head @ head.T, 1e-4 * torch.eye(2, dtype=torch.float64), rtol=0, atol=1e-9)
    assert not model.actor[-1].bias.any()
