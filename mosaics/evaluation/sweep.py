"""The sweep: run the jobs of ``mosaics eval sweep | regbench | extrapolation`` that have no
result file yet, each in its own process, here (:func:`mosaics.evaluation.runner.run_local`)
or as one SLURM job array (:mod:`mosaics.evaluation.cluster`), and sort their outcomes.

Jobs: :mod:`mosaics.evaluation.jobs`; a job's process: :mod:`mosaics.evaluation.runner`;
the tables of what is done: :mod:`mosaics.evaluation.tables`. A job whose result file exists
is skipped, so a stopped sweep resumes where it was. A failed job leaves
``<out>/failed/<name>.json`` (exit status and the end of its log, ``<out>/logs/<name>.log``)
and is retried by the next sweep. Learning curves: ``<out>/jobs/<name>/runs/<run>/metrics.jsonl``.

``python -m mosaics.evaluation.sweep --job JSON --out DIR`` runs one job: the command line of
each job's process (:func:`mosaics.evaluation.runner.child_main`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..training.rundir import live_holder
from ..training.signals import EXIT_PREEMPTED
from . import cluster
from .jobs import Job, failure_path, log_path, result_path
from .runner import (
    EXIT_BUSY,
    EXIT_DONE_ELSEWHERE,
    checkpointed,
    child_main,
    record_failure,
    run_local,
    threads_per_job,
)

EXECUTORS = ("local", "slurm", "submitit-local")


def run_sweep(jobs: Sequence[Job], out: str | Path, parallel: int = 1, device: str = "cpu",
              report: Callable[[str], None] = print, threads: int | None = None,
              executor: str = "local", resources: Any = None,
              save_model: bool = False) -> dict[str, list[Job]]:
    """Run the jobs without a result file; returns the skipped, finished, failed and stopped
    jobs (stopped: exit status 75, a checkpoint was written, or never started because the
    sweep was stopped; the next sweep resumes them), and the busy ones: those another live
    process (a second sweep over the same ``out``) holds the lock of, left to it.

    ``executor="local"``: ``parallel`` processes at a time on this machine with ``threads``
    CPU threads each (default: the cores split between them). ``"slurm"``: one SLURM job array
    through submitit with ``resources`` (:class:`mosaics.evaluation.cluster.Resources`), waiting
    for it; ``"submitit-local"``: the same through submitit's local executor (no scheduler).
    Either way each job writes its own result file, so skip-done and resume are the same."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; choose from {', '.join(EXECUTORS)}")

    out = Path(out)
    done: dict[str, list[Job]] = {"skipped": [], "finished": [], "failed": [], "stopped": [],
                                  "busy": []}
    todo = []
    for job in jobs:
        if result_path(out, job).exists():
            done["skipped"].append(job)
        elif live_holder(out / "jobs" / job.name) is not None:
            done["busy"].append(job)  # another sweep over this --out is running it
        else:
            todo.append(job)
    resuming = sum(1 for job in todo if checkpointed(out, job))
    to_run = f"{len(todo)} to run" + (f" ({resuming} from a checkpoint)" if resuming else "")
    if done["busy"]:
        to_run += (f", {len(done['busy'])} left to the other sweep that holds "
                   f"{'it' if len(done['busy']) == 1 else 'them'} "
                   f"({', '.join(j.name for j in done['busy'])})")
    if executor == "local":
        threads = threads or threads_per_job(parallel)
        report(f"{len(jobs)} jobs: {len(done['skipped'])} already done, {to_run}, "
               f"{min(parallel, len(todo) or 1)} at a time with {threads} thread(s) each on "
               f"{device}")
        outcomes = run_local(todo, out, device, parallel, threads, save_model)
    else:
        report(f"{len(jobs)} jobs: {len(done['skipped'])} already done, "
               f"{to_run.replace('to run', 'to submit')} ({executor}) on {device}")
        outcomes = cluster.submit(todo, out, device, resources or cluster.Resources(),
                                  executor, save_model, report) if todo else iter(())
    for i, (job, status, seconds, reason) in enumerate(outcomes, 1):
        if status in (0, EXIT_DONE_ELSEWHERE) and result_path(out, job).exists():
            failure_path(out, job).unlink(missing_ok=True)
            done["finished"].append(job)
            report(f"[{i}/{len(todo)}] done   {job.name} "
                   + (f"({seconds:.0f} s)" if status == 0
                      else "(by another sweep over this folder)"))
        elif status == EXIT_BUSY:
            done["busy"].append(job)
            report(f"[{i}/{len(todo)}] BUSY   {job.name} (another sweep over this folder "
                   "took it after this one started; left to it)")
        elif status == EXIT_PREEMPTED:
            done["stopped"].append(job)
            report(f"[{i}/{len(todo)}] STOPPED {job.name} ("
                   + (f"{reason}; the next sweep runs it" if reason else
                      f"exit {status}: checkpoint written after {seconds:.0f} s; the next "
                      "sweep resumes it") + ")")
        else:
            record_failure(out, job, status, seconds, reason)
            done["failed"].append(job)
            report(f"[{i}/{len(todo)}] FAILED {job.name} (exit {status}, log "
                   f"{log_path(out, job)}){' ' + reason if reason else ''}")
    return done


if __name__ == "__main__":
    sys.exit(child_main())
