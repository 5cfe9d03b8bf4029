"""Training: config, optimizer and schedule, atomic checkpoints, the trainer, pretraining."""

from .config import TrainConfig, config_from_argv, load_config, parse_overrides
from .pretrain import train
from .trainer import Hook, KeepBest, Trainer, TrainResult

__all__ = ["Hook", "KeepBest", "TrainConfig", "TrainResult", "Trainer", "config_from_argv",
           "load_config", "parse_overrides", "train"]
