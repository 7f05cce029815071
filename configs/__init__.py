from configs.config import Config, DistConfig, EnvConfig, LogConfig, PolicyConfig, PPOConfig, validate
from configs.presets import PRESETS, preset

__all__ = ["Config", "DistConfig", "EnvConfig", "LogConfig", "PolicyConfig", "PPOConfig", "validate", "PRESETS", "preset"]
