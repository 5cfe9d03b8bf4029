"""A torch profiler trace of a step range (``TrainConfig.profile_steps: "a:b"``, steps a to
b inclusive) in ``<run_dir>/profile/``: ``rank<r>.<time>.pt.trace.json``, a Chrome trace that
Perfetto (ui.perfetto.dev) and TensorBoard's profiler plugin (``torch-tb-profiler``;
``tensorboard --logdir <run_dir>/profile``) open. CPU and, where present, CUDA activity, with
memory events."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .instrument import LoopProbe
from .trainer import Hook


def parse_steps(value: str | None) -> tuple[int, int] | None:
    """``"a:b"`` (1 <= a <= b) -> (a, b); None or "" -> None; else one-line ConfigError."""
    if value is None or not str(value).strip():
        return None
    parts = str(value).split(":")
    try:
        first, last = (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, -1)
    except ValueError:
        first, last = 0, -1
    if not 1 <= first <= last:
        raise ConfigError(f"profile_steps must be 'a:b' with 1 <= a <= b (the steps to trace), "
                          f"got {value!r}; e.g. profile_steps=10:12.")
    return first, last


class ProfileSteps(Hook):
    """Runs ``torch.profiler`` from the start of step ``first`` to the end of step ``last``."""

    def __init__(self, steps: tuple[int, int], folder: Path, rank: int, probe: LoopProbe
                 ) -> None:
        self.first, self.last = steps
        self.folder, self.rank = Path(folder), rank
        self.profiler: Any = None
        self.trace: Path | None = None
        probe.listeners.append(self._step_begins)

    def _step_begins(self, step: int) -> None:
        if step == self.first and self.profiler is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self.folder.mkdir(parents=True, exist_ok=True)
            self.profiler = profile(activities=activities, profile_memory=True,
                                    record_shapes=True, on_trace_ready=self._save)
            self.profiler.start()

    def _save(self, profiler: Any) -> None:
        from torch.profiler import tensorboard_trace_handler

        before = set(self.folder.glob("*.pt.trace.json*"))
        tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}")(profiler)
        new = sorted(set(self.folder.glob("*.pt.trace.json*")) - before)
        self.trace = new[-1] if new else None

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if self.profiler is not None and step >= self.last:
            self.profiler.stop()
            self.profiler = None
            if trainer.is_main and self.trace is not None:
                print(f"profile of steps {self.first}-{self.last}: {self.trace} (open in "
                      "ui.perfetto.dev or tensorboard --logdir "
                      f"{self.folder})", file=sys.stderr)

    def on_train_end(self, trainer: Any, result: Any) -> None:
        if self.profiler is not None:  # the run ended inside the range
            self.on_step_end(trainer, self.last, {})
