"""``mosaics train --nproc N``: N ranks on this machine under a launcher that preempts cleanly.

torchrun and ``accelerate launch`` (torch's elastic agent) end with a traceback and status 1
on SIGTERM, and die at once on SIGUSR1, leaving their ranks training on as orphans. This
launcher starts N processes of ``mosaics train`` with the variables accelerate reads (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), each in its own session, and:

* passes the first SIGTERM, SIGUSR1, SIGINT or SIGHUP it receives (from a scheduler, a process
  group kill, Ctrl-C) to every rank once (SIGINT and SIGHUP as SIGTERM), then waits for all of
  them: the ranks finish their step, write one checkpoint together and exit 75, and so does
  the launcher, after them;
* kills the ranks (SIGKILL) on a second signal and exits with 128 + its number;
* when a rank fails (a status other than 0 and 75), gives the others :data:`FAILURE_GRACE_S`
  to end on their own (a bad config stops every rank with the same one-line error), then kills
  them, and exits with the first failure's status; a rank ended by its watchdog
  (:data:`~mosaics.training.signals.EXIT_STALLED`, a stalled rank or collective) gets the
  others killed after :data:`STALLED_GRACE_S` and the launcher exits with that status.

A rank whose launcher is gone (killed with SIGKILL) notices at its next step and stops with a
checkpoint (:class:`~mosaics.training.signals.StopSignals`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .signals import EXIT_PREEMPTED, EXIT_STALLED, LAUNCHER_ENV

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
FAILURE_GRACE_S = 30.0
STALLED_GRACE_S = 5.0  # after a rank's watchdog ended it (the others' dump their stacks)


def _pop_option(args: list[str], names: tuple[str, ...], what: str
                ) -> tuple[str | None, list[str]]:
    """Take ``NAME VALUE`` / ``NAME=VALUE`` (any of ``names``; the last one wins) out of
    ``args``."""
    rest, value, i = [], None, 0
    while i < len(args):
        arg = args[i]
        if arg in names:
            if i + 1 >= len(args):
                raise ConfigError(f"{arg} needs a value: {arg} {what}.")
            value, i = args[i + 1], i + 2
        elif "=" in arg and arg.split("=", 1)[0] in names:
            value, i = arg.split("=", 1)[1], i + 1
        else:
            rest.append(arg)
            i += 1
    return value, rest


def pop_nproc(args: list[str]) -> tuple[int | None, list[str]]:
    """Take ``--nproc N`` / ``--nproc=N`` out of the training arguments."""
    value, rest = _pop_option(args, ("--nproc", "--nproc-per-node", "--nproc_per_node"),
                              "N (processes on this machine)")
    if value is None:
        return None, rest
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--nproc must be a positive whole number of processes, got "
                          f"{value!r}.")
    return int(value), rest


def pop_deepspeed(args: list[str]) -> tuple[Path | None, list[str]]:
    """Take ``--deepspeed CONFIG.json`` (DeepSpeed for the ranks of ``--nproc``) out of the
    training arguments."""
    value, rest = _pop_option(args, ("--deepspeed",), "CONFIG.json (configs/deepspeed/)")
    if value is None:
        return None, rest
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"--deepspeed {value}: no such file; pass a DeepSpeed JSON config "
                          "such as configs/deepspeed/zero2.json.")
    return path.resolve(), rest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(rank: int, nproc: int, port: int, base: dict[str, str] | None = None,
             deepspeed: Path | None = None) -> dict[str, str]:
    """The environment of rank ``rank`` of ``nproc`` on this machine (with ``deepspeed``: the
    variables accelerate reads to run DeepSpeed with that JSON config)."""
    import mosaics

    env = dict(os.environ if base is None else base)
    if deepspeed is not None:
        env.update(ACCELERATE_USE_DEEPSPEED="true",
                   ACCELERATE_DEEPSPEED_CONFIG_FILE=str(deepspeed))
        env.pop("ACCELERATE_USE_CPU", None)  # it would turn DeepSpeed off
    for key in ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
        env.pop(key, None)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=env.get("MASTER_ADDR", "127.0.0.1"),
               MASTER_PORT=str(port), **{LAUNCHER_ENV: str(os.getpid())})
    env.setdefault("OMP_NUM_THREADS", "1")
    import torch

    if not torch.cuda.is_available() and env.get("ACCELERATE_USE_DEEPSPEED", "").lower() \
            not in ("true", "1"):
        env.setdefault("ACCELERATE_USE_CPU", "1")  # gloo ranks (docs/training.md)
    # the ranks import the package this launcher runs from
    root = str(Path(mosaics.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class Launcher:
    """N ranks of ``mosaics train ARGS`` and the signal policy of the module docstring."""

    def __init__(self, nproc: int, args: list[str], prog: str = "mosaics train",
                 deepspeed: Path | None = None) -> None:
        self.nproc, self.args, self.prog, self.deepspeed = nproc, list(args), prog, deepspeed
        self.procs: list[subprocess.Popen[bytes]] = []
        self.signalled: str | None = None
        self.killed_by: int | None = None

    def _say(self, text: str) -> None:
        os.write(2, f"{self.prog} launcher: {text}\n".encode())

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signalled is None:
            self.signalled = name
            # Ctrl-C and a closed terminal stop the ranks like a scheduler does
            passed = signum if signum in (signal.SIGTERM, signal.SIGUSR1) else signal.SIGTERM
            self._say(f"{name}: passed to the {self.nproc} ranks as "
                      f"{signal.Signals(passed).name}; waiting for them to finish the step and "
                      "write a checkpoint (send it again to kill them at once)")
            self._send(passed)
            return
        self._say(f"{name} after {self.signalled}: killing the ranks, no checkpoint")
        self.killed_by = signum
        self._send(signal.SIGKILL)

    def _send(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def run(self) -> int:
        """Start the ranks, wait for all of them, return the launcher's exit status."""
        port = int(os.environ.get("MASTER_PORT") or _free_port())
        previous = {sig: signal.signal(sig, self._handle) for sig in FORWARDED}
        try:
            for rank in range(self.nproc):
                cmd = [sys.executable, "-m", "mosaics", "train", *self.args]
                env = rank_env(rank, self.nproc, port, deepspeed=self.deepspeed)
                self.procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
            codes = self._wait()
        finally:
            self._send(signal.SIGKILL)  # only ranks still running (an error in this process)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self._status(codes)

    def _wait(self) -> list[int]:
        failed_at: float | None = None
        killed = False
        while True:
            codes = [proc.poll() for proc in self.procs]
            if all(code is not None for code in codes):
                return [int(code) for code in codes if code is not None]
            bad = [c for c in codes if c is not None and c not in (0, EXIT_PREEMPTED)]
            if bad and failed_at is None:
                failed_at = time.monotonic()
            grace = STALLED_GRACE_S if EXIT_STALLED in bad else FAILURE_GRACE_S
            if not killed and failed_at is not None and time.monotonic() - failed_at > grace:
                self._say(f"a rank failed (status {bad[0]}); killing the ranks still running "
                          f"after {grace:.0f} s")
                self._send(signal.SIGKILL)
                killed = True
            time.sleep(0.05)

    def _status(self, codes: list[int]) -> int:
        if self.killed_by is not None:
            return 128 + self.killed_by
        failures = [c for c in codes if c not in (0, EXIT_PREEMPTED)]
        if EXIT_STALLED in failures:  # the watchdog's: the others were killed after it
            return EXIT_STALLED
        if failures:
            first = failures[0]
            return 128 - first if first < 0 else first  # killed by a signal: 128 + its number
        if EXIT_PREEMPTED in codes:
            return EXIT_PREEMPTED
        return 0


def launch(nproc: int, args: list[str], prog: str = "mosaics train",
           deepspeed: Path | None = None) -> int:
    """Run ``mosaics train ARGS`` as ``nproc`` ranks on this machine (under DeepSpeed with
    the ``deepspeed`` JSON config); returns the exit status (0, 75 after a stop signal's
    checkpoint, or the first failed rank's status)."""
    return Launcher(nproc, args, prog, deepspeed).run()
