"""Running sweep jobs: one job in this process (:func:`run_job`, the job's own process), one
job as a child process (:func:`spawn`, shared by the local runner and a scheduler's array
task, :mod:`mosaics.evaluation.cluster`), and the local runner (:func:`run_local`: several
child processes at a time, stopped together by a signal).

Each job's process is ``python -m mosaics.evaluation.sweep --job JSON --out DIR``
(:func:`child_command`; its entry is :func:`child_main`). It writes
``<out>/results/<name>.json`` atomically, its output goes to ``<out>/logs/<name>.log``, and
its training checkpoints at every evaluation under ``<out>/jobs/<name>/runs``, so a stopped
or killed job resumes when the sweep runs again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..training.rundir import RunBusy, RunLock, live_holder
from ..training.signals import EXIT_PREEMPTED
from .jobs import Job, failure_path, job_record, log_path, result_path, write_json
from .protocols import resolve

LOG_TAIL = 4000  # characters of a failed job's log kept in its failure record
# the module whose ``python -m`` runs one job (the command line of running sweeps and of
# requeued scheduler tasks: kept as it is)
CHILD_MODULE = "mosaics.evaluation.sweep"
NOT_STARTED = "not started: the sweep was stopped"
# exit status of a job's process that found its lock held by another live process (a second
# sweep over the same --out took the job after this sweep listed it): left to that sweep
EXIT_BUSY = 73
# what spawn reports, without starting a process, for a job whose result file another sweep
# over the same --out wrote after this sweep listed it (no job process exits with it)
EXIT_DONE_ELSEWHERE = 74
# signal names a job's process ignores (a scheduler's warning meant for the task that runs it)
IGNORE_ENV = "MOSAICS_IGNORE_SIGNALS"

Outcome = tuple[Job, int, float, str]  # job, exit status, wall seconds, reason of a failure


def threads_per_job(parallel: int, cores: int | None = None) -> int:
    """CPU threads for each of ``parallel`` concurrent jobs."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, parallel))


# --- one job, in this process ---------------------------------------------------------------

def run_job(job: Job, out: Path, device: str, save_model: bool = False) -> dict[str, Any]:
    """Run one job in this process and write its result record atomically (the child side):
    ``{"job": ..., "device": ..., "seconds": wall time, "results": ...}``. Training
    checkpoints at every evaluation under ``<out>/jobs/<name>/runs``: a job stopped by a signal
    (exit status 75) or killed resumes from its last checkpoint when the sweep runs again, and
    ``seconds`` counts every attempt; the checkpoints are removed once the result is written.
    ``<out>/jobs/<name>/.lock`` refuses a second process on the same job (another sweep over
    the same folder) while the first lives."""
    from . import experiments

    proto = resolve(job.task, job.preset, job.overrides)
    work = out / "jobs" / job.name
    work.mkdir(parents=True, exist_ok=True)
    lock = RunLock(work)  # two sweeps over one folder must not train one job twice
    note = lock.acquire()
    if note:
        print(note, flush=True)
    started = time.time()
    try:
        if job.task == "pretrain":
            from .pretraining import run_pretrain

            results = run_pretrain(job.arch, job.kernel, proto, job.seed, job.kernel_kwargs,
                                   device, work, job.model_dir, job.label)
        elif job.task == "regbench":
            results = experiments.run_regbench(job.arch, job.kernel, job.size, proto, job.seed,
                                               job.kernel_kwargs, device, work, save_model,
                                               job.model_dir, progress=False, resume=True,
                                               config_changes=job.config_changes)
        else:
            results = experiments.run_extrapolation(
                job.task, job.arch, job.kernel, proto, job.seed, job.kernel_kwargs, device,
                work, save_model, job.model_dir, progress=False, resume=True,
                config_changes=job.config_changes)
    finally:
        lock.release()
    earlier = sum(run.get("train", {}).get("resumed_seconds", 0.0) for run in results["runs"])
    record = {"job": job_record(job), "device": device,
              "seconds": time.time() - started + earlier, "results": results}
    write_json(result_path(out, job), record)
    return record


