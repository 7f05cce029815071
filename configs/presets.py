"""Named presets: a full `Config` per task. `train.py PRESET --flags` starts from one and overrides fields."""


from configs.config import Config, EnvConfig, LogConfig, PolicyConfig, PPOConfig


def cartpole() -> Config:
    """Continuous-force cart-pole balance: learns in about a minute on one CPU core."""
    return Config(
        env=EnvConfig(name="cartpole", num_envs=64, episode_length_s=10.0),
        policy=PolicyConfig(actor_hidden=(64, 64), critic_hidden=(64, 64), normalize_critic_obs=True),
        ppo=PPOConfig(num_steps=32, num_epochs=5, num_mini_batches=4, learning_rate=1e-3, entropy_coef=0.0),
        log=LogConfig(experiment="cartpole"),
        max_iterations=60,
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


PRESETS = {"cartpole": cartpole, "tracking": tracking}


def preset(name: str) -> Config:
    """The named preset's config; unknown names raise with the list of known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]()



