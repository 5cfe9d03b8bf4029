"""The run directory on a shared cluster: one writer at a time, and what a repeated command finds.

``<run_dir>/.lock`` names the process that trains into the folder (host, PID, SLURM job); a
second run is refused while it lives. A lock is stale, and replaced, when its process is gone:
same host and the PID no longer exists (or, on Linux, belongs to a later process, or the host
rebooted since), or the same SLURM job id at another restart count (a
requeued job is the next incarnation of the one that wrote it). A lock from another host is a
lease: its holder renews it (the file's modification time) every ``lease_s / 6`` seconds while
it lives, and a lock not renewed for ``lease_s`` (default :data:`LEASE_S`, the environment
variable ``MOSAICS_LOCK_LEASE_S`` changes it) is stale: its holder was killed or lost its node.

:func:`prepare_run_dir` decides what a command finds: intact checkpoints are resumed; files of
an earlier run without one (or any earlier run under ``fresh_start``) are moved, never deleted,
to ``<run_dir>/previous_runs/<UTC time>/``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import checkpoint as ckpt

LOCK_NAME = ".lock"
PREVIOUS_RUNS = "previous_runs"
# seconds a lock from another host stays valid without renewal; longer than NFS's attribute
# caching (60 s at most by default) plus one renewal period, and than clock skew between hosts
LEASE_S = 180.0


def lease_seconds() -> float:
    """The lease a new lock gets: ``MOSAICS_LOCK_LEASE_S`` or :data:`LEASE_S`."""
    raw = os.environ.get("MOSAICS_LOCK_LEASE_S")
    if raw is None:
        return LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"MOSAICS_LOCK_LEASE_S must be a positive number of seconds, got "
                          f"{raw!r}.")
    return value


def _identity() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid,
            "boot_id": _boot_id(), "pid_start": _pid_start(pid),
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart": os.environ.get("SLURM_RESTART_COUNT"),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _boot_id() -> str | None:
    """This boot of the host (Linux); a lock from an earlier boot is stale."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _pid_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux ``/proc/<pid>/stat``
    field 22); with the boot id it tells a PID reused by a later process from its holder."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: split after its last ')'
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def stale_reason(holder: dict[str, Any], me: dict[str, Any], age: float | None = None
                 ) -> str | None:
    """Why the lock of ``holder`` no longer protects a live run (``None``: it may).
    ``age``: seconds since the lock was last renewed (its file's modification time)."""
    job = holder.get("slurm_job")
    if job is not None and job == me["slurm_job"] \
            and holder.get("slurm_restart") != me["slurm_restart"]:
        return f"SLURM job {job} was requeued since it took the lock"
    if holder.get("host") != me["host"]:
        lease = holder.get("lease_s")
        if isinstance(lease, (int, float)) and age is not None and age > lease:
            return (f"its lease expired: not renewed for {age:.0f} s, and a live holder renews "
                    f"it every {lease / 6:.0f} s")
        return None
    pid = holder.get("pid")
    if pid == me["pid"]:
        return "this process took it earlier"
    if not isinstance(pid, int) or not _pid_alive(pid):
        return f"process {pid} no longer exists"
    boot, started = holder.get("boot_id"), holder.get("pid_start")
    if boot is not None and me.get("boot_id") is not None and boot != me["boot_id"]:
        return f"the host restarted since process {pid} took it"
    if started is not None:
        now = _pid_start(pid)
        if now is not None and now != started:
            return f"PID {pid} now belongs to another process"
    return None


def live_holder(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """Who holds ``<run_dir>/.lock`` (host, PID, SLURM job, since) while that process may
    still be running; ``None`` without a lock or with a stale one."""
    path = Path(run_dir) / LOCK_NAME
    try:
        holder = json.loads(path.read_text())
        age = time.time() - path.stat().st_mtime
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict) or stale_reason(holder, _identity(), age) is not None:
        return None
    return holder


class RunBusy(ConfigError):
    """The run lock is held by another live process."""


