"""Pretraining: config, optimizer and schedule, atomic checkpoints, the accelerate loop."""

from .config import TrainConfig, config_from_argv, load_config, parse_overrides
from .loop import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "config_from_argv", "load_config", "parse_overrides",
           "train"]
