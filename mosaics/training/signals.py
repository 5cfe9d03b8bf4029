"""Preemption: the signals a scheduler sends before it kills a job become a request to stop.

The first configured signal (``stop_signals``, default SIGTERM and SIGUSR1) sets a flag; the
trainer all-reduces it every step, so every process stops after the same step, writes a
checkpoint together and the run exits with :data:`EXIT_PREEMPTED`. A second signal ends the
process at once with status 128 + the signal number (no checkpoint).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from ..errors import ConfigError

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped early, a checkpoint was written; run again to resume


class RunPreempted(SystemExit):
    """Raised by :func:`mosaics.training.train` after a stop signal's checkpoint is written;
    left uncaught it ends the program with :data:`EXIT_PREEMPTED`."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.message = message

    def __str__(self) -> str:
        return self.message


def parse_signals(spec: str) -> list[signal.Signals]:
    """``"SIGTERM,SIGUSR1"`` (or ``TERM,USR1``; empty: none) -> signals."""
    found = []
    for raw in spec.replace(" ", "").split(","):
        if not raw:
            continue
        name = raw.upper() if raw.upper().startswith("SIG") else "SIG" + raw.upper()
        try:
            found.append(signal.Signals[name])
        except KeyError:
            raise ConfigError(f"stop_signals: unknown signal {raw!r}; use names such as "
                              "SIGTERM,SIGUSR1 (empty to disable).") from None
        if found[-1] in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"stop_signals: {name} cannot be caught; use SIGTERM or SIGUSR1.")
    return found


class StopSignals:
    """Installs handlers for ``signals`` (main thread only) while in use as a context."""

    def __init__(self, signals: list[signal.Signals]) -> None:
        self.signals = signals
        self.received: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            os.write(2, f"\n{name} after {self.received}: exiting now, without a "
                        "checkpoint\n".encode())
            os._exit(128 + signum)
        self.received = name
        os.write(2, f"\n{name}: finishing this step, writing a checkpoint, then exiting "
                    f"(status {EXIT_PREEMPTED}); send it again to exit at once\n".encode())

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
