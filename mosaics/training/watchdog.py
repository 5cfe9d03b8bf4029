"""No silent hangs: a watchdog thread per process ends a stalled step or collective.

Every process beats at the start and the end of each step; a thread writes the beat to
``<run_dir>/watchdog/rank<r>.json`` (pid, host, step, time of the last progress) every few
seconds. When a process has made no progress for ``watchdog_s`` seconds (a rank stopped, a dead
node, a stuck file system, a collective that never completes), its thread

1. dumps the Python stacks of all its threads (``faulthandler``) to
   ``<run_dir>/watchdog/stacks_rank<r>.txt``;
2. names the rank that stopped from the heartbeat files: one whose file is no longer written
   (process stopped or dead, node gone), else the one with the oldest progress;
3. prints that as one line and exits with :data:`EXIT_STALLED`, which the launcher and the
   sbatch script of docs/training.md requeue; the next run resumes from the last checkpoint.

Every live process times out alike, so each dumps its own stacks. Checkpoint saves and
in-loop evaluations count towards the time between beats: choose ``watchdog_s`` above them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .signals import EXIT_STALLED
from .trainer import Hook

__all__ = ["EXIT_STALLED", "Watchdog", "stalled_rank"]


def stalled_rank(beats: dict[int, dict[str, Any] | None], now: float, stale_s: float
                 ) -> tuple[int | None, str]:
    """Which rank stopped, and why, from the heartbeats (``None``: no file) at wall time
    ``now``; a file older than ``stale_s`` seconds means its process no longer runs."""
    if not beats:
        return None, "no heartbeats"
    for rank, beat in sorted(beats.items()):
        if beat is None:
            return rank, f"rank {rank} wrote no heartbeat (it never reached its first step)"
    stale = {r: now - b["written"] for r, b in beats.items() if now - b["written"] > stale_s}
    if stale:
        rank = max(stale, key=lambda r: stale[r])
        beat = beats[rank]
        return rank, (f"rank {rank} (pid {beat['pid']} on {beat['host']}) stopped responding: "
                      f"its heartbeat is {stale[rank]:.0f} s old, last at step {beat['step']} "
                      "(process stopped or killed, or its node gone)")
    rank = min(beats, key=lambda r: (beats[r]["progress"], r))
    beat = beats[rank]
    return rank, (f"rank {rank} (pid {beat['pid']} on {beat['host']}) stalled at step "
                  f"{beat['step']}: no progress for {now - beat['progress']:.0f} s, the longest "
                  "of all ranks")


class Watchdog(Hook):
    """The watchdog of the module docstring for process ``rank`` of ``world``; ``exit`` is
    ``os._exit`` (the main thread may be blocked inside a collective)."""

    def __init__(self, limit_s: float, run_dir: Path, rank: int = 0, world: int = 1,
                 exit: Callable[[int], Any] = os._exit) -> None:
        self.limit_s, self.rank, self.world, self.exit = float(limit_s), rank, world, exit
        self.folder = Path(run_dir) / "watchdog"
        self.poll_s = min(max(self.limit_s / 5, 0.1), 10.0)
        self.step = 0
        self.progress: float | None = None  # wall time of the last beat; None: not started
        self.message: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int | None = None) -> None:
        """Progress at ``step`` (at its start and its end); starts the thread at the first."""
        if step is not None:
            self.step = step
        self.progress = time.time()
        if self._thread is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # an earlier attempt's verdict
                (self.folder / f"stalled_rank{self.rank}.txt").unlink(missing_ok=True)
            self._write()
            self._thread = threading.Thread(target=self._watch, name="mosaics-watchdog",
                                            daemon=True)
            self._thread.start()

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self.beat(step)

    def on_train_end(self, trainer: Any, result: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _write(self) -> None:
        beat = {"pid": os.getpid(), "host": socket.gethostname(), "step": self.step,
                "progress": self.progress}
        path = self.folder / f"rank{self.rank}.json"
        tmp = path.with_name(f".tmp-{path.name}")
        try:
            tmp.write_text(json.dumps(beat))
            os.replace(tmp, path)
        except OSError:  # a stuck or full file system must not end the run here
            pass

    def _read(self) -> dict[int, dict[str, Any] | None]:
        beats: dict[int, dict[str, Any] | None] = {}
        for rank in range(self.world):
            path = self.folder / f"rank{rank}.json"
            try:
                beats[rank] = dict(json.loads(path.read_text()), written=path.stat().st_mtime)
            except (OSError, ValueError):
                beats[rank] = None
        return beats

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._write()
            if self.progress is not None and time.time() - self.progress > self.limit_s:
                self._fire()
                return

    def _fire(self) -> None:
        idle = time.time() - (self.progress or time.time())
        stacks = self.folder / f"stacks_rank{self.rank}.txt"
        try:
            with open(stacks, "w") as handle:
                handle.write(f"rank {self.rank}, pid {os.getpid()}, step {self.step}, no "
                             f"progress for {idle:.0f} s\n")
                handle.flush()
                faulthandler.dump_traceback(file=handle, all_threads=True)
        except OSError:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.world > 1:
            _, who = stalled_rank(self._read(), time.time(), stale_s=max(3 * self.poll_s, 2.0))
        else:
            who = f"this process stalled at step {self.step}"
        self.message = (f"watchdog: rank {self.rank} made no progress for {idle:.0f} s "
                        f"(watchdog_s={self.limit_s:g}); {who}; Python stacks in "
                        f"{self.folder}/stacks_rank*.txt; exiting with status {EXIT_STALLED} "
                        "so the job is requeued and resumes from the last checkpoint")
        with contextlib.suppress(OSError):
            (self.folder / f"stalled_rank{self.rank}.txt").write_text(self.message + "\n")
        os.write(2, (self.message + "\n").encode())
        self.exit(EXIT_STALLED)
