"""Preemption: the signals a scheduler sends before it kills a job become a request to stop.

The first configured signal (``stop_signals``, default SIGTERM and SIGUSR1) sets a flag; the
trainer all-reduces it every step, so every process stops after the same step, writes a
checkpoint together and the run exits with :data:`EXIT_PREEMPTED`. A second signal ends the
process at once with status 128 + the signal number (no checkpoint); the same signal again
within :data:`DUPLICATE_WINDOW_S` of the first is one event delivered twice (a signal to a
process group or a SLURM step and a launcher passing it on) and is ignored.

A rank started by a launcher (``mosaics train --nproc``, torchrun, ``accelerate launch``) also
stops, with a checkpoint, when that launcher is gone: a launcher killed by a signal it does not
handle would otherwise leave its ranks training on as orphans that hold the run_dir lock.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from ..errors import ConfigError

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped early, a checkpoint was written; run again to resume
EXIT_STALLED = 76  # ended by the watchdog (mosaics.training.watchdog); run again to resume
DUPLICATE_WINDOW_S = 2.0  # a stop signal repeated within this many seconds counts once
LAUNCHER_ENV = "MOSAICS_LAUNCHER_PID"  # set by mosaics.training.launch in every rank


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


def launcher_pid() -> int | None:
    """The PID of the launcher that started this rank (``mosaics train --nproc``, torchrun or
    ``accelerate launch``: this process's parent), or ``None`` without one. A process that
    merely inherited the launcher's variable from a rank (its parent) watches nothing."""
    if os.environ.get(LAUNCHER_ENV, "").isdigit():
        pid = int(os.environ[LAUNCHER_ENV])
        return pid if pid == os.getppid() else None
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # torch's elastic agent started this process
        return os.getppid()
    return None


class StopSignals:
    """Installs handlers for ``signals`` (main thread only) while in use as a context.

    :meth:`requested` is what the trainer agrees on every step: a stop signal arrived, or
    (with ``signals`` not empty) the launcher that started this rank exited."""

    def __init__(self, signals: list[signal.Signals]) -> None:
        self.signals = signals
        self.received: str | None = None
        self._received_at = 0.0
        self._previous: dict[signal.Signals, Any] = {}
        self.launcher = launcher_pid() if signals else None

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            if name == self.received and time.monotonic() - self._received_at \
                    < DUPLICATE_WINDOW_S:
                return  # the same event, delivered to this process twice
            os.write(2, f"\n{name} after {self.received}: exiting now, without a "
                        "checkpoint\n".encode())
            os._exit(128 + signum)
        self.received, self._received_at = name, time.monotonic()
        os.write(2, f"\n{name}: finishing this step, writing a checkpoint, then exiting "
                    f"(status {EXIT_PREEMPTED}); send it again to exit at once\n".encode())

    def requested(self) -> bool:
        """Whether this process should stop after the current step."""
        if self.received is None and self.launcher is not None \
                and os.getppid() != self.launcher:
            self.received = f"the exit of launcher PID {self.launcher}"
            self._received_at = time.monotonic()
            os.write(2, f"\nlauncher PID {self.launcher} exited: finishing this step, writing a "
                        "checkpoint, then exiting\n".encode())
        return self.received is not None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
