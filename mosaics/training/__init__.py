"""Training: config, optimizer and schedule, atomic checkpoints, the trainer, pretraining."""

from .config import TrainConfig, config_from_argv, load_config, parse_overrides
from .pretrain import train
from .signals import EXIT_PREEMPTED, RunPreempted
from .trainer import Hook, KeepBest, Trainer, TrainingDiverged, TrainResult

__all__ = ["EXIT_PREEMPTED", "Hook", "KeepBest", "RunPreempted", "TrainConfig", "TrainResult",
           "Trainer", "TrainingDiverged", "config_from_argv", "load_config", "parse_overrides",
           "train"]
