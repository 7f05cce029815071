from configs.config import (Config, DistConfig, EnvConfig, LogConfig, PolicyConfig, PPOConfig, RolloutConfig,
                            env_count_flag, resolve_num_envs, validate, validate_device)
from configs.presets import PRESETS, cli_presets, preset

__all__ = ["Config", "DistConfig", "EnvConfig", "LogConfig", "PolicyConfig", "PPOConfig", "RolloutConfig",
           "resolve_num_envs", "validate", "validate_device", "PRESETS", "cli_presets", "preset"]
