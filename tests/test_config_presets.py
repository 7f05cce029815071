"""The presets' values (configs/presets.py) against their documented sources: the field defaults the cartpole and
tracking presets inherit, the simulator presets' RSL-RL learning-rate bounds and CleanRL's unscaled actions, and each
preset's runs under its own name."""

import torch

from configs import preset


def test_the_embedded_presets_inherit_the_documented_field_defaults():
    """Mutants: the dataclass defaults adam-eps 1e-5, desired-kl 0.02, gamma 0.98, lam 0.9, clip 0.3, init-noise-std
    0.5, reward-clip 5, timeout-s 300, max-grad-norm 0.5 (the cartpole and tracking presets set none of them), and
    cartpole's entropy coefficient 0 dropped from its preset (the default 0.005 instead). Sources: the help strings
    (Adam's eps is PyTorch's default, read from torch here; CleanRL clips rewards at 10), docs/simulators.md's RSL-RL
    values the defaults share (KL target 0.01, gamma 0.99, lambda 0.95, clip 0.2, initial std 1, gradient norm 1)
    and docs/fault_tolerance.md's "--dist.timeout-s 600"."""
    torch_eps = torch.optim.Adam([torch.zeros(1, requires_grad=True)]).defaults["eps"]
    for name in ("cartpole", "tracking"):
        cfg = preset(name)
        p = cfg.ppo
        assert p.adam_eps == torch_eps and p.reward_clip == 10.0 and cfg.dist.timeout_s == 600.0, name
        assert p.max_grad_norm == 1.0, name
        assert (p.desired_kl, p.gamma, p.lam, p.clip_param, cfg.policy.init_noise_std) == (0.01, 0.99, 0.95, 0.2, 1.0)
    # no entropy bonus for cartpole (as the mujoco preset, CleanRL): the README's cartpole curve was measured so
    assert preset("cartpole").ppo.entropy_coef == 0.0 and preset("tracking").ppo.entropy_coef > 0


def test_the_simulator_presets_inherit_rsl_rl_s_lr_bounds_and_cleanrl_s_unscaled_actions():
    """Mutants: the defaults lr-min 1e-6 and action-scale 2. The isaaclab preset's adaptive schedule is RSL-RL's,
    which clamps the rate to [1e-5, 1e-2]; the mujoco preset is CleanRL's, whose actions reach the env unscaled and
    clipped only to the action space's bounds (docs/simulators.md: ClipAction)."""
    p = preset("isaaclab").ppo
    assert (p.schedule, p.lr_min, p.lr_max) == ("adaptive", 1e-5, 1e-2)
    env = preset("mujoco").env
    assert env.action_scale == 1.0 and env.action_clip is None


def test_each_preset_writes_its_runs_under_its_own_name():
    """Mutant: the mujoco preset's experiment "gymnasium". A preset's runs go to runs/PRESET (docs/design.md:
    runs/cartpole/; docs/simulators.md: runs/isaaclab/), so --resume auto of one preset never meets another's."""
    for name in ("cartpole", "tracking", "mujoco", "isaaclab"):
        assert preset(name).log.experiment == name


def test_the_isaaclab_preset_is_isaac_lab_s_g1_rough_rsl_rl_runner():
    """Mutants: the isaaclab preset's entropy coefficient 0.005 (Anymal-C's), 2 minibatches, minibatches of whole
    env sequences, observation normalization on, advantage normalization per rank (RSL-RL's `local`). The values are
    docs/simulators.md's list of G1RoughPPORunnerCfg's and of the deliberate differences (global advantages,
    time-outs bootstrapped, base seed 1)."""
    cfg = preset("isaaclab")
    env, pol, p = cfg.env, cfg.policy, cfg.ppo
    assert (env.name, env.task, env.num_envs) == ("isaaclab", "Isaac-Velocity-Rough-G1", 4096)
    assert env.actor_obs_groups == env.critic_obs_groups == ("policy",)
    assert (p.num_steps, cfg.max_iterations, p.num_epochs, p.num_mini_batches) == (24, 5000, 5, 4)
    assert pol.actor_hidden == pol.critic_hidden == (512, 256, 128) and pol.activation == "elu"
    assert not pol.normalize_actor_obs and not pol.normalize_critic_obs and pol.init_noise_std == 1.0
    assert (p.minibatch_unit, p.learning_rate, p.schedule, p.desired_kl) == ("transition", 1e-3, "adaptive", 0.01)
    assert (p.gamma, p.lam, p.clip_param, p.clip_value_loss) == (0.99, 0.95, 0.2, True)
    assert (p.value_loss_coef, p.entropy_coef, p.max_grad_norm) == (1.0, 0.008, 1.0)
    assert p.advantage_norm == "global" and p.bootstrap_time_outs and not p.normalize_rewards and cfg.seed == 1
