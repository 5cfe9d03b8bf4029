"""Per-step system metrics: the time spent waiting for data and the peak memory.

:class:`LoopProbe` wraps the run's :class:`~mosaics.training.trainer.BatchSource`: it times
every ``batch(i)`` call and tells listeners when a step's first micro-batch is fetched (the
step's start). :class:`SystemMetrics` logs, at each log row (``log_interval``):

- ``sys/data_wait_s``: seconds spent in ``batch()`` per step (mean over the window), and
  ``sys/data_wait_frac``, its share of the step time;
- ``sys/peak_mem_gib``: the largest per-step peak of the window: on CUDA
  ``torch.cuda.max_memory_allocated`` (reset every step), on CPU the resident set's high-water
  mark (``VmHWM``, reset every step through ``/proc/self/clear_refs``; the process's lifetime
  peak where that is not possible).
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from .metrics import log_row
from .trainer import Hook

GIB = 1024 ** 3


class LoopProbe:
    """A BatchSource that times ``inner.batch`` and calls ``listeners(step)`` when step
    ``step``'s first micro-batch is fetched (only inside ``fit``, after :meth:`attach`)."""

    def __init__(self, inner: Any, accumulation: int = 1) -> None:
        self.inner, self.accumulation = inner, max(int(accumulation), 1)
        self.listeners: list[Callable[[int], None]] = []
        self.wait_s = 0.0
        self.trainer: Any = None

    def attach(self, trainer: Any) -> None:
        self.trainer = trainer

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        trainer = self.trainer
        in_loop = trainer is not None and trainer._fit_started is not None
        if in_loop and index % self.accumulation == 0:
            for listener in self.listeners:
                listener(trainer.step + 1)
        start = time.perf_counter()
        out = self.inner.batch(index)
        if in_loop:
            self.wait_s += time.perf_counter() - start
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)


def _read_hwm_kib() -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """The peak memory since the last :meth:`reset`, in bytes (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.resettable = not self.cuda and _reset_hwm()

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            _reset_hwm()

    def peak(self) -> float:
        if self.cuda:
            return float(torch.cuda.max_memory_allocated(self.device))
        kib = _read_hwm_kib()
        if kib is None:  # ru_maxrss: KiB on Linux, bytes on macOS
            kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            kib = kib // 1024 if sys.platform == "darwin" else kib
        return kib * 1024.0


class SystemMetrics(Hook):
    """Logs data-wait time and peak memory at every log row (main process)."""

    def __init__(self, probe: LoopProbe) -> None:
        self.probe = probe
        self.memory: PeakMemory | None = None
        self.steps, self.peak = 0, 0.0
        self.last_end: float | None = None
        self.step_s = 0.0
        probe.listeners.append(self._step_begins)

    def _step_begins(self, step: int) -> None:
        if self.last_end is None:
            self.last_end = time.perf_counter()

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if self.memory is None:
            self.memory = PeakMemory(trainer.accelerator.device)
        now = time.perf_counter()
        self.step_s += now - (self.last_end if self.last_end is not None else now)
        self.last_end = now
        self.steps += 1
        self.peak = max(self.peak, self.memory.peak())
        self.memory.reset()
        if not metrics:  # not a log row
            return
        wait = self.probe.wait_s
        row = {"sys/data_wait_s": wait / self.steps,
               "sys/data_wait_frac": wait / self.step_s if self.step_s > 0 else 0.0,
               "sys/peak_mem_gib": self.peak / GIB}
        self.probe.wait_s, self.steps, self.peak, self.step_s = 0.0, 0, 0.0, 0.0
        log_row(trainer, step, row, history=False)
