"""Named presets: a full `Config` per task. `train.py PRESET --flags` starts from one and overrides fields."""


from configs.config import Config, EnvConfig, LogConfig, PolicyConfig, PPOConfig


def cartpole() -> Config:
    """Continuous-force cart-pole balance: 500-step episodes from iteration ~55 of 100, 7-10 s in one process."""
    return Config(
        env=EnvConfig(name="cartpole", num_envs=64, episode_length_s=10.0),
        policy=PolicyConfig(actor_hidden=(64, 64), critic_hidden=(64, 64), normalize_critic_obs=True),
        ppo=PPOConfig(num_steps=32, num_epochs=5, num_mini_batches=4, learning_rate=1e-3, entropy_coef=0.0),
        log=LogConfig(experiment="cartpole"),
        max_iterations=100,
    )


def tracking() -> Config:
    """SONIC-shaped motion tracking with a 6-joint chain, adaptive motion sampling: the `make train` job."""
    return Config(
        env=EnvConfig(name="tracking", num_envs=512, episode_length_s=10.0, num_motions=64),
        policy=PolicyConfig(actor_hidden=(128, 128), critic_hidden=(128, 128), normalize_critic_obs=True),
        ppo=PPOConfig(num_steps=24, num_epochs=5, num_mini_batches=4, learning_rate=1e-3),
        log=LogConfig(experiment="tracking"),
        max_iterations=400,
    )


def mujoco() -> Config:
    """CleanRL's ppo_continuous_action setting on MuJoCo: Hopper-v4 (--env.task HalfCheetah-v4, ...), 1M steps."""
    return Config(
        env=EnvConfig(name="gymnasium", task="Hopper-v4", num_envs=1),
        policy=PolicyConfig(actor_hidden=(64, 64), critic_hidden=(64, 64), activation="tanh", init_noise_std=1.0,
                            orthogonal_init=True, normalize_actor_obs=True, normalize_critic_obs=True),
        # CleanRL's vf_coef 0.5 multiplies 0.5 * mean(max(...)); our loss has no inner 0.5, hence 0.25.
        ppo=PPOConfig(num_steps=2048, num_epochs=10, num_mini_batches=32, minibatch_unit="transition",
                      learning_rate=3e-4, adam_eps=1e-5, schedule="linear", gamma=0.99, lam=0.95, clip_param=0.2,
                      clip_value_loss=True, value_loss_coef=0.25, entropy_coef=0.0, max_grad_norm=0.5,
                      advantage_norm="minibatch", normalize_rewards=True, reward_clip=10.0, bootstrap_time_outs=False),
        log=LogConfig(experiment="mujoco", print_every=10, episode_returns=True),
        max_iterations=1_000_000 // 2048,   # 488 iterations = 999,424 steps, as CleanRL counts them
    )


def isaaclab() -> Config:
    """An Isaac Lab 3.0 task on GPUs (G1 rough locomotion by default), with Isaac Lab's RSL-RL PPO settings for it."""
    # Isaac Lab 3.0.0's G1RoughPPORunnerCfg, except where docs/simulators.md says otherwise.
    return Config(
        env=EnvConfig(name="isaaclab", task="Isaac-Velocity-Rough-G1", num_envs=4096,
                      actor_obs_groups=("policy",), critic_obs_groups=("policy",)),
        policy=PolicyConfig(actor_hidden=(512, 256, 128), critic_hidden=(512, 256, 128), activation="elu",
                            init_noise_std=1.0, normalize_actor_obs=False, normalize_critic_obs=False),
        ppo=PPOConfig(num_steps=24, num_epochs=5, num_mini_batches=4, learning_rate=1e-3, schedule="adaptive",
                      desired_kl=0.01, gamma=0.99, lam=0.95, clip_param=0.2, clip_value_loss=True,
                      value_loss_coef=1.0, entropy_coef=0.008, max_grad_norm=1.0, minibatch_unit="transition"),
        log=LogConfig(experiment="isaaclab"),
        max_iterations=5000,
    )


PRESETS = {"cartpole": cartpole, "tracking": tracking, "mujoco": mujoco, "isaaclab": isaaclab}


def preset(name: str) -> Config:
    """The named preset's config; unknown names raise with the list of known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]()


def cli_presets(argv: list[str]) -> dict:
    """What train.py's parser offers, {name: (description, config)}: the preset `argv` names first alone, so that a
    mistyped flag's close matches are that preset's (with every preset offered, tyro listed each match once per preset,
    with that preset's default); every preset when `argv` starts otherwise (--help, an unknown name: listed)."""
    names = argv[:1] if argv[:1] and argv[0] in PRESETS else list(PRESETS)
    return {name: (PRESETS[name].__doc__, PRESETS[name]()) for name in names}
