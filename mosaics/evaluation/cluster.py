"""Sweep jobs on a scheduler: one SLURM job array through submitit (or submitit's local
executor, which runs the same code path as real processes without a scheduler).

Each array task runs :func:`mosaics.evaluation.runner.spawn`, the function the local runner
uses: the job's own process writes ``<out>/results/<name>.json`` and ``<out>/logs/<name>.log``;
submitit's own files (the task's stdout/stderr and pickles) go to ``<out>/logs/submitit``.
A preempted or timed-out task is requeued (:class:`ResumableTask`) and its job resumes from
its last checkpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .runner import Children, spawn


@dataclass
class Resources:
    """What each array task asks the scheduler for.

    ``slurm`` holds further ``#SBATCH`` options by name (``account``, ``qos``,
    ``constraint``, ...), passed as submitit's ``slurm_additional_parameters``."""

    partition: str | None = None
    gpus_per_job: int = 0
    cpus_per_job: int = 1
    time_min: int = 60
    mem_gb: float | None = None
    array_parallelism: int = 256  # array tasks running at once
    slurm: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, spec: dict[str, Any] | None, source: str) -> Resources:
        """From a job file's ``resources:`` mapping; unknown keys are an error."""
        spec = dict(spec or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"{source}: unknown resource setting(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**spec).checked(source)

    def merged(self, **overrides: Any) -> Resources:
        """A copy with the non-None ``overrides`` applied (command line over job file)."""
        extra = overrides.pop("slurm", None) or {}
        values = {**asdict(self), **{k: v for k, v in overrides.items() if v is not None}}
        values["slurm"] = {**self.slurm, **extra}
        return Resources(**values).checked("command line")

    def checked(self, source: str) -> Resources:
        for name in ("cpus_per_job", "time_min", "array_parallelism"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{source}: {name} must be positive, got {getattr(self, name)}")
        if self.gpus_per_job < 0:
            raise ValueError(f"{source}: gpus_per_job must be >= 0, got {self.gpus_per_job}")
        return self

    def executor_parameters(self, name: str) -> dict[str, Any]:
        """The parameters of submitit's ``AutoExecutor.update_parameters``."""
        params: dict[str, Any] = {"name": name, "timeout_min": int(self.time_min),
                                  "cpus_per_task": int(self.cpus_per_job), "nodes": 1,
                                  "tasks_per_node": 1,
                                  "slurm_array_parallelism": int(self.array_parallelism)}
        if self.gpus_per_job:
            params["gpus_per_node"] = int(self.gpus_per_job)
        if self.mem_gb is not None:
            params["mem_gb"] = self.mem_gb
        if self.partition:
            params["slurm_partition"] = self.partition
        if self.slurm:
            params["slurm_additional_parameters"] = dict(self.slurm)
        return params


def _submitit() -> Any:
    try:
        import submitit
    except ImportError:
        raise ImportError("dispatching sweep jobs to a scheduler needs submitit: "
                          "pip install 'mosaics[cluster]' (or pip install submitit)") from None
    return submitit


class ResumableTask:
    """An array task: runs one job's process (:func:`mosaics.evaluation.runner.spawn`).

    When SLURM signals a preemption, or the end of the time limit, submitit calls
    :meth:`checkpoint`. It sends SIGTERM to the job's process, which finishes its step, writes
    a checkpoint and exits. It waits for that up to ``grace_s`` seconds (submitit's signal
    comes 90 s before the limit), then has the task requeued with the same arguments. The
    requeued task's job resumes from the checkpoint: a fresh task, so nothing of the live one
    is pickled with the requeue."""

    def __init__(self, grace_s: float = 60.0) -> None:
        self.grace_s = grace_s
        self._children: Any = None

    def __call__(self, job: Any, out: Path, device: str, threads: int,
                 save_model: bool = False) -> tuple[Any, int, float]:
        # SLURM sends submitit's warning signal to every process of the task: the job's
        # process ignores it and stops on the SIGTERM of checkpoint() instead
        warning = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper()
        warning = warning if warning.startswith("SIG") else "SIG" + warning
        self._children = Children(ignored=(warning,))
        return spawn(job, out, device, threads, save_model, self._children)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's hook (in the task's signal handler): stop the job at a checkpoint, then
        the submission that requeues this task."""
        live = list(self._children.live) if self._children is not None else []
        for child in live:
            child.send_signal(signal.SIGTERM)
        deadline = time.time() + self.grace_s
        for child in live:  # reaped here: the task's own wait() holds its Popen lock
            while time.time() < deadline:
                try:
                    if os.waitpid(child.pid, os.WNOHANG)[0]:
                        break
                except ChildProcessError:
                    break
                time.sleep(0.1)
        return _submitit().helpers.DelayedSubmission(ResumableTask(self.grace_s), *args,
                                                     **kwargs)


def submit(todo: Sequence[Any], out: Path, device: str, resources: Resources,
           executor: str = "slurm", save_model: bool = False,
           report: Callable[[str], None] = print) -> Iterator[tuple[Any, int, float, str]]:
    """Submit ``todo`` as one job array (``executor`` ``slurm``, or ``submitit-local`` for
    local processes) and yield ``(job, exit status, seconds, reason)`` as tasks finish; a
    preempted or timed-out task is requeued (:class:`ResumableTask`)."""
    submitit = _submitit()
    folder = Path(out) / "logs" / "submitit"
    cluster = "local" if executor == "submitit-local" else "slurm"
    if cluster == "slurm" and not (shutil.which("sbatch") and shutil.which("srun")):
        raise RuntimeError("--executor slurm needs SLURM's sbatch and srun on PATH: run the "
                           "command on the cluster's login node (--executor submitit-local "
                           "runs the same jobs as local processes)")
    ex = submitit.AutoExecutor(folder=folder, cluster=cluster)
    ex.update_parameters(**resources.executor_parameters(f"mosaics-{Path(out).name}"))
    with ex.batch():
        handles = [ex.submit(ResumableTask(), job, Path(out), device, resources.cpus_per_job,
                             save_model) for job in todo]
    by_id = {h.job_id: job for h, job in zip(handles, todo)}
    first = handles[0].job_id.split("_")[0] if handles else "-"
    report(f"submitted {len(handles)} task(s) as {cluster} job {first}; scheduler logs in "
           f"{folder}")
    for handle in submitit.helpers.as_completed(handles):
        job = by_id[handle.job_id]
        try:
            _, status, seconds = handle.result()
            yield job, status, seconds, ""
        except Exception as err:  # noqa: BLE001  (killed, timed out, node failure)
            reason = (f"scheduler task {handle.job_id} did not finish: {err}".splitlines()[0]
                      + f"; see {handle.paths.stderr}")
            yield job, -1, 0.0, reason