def child_main(argv: list[str] | None = None) -> int:
    """Entry of a job's process: ``python -m mosaics.evaluation.sweep --job JSON --out DIR``."""
    p = argparse.ArgumentParser(description="run one sweep job (started by the sweep runner)")
    p.add_argument("--job", required=True, help="the job as JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--save-model", action="store_true", help="save_pretrained the trained model")
    args = p.parse_args(argv)
    for name in filter(None, os.environ.get(IGNORE_ENV, "").split(",")):
        signal.signal(signal.Signals[name], signal.SIG_IGN)
    import torch

    from ..training.signals import RunPreempted
    from ..training.trainer import flush_denormals_early

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.device == "cpu":
        flush_denormals_early()  # before torch's worker threads start, so they inherit it
    job = Job(**json.loads(args.job))
    try:
        run_job(job, Path(args.out), args.device, args.save_model)
    except RunPreempted as stop:
        print(stop, flush=True)
        return EXIT_PREEMPTED
    except RunBusy as busy:  # taken by another sweep between its check and this start
        print(busy, flush=True)
        return EXIT_BUSY
    except Exception:  # noqa: BLE001  (the whole traceback goes to the job's log)
        traceback.print_exc()
        return 1
    return 0


# --- one job, as a child process --------------------------------------------------------------

def child_command(job: Job, out: Path, device: str, save_model: bool = False) -> list[str]:
    """The command line of a job's process."""
    return [sys.executable, "-m", CHILD_MODULE, "--job", json.dumps(asdict(job)),
            "--out", str(out), "--device", device, *(["--save-model"] if save_model else [])]