class RunLock:
    """``<run_dir>/.lock``, created atomically (a complete file linked into place) and renewed
    by a daemon thread while held (``lease_s``: default :func:`lease_seconds`)."""

    def __init__(self, run_dir: str | os.PathLike, lease_s: float | None = None) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False
        self.lease_s = lease_seconds() if lease_s is None else float(lease_s)
        self._stop_renewing = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lock, replacing a stale one (returns a note saying so); raise
        :class:`RunBusy` naming the holder while another run may be using the folder."""
        me = dict(_identity(), lease_s=self.lease_s)
        note = None
        for _ in range(3):
            if self._create(me):
                self.held = True
                self._start_renewing()
                return note
            holder = self._read()
            if holder is None:  # vanished between the two calls: try again
                continue
            reason = stale_reason(holder, me, self._age())
            if reason is None:
                raise RunBusy(self._busy_message(holder, me))
            note = (f"{self.path}: replaced the lock of PID {holder.get('pid')} on "
                    f"{holder.get('host')} ({reason})")
            self.path.unlink(missing_ok=True)
        raise ConfigError(f"{self.path}: could not take the run lock (another process keeps "
                          "taking it); make sure one run trains into this run_dir.")

    def _age(self) -> float | None:
        """Seconds since the lock file was last renewed (``None``: it is gone)."""
        try:
            return time.time() - self.path.stat().st_mtime
        except OSError:
            return None

    def _mine(self) -> bool:
        holder = self._read()
        return holder is not None and holder.get("pid") == os.getpid() \
            and holder.get("host") == socket.gethostname()

    def _start_renewing(self) -> None:
        self._stop_renewing.clear()
        self._renewer = threading.Thread(target=self._renew, name="run-lock-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop_renewing.wait(self.lease_s / 6):
            try:
                if not self._mine():
                    print(f"warning: {self.path} no longer holds this process's lock; another "
                          "process replaced it", file=sys.stderr)
                    return
                os.utime(self.path)
            except OSError as err:  # a passing storage error: try again next period
                print(f"warning: cannot renew {self.path}: {err}", file=sys.stderr)

    def _create(self, me: dict[str, Any]) -> bool:
        tmp = self.path.with_name(f"{LOCK_NAME}.{me['host']}.{me['pid']}")
        tmp.write_text(json.dumps(me))
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self) -> dict[str, Any] | None:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"host": "?", "pid": "?"}
        return holder if isinstance(holder, dict) else {"host": "?", "pid": "?"}

    def _busy_message(self, holder: dict[str, Any], me: dict[str, Any]) -> str:
        who = f"PID {holder.get('pid')} on host {holder.get('host')}"
        if holder.get("slurm_job"):
            who += f" (SLURM job {holder['slurm_job']})"
        since = holder.get("since", "?")
        lease, age = holder.get("lease_s"), self._age()
        if holder.get("host") == me["host"]:
            fix = "wait for it to finish or stop it, or train into another run_dir"
        elif isinstance(lease, (int, float)) and age is not None:
            fix = (f"its holder renewed the lock {age:.0f} s ago; if it is gone, the lock "
                   f"expires {max(lease - age, 0):.0f} s from now and the same command then "
                   "takes it over; or train into another run_dir")
        else:
            fix = (f"if no run is using this folder any more (check on {holder.get('host')}), "
                   f"delete {self.path} and run the command again; or train into another "
                   "run_dir")
        return f"{self.path.parent} is in use by {who} since {since}: {fix}."

    def release(self) -> None:
        """Remove the lock if this process still holds it."""
        if not self.held:
            return
        self.held = False
        self._stop_renewing.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if self._mine():
            self.path.unlink(missing_ok=True)


def previous_run_files(run_dir: Path) -> list[Path]:
    """What an earlier run left in ``run_dir`` (all but the lock and ``previous_runs``)."""
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir()
                  if p.name != PREVIOUS_RUNS and not p.name.startswith(LOCK_NAME))


def move_aside(run_dir: Path, entries: list[Path]) -> Path:
    """Move ``entries`` into ``<run_dir>/previous_runs/<UTC time>/`` (same filesystem: a
    rename each) and return that folder."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir / PREVIOUS_RUNS / stamp
    n = 1
    while target.exists():
        target = run_dir / PREVIOUS_RUNS / f"{stamp}-{n}"
        n += 1
    target.mkdir(parents=True)
    for entry in entries:
        os.replace(entry, target / entry.name)
    return target


def prepare_run_dir(run_dir: str | os.PathLike, fresh_start: bool) -> Path | None:
    """Main process, holding the lock: leave an earlier run with an intact checkpoint in place
    (the run resumes from it) unless ``fresh_start``; otherwise move an earlier run's files
    aside. Returns the folder they were moved to, or ``None``."""
    run_dir = Path(run_dir)
    entries = previous_run_files(run_dir)
    if not entries:
        return None
    if fresh_start:
        reason = "fresh_start=true"
    else:
        newest, skipped = ckpt.find_resumable(run_dir)
        if newest is not None:
            return None
        for warning in skipped:
            print(f"warning: {warning}", file=sys.stderr)
        reason = "it holds no intact checkpoint to resume"
    target = move_aside(run_dir, entries)
    print(f"{run_dir}: {reason}; moved the earlier run's files to {target}, starting fresh",
          file=sys.stderr)
    return target