def child_env(threads: int) -> dict[str, str]:
    """The environment of a job's process: ``threads`` CPU threads, this checkout first on
    the path, offline."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1"}


class Children:
    """The live job processes of a runner, each in its own session, so that a signal to the
    runner's process group (Ctrl-C, ``timeout``) reaches them once, from the runner. A stop
    signal to the runner (SIGINT goes on as SIGTERM) goes on to each (it finishes its step,
    writes a checkpoint and exits 75) and no further job starts."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, ignored: Sequence[str] = ()) -> None:
        self.live: set[subprocess.Popen] = set()
        self.stopped_by: str | None = None
        self.not_started: set[str] = set()  # names of the jobs skipped after a stop
        self.ignored = tuple(ignored)  # signal names the job processes ignore

    def forward(self, signum: int, frame: Any) -> None:
        self.stopped_by = signal.Signals(signum).name
        for child in list(self.live):
            child.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)

    @contextlib.contextmanager
    def forwarding(self) -> Iterator[Children]:
        """Install :meth:`forward` for :attr:`SIGNALS` (main thread only) while in use."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self.forward) for sig in self.SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def spawn(job: Job, out: Path, device: str, threads: int, save_model: bool = False,
          children: Children | None = None) -> tuple[Job, int, float]:
    """Run a job as a child process, its output appended to ``<out>/logs/<name>.log`` (one
    header line per attempt); returns (job, exit status, wall seconds). The local runner calls
    it in a thread (``children``: its live processes; a stopped runner starts none, status
    75), a scheduler's array task (:mod:`mosaics.evaluation.cluster`) in its own process."""
    out = Path(out)
    if children is not None and children.stopped_by:
        children.not_started.add(job.name)
        return job, EXIT_PREEMPTED, 0.0
    # Another sweep over this --out may have finished or taken the job since this one listed
    # it: neither train it again (its result would be overwritten) nor start a second process.
    if result_path(out, job).exists():
        return job, EXIT_DONE_ELSEWHERE, 0.0
    if live_holder(out / "jobs" / job.name) is not None:
        return job, EXIT_BUSY, 0.0
    log = log_path(out, job)
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(log, "a") as handle:
        handle.write(f"--- attempt started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        env = child_env(threads)
        if children is not None and children.ignored:
            env[IGNORE_ENV] = ",".join(children.ignored)
        child = subprocess.Popen(child_command(job, out, device, save_model), stdout=handle,
                                 stderr=subprocess.STDOUT, env=env,
                                 start_new_session=children is not None)
        if children is not None:
            children.live.add(child)
            if children.stopped_by:  # the signal came while it started
                child.send_signal(signal.SIGTERM)
        try:
            status = child.wait()
        finally:
            if children is not None:
                children.live.discard(child)
    return job, status, time.time() - started


def run_local(todo: Sequence[Job], out: Path, device: str, parallel: int, threads: int,
              save_model: bool) -> Iterator[Outcome]:
    """The local runner: ``parallel`` child processes at a time, outcomes as they finish;
    SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) to it stops every running job at a checkpoint and
    starts no other."""
    children = Children()
    with children.forwarding(), ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = [pool.submit(spawn, job, out, device, threads, save_model, children)
                   for job in todo]
        for future in as_completed(futures):
            job, status, seconds = future.result()
            yield job, status, seconds, (NOT_STARTED if job.name in children.not_started
                                         else "")


# --- what a job left under <out> ------------------------------------------------------------

def record_failure(out: Path, job: Job, status: int, seconds: float,
                   reason: str = "") -> dict[str, Any]:
    """Write ``<out>/failed/<name>.json``: exit status, seconds and the end of the job's log
    (a failed job has no result file, so the next sweep runs it again)."""
    log = log_path(out, job)
    tail = log.read_text(errors="replace")[-LOG_TAIL:] if log.exists() else ""
    if status == 0:  # exited cleanly without a result file
        status = -1
    record = {"job": job_record(job), "status": status, "seconds": seconds,
              "log": str(log), "log_tail": tail + (f"\n{reason}" if reason else "")}
    write_json(failure_path(out, job), record)
    return record


def checkpointed(out: Path, job: Job) -> Path | None:
    """The intact checkpoint a job's next attempt resumes from, if any."""
    from ..training.checkpoint import find_resumable

    for run_dir in sorted((Path(out) / "jobs" / job.name).glob("runs/*")):
        path, _ = find_resumable(run_dir)
        if path is not None:
            return path
    return None


def job_state(out: Path, job: Job) -> str:
    """One line on where ``job`` stands under ``out``: ``done`` (minutes), ``running`` (the
    process and host holding its lock, the step and validation exact match of its learning
    curve), ``stopped`` (the step of the checkpoint the next sweep resumes), ``failed`` (exit
    status) or ``todo``."""
    from ..training.metrics import read_metrics

    out = Path(out)
    if result_path(out, job).exists():
        record = json.loads(result_path(out, job).read_text())
        return f"done     {job.name} ({record.get('seconds', 0) / 60:.1f} min)"
    work = out / "jobs" / job.name
    curve = ""
    for metrics in sorted(work.glob("runs/*/metrics.jsonl")):
        rows = read_metrics(metrics)
        scored = [r for r in rows if "val/exact_match" in r]
        if rows:
            curve = f"step {rows[-1]['step']}" + (
                f", val exact match {scored[-1]['val/exact_match']:.2f}" if scored else "")
    holder = live_holder(work)
    if holder is not None:
        return (f"running  {job.name} (PID {holder.get('pid')} on {holder.get('host')}"
                + (f"; {curve})" if curve else ")"))
    path = checkpointed(out, job)
    if path is not None:
        return f"stopped  {job.name} (resumes from {path.name}; {curve or 'no curve'})"
    if failure_path(out, job).exists():
        status = json.loads(failure_path(out, job).read_text()).get("status")
        return f"failed   {job.name} (exit {status}" + (f"; {curve})" if curve else ")")
    return f"todo     {job.name}" + (f" (an attempt reached {curve}, no checkpoint)"
                                     if curve else "")
