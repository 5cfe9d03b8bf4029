"""The experiment engine behind ``mosaics eval regbench | extrapolation | sweep``: expand
jobs, run each as its own process (here, or as a SLURM array task through
:mod:`mosaics.evaluation.cluster`), merge the results into one set of tables.

A job is one (task, model, seed, size) under a preset with overrides, or the scoring of a
saved model. Each job runs as a separate ``python -m mosaics.evaluation.sweep`` process and
writes
``<out>/results/<name>.json`` atomically; a job whose result file exists is skipped, so a
stopped sweep resumes where it was. A failed job leaves ``<out>/failed/<name>.json`` (exit
status and the end of its log, ``<out>/logs/<name>.log``) and is retried by the next sweep.
Learning curves: ``<out>/jobs/<name>/runs/<run>/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from ..training.rundir import RunBusy, RunLock, live_holder
from ..training.signals import EXIT_PREEMPTED
from . import paper
from .models import MOSAICS_ARCHS, check_config_changes, is_mosaics, saved_label

TASKS = ("regbench", "sort", "mqmtar")
BASELINE_ARCHS = ("gpt2", "llama")
LOG_TAIL = 4000  # characters of a failed job's log kept in its failure record
# overrides that change the model, not the protocol: they go into the job's label and name,
# so such a model is a row of the same table as the models without them
MODEL_OVERRIDES = ("alibi",)


def model_label(model: str, kernel_kwargs: dict[str, Any]) -> str:
    """A table row's model: ``model``, then its kernel arguments, e.g. ``relumax (r=2)``."""
    extra = ",".join(f"{k}={v}" for k, v in sorted(kernel_kwargs.items()))
    return f"{model} ({extra})" if extra else model


@dataclass(frozen=True)
class Job:
    """One experiment: ``model`` is ``mosaics/<kernel>``, ``mosaics-v2/<kernel>`` (the v2
    block), ``gpt2``, ``llama``, or ``saved`` (score the saved ``model_dir``, no training);
    ``size`` is the number of training automata (RegBench training only)."""

    task: str
    model: str
    seed: int = 0
    size: int | None = None
    preset: str = "reference"
    overrides: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    kernel_kwargs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    model_dir: str | None = None
    # changes to the saved model's config before it is scored (model "saved" only)
    config_changes: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def arch(self) -> str:
        return self.model.split("/", 1)[0]

    @property
    def kernel(self) -> str | None:
        return self.model.split("/", 1)[1] if is_mosaics(self.arch) else None

    @property
    def label(self) -> str:
        """The table row: the model, with its kernel arguments if any."""
        if self.model_dir is not None:
            return saved_label(self.model_dir, self.config_changes)
        label = model_label(self.model, self.kernel_kwargs)
        return f"{label} +alibi" if self.overrides.get("alibi") else label

    @property
    def setting(self) -> str:
        """Preset plus a short digest of the protocol overrides: jobs of one setting share a
        table."""
        protocol = {k: v for k, v in self.overrides.items() if k not in MODEL_OVERRIDES}
        if not protocol:
            return self.preset
        text = json.dumps(protocol, sort_keys=True, default=str)
        return f"{self.preset}+{hashlib.sha1(text.encode()).hexdigest()[:6]}"

    @property
    def name(self) -> str:
        """File-name-safe, unique per (task, model, kernel arguments, size, seed, setting)."""
        parts = [self.task, self.model.replace("/", "-")]
        if self.model_dir is not None:
            digest = hashlib.sha1(self.model_dir.encode()).hexdigest()[:6]
            parts.append(f"{Path(self.model_dir).name}-{digest}")
            parts += [f"{k}{v}" for k, v in sorted(self.config_changes.items())]
        parts += [f"{k}{v}" for k, v in sorted(self.kernel_kwargs.items())]
        parts += [k for k in MODEL_OVERRIDES if self.overrides.get(k)]
        if self.size is not None:
            parts.append(f"n{self.size}")
        parts += [f"s{self.seed}", self.setting.replace("+", "-")]
        return "-".join(str(p) for p in parts).replace(" ", "")


def normalize_model(model: str) -> str:
    """``gaussian`` -> ``mosaics/gaussian``; ``gpt2`` / ``llama`` / ``mosaics-v2/<kernel>``
    unchanged."""
    if model in BASELINE_ARCHS or model.split("/", 1)[0] in MOSAICS_ARCHS and "/" in model:
        return model
    if "/" in model:
        raise ValueError(f"unknown model {model!r}; use mosaics/<kernel>, "
                         "mosaics-v2/<kernel>, gpt2 or llama")
    return f"mosaics/{model}"


def protocol_class(task: str) -> type:
    from .experiments import ExtrapolationProtocol, RegBenchProtocol

    return RegBenchProtocol if task == "regbench" else ExtrapolationProtocol


def presets(task: str) -> dict[str, Any]:
    from .experiments import EXTRAPOLATION_PRESETS, REGBENCH_PRESETS

    return REGBENCH_PRESETS if task == "regbench" else EXTRAPOLATION_PRESETS


def _own_overrides(task: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides that are fields of this task's protocol (RegBench and extrapolation
    protocols differ: ``max_steps`` vs ``steps``); a key of neither protocol is an error."""
    from .experiments import ExtrapolationProtocol, RegBenchProtocol

    known = {f.name for cls in (RegBenchProtocol, ExtrapolationProtocol) for f in fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown protocol setting(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")
    mine = {f.name for f in fields(protocol_class(task))}
    return {k: v for k, v in overrides.items() if k in mine}


def make_job(task: str, model: str, seed: int = 0, size: int | None = None,
             preset: str = "reference", overrides: dict[str, Any] | None = None,
             kernel_kwargs: dict[str, Any] | None = None, model_dir: str | None = None,
             config_changes: dict[str, Any] | None = None) -> Job:
    """A checked :class:`Job` (known task, model, kernel, preset and settings); with
    ``model_dir`` a job that scores that saved model directory (``model`` is ignored), after
    the ``config_changes`` to its config (fields of its config.json)."""
    from mosaics import available_kernels

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if model_dir is not None:
        path = Path(model_dir).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise ValueError(f"{model_dir}: not a saved model directory (no config.json); pass "
                             "a folder written by save_pretrained")
        if preset not in presets(task):
            raise ValueError(f"unknown {task} preset {preset!r}; choose from "
                             f"{', '.join(presets(task))}")
        check_config_changes(path, config_changes or {})
        return Job(task, "saved", int(seed), None, preset,
                   _own_overrides(task, dict(overrides or {})), {}, str(path),
                   dict(config_changes or {}))
    if config_changes:
        raise ValueError("model config changes apply to a saved model directory only; to train "
                         "a model with another setting use the protocol override (e.g. "
                         "--set alibi=true) or the kernel arguments")
    model = normalize_model(model)
    kernel = model.split("/", 1)[1] if "/" in model else None
    if kernel is not None and kernel not in available_kernels():
        raise ValueError(f"unknown kernel {kernel!r}; registered kernels: "
                         f"{', '.join(available_kernels())}")
    if task != "regbench" and model == "gpt2":
        raise ValueError("gpt2 cannot be scored past its learned position table; the "
                         "extrapolation baseline is llama")
    if preset not in presets(task):
        raise ValueError(f"unknown {task} preset {preset!r}; choose from "
                         f"{', '.join(presets(task))}")
    if task == "regbench" and size is None:
        raise ValueError("a regbench job needs a size (training automata)")
    return Job(task, model, int(seed), size if task == "regbench" else None, preset,
               _own_overrides(task, dict(overrides or {})), dict(kernel_kwargs or {}))


def expand_jobs(tasks: Iterable[str], models: Iterable[str], seeds: Iterable[int] = (0,),
                sizes: Iterable[int] = (1000,), preset: str = "reference",
                overrides: dict[str, Any] | None = None,
                kernel_kwargs: dict[str, Any] | None = None) -> tuple[list[Job], list[str]]:
    """The cartesian product task x model x seed (x size for RegBench), duplicates dropped.
    Returns the jobs and notes on the combinations left out (gpt2 on the extrapolation tasks).
    """
    jobs: dict[str, Job] = {}
    notes: list[str] = []
    for task, model, seed in itertools.product(tasks, models, seeds):
        if task != "regbench" and normalize_model(model) == "gpt2":
            notes.append(f"{task} x gpt2 left out: learned positions cannot extrapolate "
                         "(llama is the transformer baseline there)")
            continue
        for size in sizes if task == "regbench" else [None]:
            job = make_job(task, model, seed, size, preset, overrides, kernel_kwargs)
            jobs.setdefault(job.name, job)
    return list(jobs.values()), list(dict.fromkeys(notes))


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def load_job_file(path: str | Path, overrides: dict[str, Any] | None = None
                  ) -> tuple[list[Job], list[str]]:
    """Jobs from YAML or JSON: a mapping with optional ``defaults`` (preset, overrides,
    kernel_kwargs, seed, size), ``grid`` (lists of task / model / seed / size, expanded as a
    cartesian product), ``jobs`` (a list of single jobs) and ``resources`` (scheduler
    requests, :func:`job_file_resources`); a bare list means ``jobs``. ``overrides`` (the
    command line's ``--set``) have the last word over the file's, for every job whose task's
    protocol has the key."""
    import yaml

    try:
        spec = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"cannot read job file {path}: {err}") from None
    if isinstance(spec, list):
        spec = {"jobs": spec}
    if not isinstance(spec, dict) or not ({"grid", "jobs"} & set(spec)):
        raise ValueError(f"job file {path}: expected a mapping with 'grid' and/or 'jobs', "
                         "or a list of jobs")
    defaults = dict(spec.get("defaults") or {})
    last = dict(overrides or {})
    jobs: dict[str, Job] = {}
    notes: list[str] = []
    if spec.get("grid"):
        grid = {**defaults, **spec["grid"]}
        found, notes = expand_jobs(
            _as_list(grid["task"]), _as_list(grid["model"]), _as_list(grid.get("seed", 0)),
            _as_list(grid.get("size", 1000)), grid.get("preset", "reference"),
            {**(grid.get("overrides") or {}), **last}, grid.get("kernel_kwargs"))
        jobs.update((j.name, j) for j in found)
    for entry in spec.get("jobs") or []:
        item = {**defaults, **entry}
        item["overrides"] = {**(defaults.get("overrides") or {}), **(entry.get("overrides") or {}),
                             **last}
        if item["task"] != "regbench":
            item.pop("size", None)
        job = make_job(**item)
        jobs.setdefault(job.name, job)
    return list(jobs.values()), notes


def job_file_resources(path: str | Path) -> dict[str, Any]:
    """The ``resources:`` mapping of a job file (scheduler requests; empty when absent)."""
    import yaml

    spec = yaml.safe_load(Path(path).read_text())
    found = spec.get("resources") if isinstance(spec, dict) else None
    if found is not None and not isinstance(found, dict):
        raise ValueError(f"job file {path}: 'resources' must be a mapping, e.g. "
                         "{gpus_per_job: 1, time_min: 120, partition: gpu}")
    return dict(found or {})


# The sparse-kernel paper's tables (its numbers: paper.py): kernels with their arguments, k of the
# kNN kernels per table, RegBench sizes, and the transformer baseline of each table.
PAPER_KERNELS = ("gaussian", "gaussian_knn", "uniform_knn", "epanechnikov_fixed", "relumax",
                 "epanechnikov", "biweight", "triweight")
PAPER_KNN_K = {"regbench": 16, "sort": 32, "mqmtar": 32}
PAPER_SIZES = (1000, 5000, 10000, 40000)


def paper_jobs(seeds: Iterable[int] = (0,), preset: str = "reference",
               overrides: dict[str, Any] | None = None) -> list[Job]:
    """Every job of the paper's RegBench and length-extrapolation tables (GPT-2 is the
    RegBench transformer, the rotary Llama the extrapolation one)."""
    jobs = []
    for task, seed in itertools.product(TASKS, seeds):
        baseline = "gpt2" if task == "regbench" else "llama"
        for model in (baseline, *(f"mosaics/{k}" for k in PAPER_KERNELS)):
            kwargs = {"k": PAPER_KNN_K[task]} if model.endswith("_knn") else None
            for size in PAPER_SIZES if task == "regbench" else [None]:
                jobs.append(make_job(task, model, seed, size, preset, overrides, kwargs))
    return jobs


# --- running -------------------------------------------------------------------------------

def threads_per_job(parallel: int, cores: int | None = None) -> int:
    """CPU threads for each of ``parallel`` concurrent jobs."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, parallel))


def result_path(out: Path, job: Job) -> Path:
    return out / "results" / f"{job.name}.json"


def failure_path(out: Path, job: Job) -> Path:
    return out / "failed" / f"{job.name}.json"


def _job_record(job: Job) -> dict[str, Any]:
    return {**asdict(job), "name": job.name, "label": job.label, "setting": job.setting}


def run_job(job: Job, out: Path, device: str, save_model: bool = False) -> dict[str, Any]:
    """Run one job in this process and write its result record atomically (the child side):
    ``{"job": ..., "device": ..., "seconds": wall time, "results": ...}``. Training
    checkpoints at every evaluation under ``<out>/jobs/<name>/runs``: a job stopped by a signal
    (exit status 75) or killed resumes from its last checkpoint when the sweep runs again, and
    ``seconds`` counts every attempt; the checkpoints are removed once the result is written.
    ``<out>/jobs/<name>/.lock`` refuses a second process on the same job (another sweep over
    the same folder) while the first lives."""
    from . import experiments

    proto = experiments.with_overrides(presets(job.task)[job.preset], **_typed(job.overrides))
    work = out / "jobs" / job.name
    work.mkdir(parents=True, exist_ok=True)
    lock = RunLock(work)  # two sweeps over one folder must not train one job twice
    note = lock.acquire()
    if note:
        print(note, flush=True)
    started = time.time()
    try:
        if job.task == "regbench":
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
    record = {"job": _job_record(job), "device": device,
              "seconds": time.time() - started + earlier, "results": results}
    experiments.write_json(result_path(out, job), record)
    return record


def _typed(overrides: dict[str, Any]) -> dict[str, Any]:
    """JSON lists back to the tuples the protocols use."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}


def _child_command(job: Job, out: Path, device: str, save_model: bool = False) -> list[str]:
    return [sys.executable, "-m", "mosaics.evaluation.sweep", "--job",
            json.dumps(asdict(job)), "--out", str(out), "--device", device,
            *(["--save-model"] if save_model else [])]


def _child_env(threads: int) -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1"}


class _Children:
    """The local runner's live job processes, each in its own session, so that a signal to
    the runner's process group (Ctrl-C, ``timeout``) reaches them once, from the runner. A
    stop signal to the runner (SIGINT goes on as SIGTERM) goes on to each (it finishes its
    step, writes a checkpoint and exits 75) and no further job starts."""

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
    def forwarding(self) -> Iterator[_Children]:
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


NOT_STARTED = "not started: the sweep was stopped"
# exit status of a job's process that found its lock held by another live process (a second
# sweep over the same --out took the job after this sweep listed it): left to that sweep
EXIT_BUSY = 73
# what _spawn reports, without starting a process, for a job whose result file another sweep
# over the same --out wrote after this sweep listed it (no job process exits with it)
EXIT_DONE_ELSEWHERE = 74
# signal names a job's process ignores (a scheduler's warning meant for the task that runs it)
IGNORE_ENV = "MOSAICS_IGNORE_SIGNALS"


def _spawn(job: Job, out: Path, device: str, threads: int, save_model: bool = False,
           children: _Children | None = None) -> tuple[Job, int, float]:
    """Run a job as a child process, its output appended to ``<out>/logs/<name>.log`` (one
    header line per attempt); returns (job, exit status, wall seconds). The local runner calls
    it in a thread (``children``: its live processes; a stopped runner starts none, status
    75), a scheduler's worker (:mod:`mosaics.evaluation.cluster`) in its own process."""
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
    log = out / "logs" / f"{job.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(log, "a") as handle:
        handle.write(f"--- attempt started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        env = _child_env(threads)
        if children is not None and children.ignored:
            env[IGNORE_ENV] = ",".join(children.ignored)
        child = subprocess.Popen(_child_command(job, out, device, save_model), stdout=handle,
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


def _record_failure(out: Path, job: Job, status: int, seconds: float,
                    reason: str = "") -> dict[str, Any]:
    from .experiments import write_json

    log = out / "logs" / f"{job.name}.log"
    tail = log.read_text(errors="replace")[-LOG_TAIL:] if log.exists() else ""
    if status == 0:  # exited cleanly without a result file
        status = -1
    record = {"job": _job_record(job), "status": status, "seconds": seconds,
              "log": str(log), "log_tail": tail + (f"\n{reason}" if reason else "")}
    write_json(failure_path(out, job), record)
    return record


def _checkpointed(out: Path, job: Job) -> Path | None:
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
    path = _checkpointed(out, job)
    if path is not None:
        return f"stopped  {job.name} (resumes from {path.name}; {curve or 'no curve'})"
    if failure_path(out, job).exists():
        status = json.loads(failure_path(out, job).read_text()).get("status")
        return f"failed   {job.name} (exit {status}" + (f"; {curve})" if curve else ")")
    return f"todo     {job.name}" + (f" (an attempt reached {curve}, no checkpoint)"
                                     if curve else "")


Outcome = tuple[Job, int, float, str]  # job, exit status, wall seconds, reason of a failure


def _run_local(todo: Sequence[Job], out: Path, device: str, parallel: int, threads: int,
               save_model: bool) -> Iterator[Outcome]:
    """The local runner: ``parallel`` child processes at a time, outcomes as they finish;
    SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) to it stops every running job at a checkpoint and
    starts no other."""
    children = _Children()
    with children.forwarding(), ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = [pool.submit(_spawn, job, out, device, threads, save_model, children)
                   for job in todo]
        for future in as_completed(futures):
            job, status, seconds = future.result()
            yield job, status, seconds, (NOT_STARTED if job.name in children.not_started
                                         else "")


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
    resuming = sum(1 for job in todo if _checkpointed(out, job))
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
        outcomes = _run_local(todo, out, device, parallel, threads, save_model)
    else:
        from . import cluster

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
            _record_failure(out, job, status, seconds, reason)
            done["failed"].append(job)
            report(f"[{i}/{len(todo)}] FAILED {job.name} (exit {status}, log "
                   f"{out / 'logs' / (job.name + '.log')}){' ' + reason if reason else ''}")
    return done


# --- merging -------------------------------------------------------------------------------

def load_results(out: str | Path) -> list[dict[str, Any]]:
    """Every job result under ``<out>/results``, in name order."""
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("results/*.json"))]


def load_failures(out: str | Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("failed/*.json"))]


def merge_results(sources: Iterable[str | Path], out: str | Path) -> int:
    """Copy the result files of other output folders into ``<out>/results`` (one table over
    all of them); returns how many were copied. Jobs of the same name must agree."""
    from .experiments import write_json

    copied = 0
    for source in map(Path, sources):
        files = sorted(source.glob("results/*.json"))
        if not files:
            raise ValueError(f"{source}: no result files (results/*.json); pass folders "
                             "written by a sweep's --out")
        for path in files:
            record = json.loads(path.read_text())
            target = Path(out) / "results" / path.name
            if target.exists() and json.loads(target.read_text())["results"] != \
                    record["results"]:
                raise ValueError(f"{path} and {target} hold different results for the same "
                                 "job; keep one of them")
            write_json(target, record)
            copied += 1
    return copied


def _cell(values: list[float]) -> str:
    """``mean`` or ``mean ± std (n)`` over seeds."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f} ({len(values)})"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _groups(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Records by (task, setting): one table per task and protocol."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        groups[(rec["job"]["task"], rec["job"]["setting"])].append(rec)
    return dict(sorted(groups.items()))


def regbench_rows(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Merged RegBench runs (one per job, with its seed) and baselines averaged over seeds,
    in the layout :func:`plots.plot_regbench` reads."""
    runs, baselines = [], defaultdict(lambda: defaultdict(list))
    seen_seeds = set()
    for rec in records:
        res = rec["results"]
        for run in res["runs"]:
            runs.append({**run, "label": rec["job"]["label"], "seed": rec["job"]["seed"]})
        if res["seed"] not in seen_seeds:
            seen_seeds.add(res["seed"])
            for name, score in res["baselines"].items():
                for key in ("accuracy", "tvd"):
                    baselines[name][key].append(score[key])
    return {"runs": runs, "baselines": {name: {k: float(np.mean(v)) for k, v in s.items()}
                                        for name, s in baselines.items()},
            "baseline_values": {name: dict(s) for name, s in baselines.items()},
            "seconds": _job_seconds(records)}


def regbench_markdown(merged: dict[str, Any]) -> str:
    """Accuracy / TVD per model x training size (mean ± std over seeds; the paper's in
    parentheses where it has one), n-gram rows below, wall minutes per model."""
    runs = merged["runs"]
    sizes = sorted({r["size"] for r in runs}, key=lambda s: (s is None, s or 0))
    header = ["model"] + [f"n={s} accuracy / TVD" if s is not None else "saved model "
                          "accuracy / TVD" for s in sizes] + ["minutes"]
    rows = []
    for label in dict.fromkeys(r["label"] for r in runs):
        cells = []
        for size in sizes:
            mine = [r for r in runs if r["label"] == label and r["size"] == size]
            cell = (f"{_cell([r['accuracy'] for r in mine])} / "
                    f"{_cell([r['tvd'] for r in mine])}" if mine else "-")
            ref = None if size is None else paper.regbench_cell(label, size)
            cells.append(cell if ref is None else f"{cell} ({ref[0]:.3f} / {ref[1]:.3f})")
        rows.append([label, *cells, _minutes(label, merged.get("seconds", {}))])
    for name, values in merged["baseline_values"].items():
        cell = f"{_cell(values['accuracy'])} / {_cell(values['tvd'])}"
        rows.append([name, *[cell] * len(sizes), "-"])
    return _markdown(header, rows)


def _minutes(label: str, seconds: dict[str, dict[str, list[float]]]) -> str:
    """Wall minutes of a model's jobs (mean over its jobs), per device when its jobs ran on
    more than one (``59.1 cpu / 6.0 cuda``)."""
    by_device = seconds.get(label)
    if not by_device:
        return "-"
    if len(by_device) == 1:
        return f"{np.mean(next(iter(by_device.values()))) / 60:.1f}"
    return " / ".join(f"{np.mean(v) / 60:.1f} {d}" for d, v in sorted(by_device.items()))


def _job_seconds(records: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Wall seconds of the jobs by label, then by the device they ran on."""
    seconds: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        device = str(rec.get("device", "cpu")).split(":")[0]
        seconds[rec["job"]["label"]][device].append(float(rec.get("seconds", 0.0)))
    return {label: dict(v) for label, v in seconds.items()}


def extrapolation_rows(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Merged extrapolation runs (one per job, with its seed) for the table and the plot."""
    runs = [{**run, "label": rec["job"]["label"], "seed": rec["job"]["seed"]}
            for rec in records for run in rec["results"]["runs"]]
    lengths = sorted({int(n) for rec in records for n in rec["results"]["lengths"]})
    return {"task": records[0]["job"]["task"], "lengths": lengths, "runs": runs,
            "seconds": _job_seconds(records)}


def extrapolation_markdown(merged: dict[str, Any], metric: str = "exact_match") -> str:
    """Exact match (or ``metric``, e.g. ``token_accuracy``) per model x test length (mean ±
    std over seeds), the paper's exact match in parentheses where it has one, and the wall
    minutes of each model's jobs."""
    header = ["model"] + [f"len {n}" for n in merged["lengths"]] + ["minutes"]
    rows = []
    for label in dict.fromkeys(r["label"] for r in merged["runs"]):
        mine = [r for r in merged["runs"] if r["label"] == label]
        cells = []
        for n in merged["lengths"]:
            values = [r[metric][str(n)] for r in mine if str(n) in r.get(metric, {})]
            cell = _cell(values) if values else "-"
            ref = (paper.extrapolation_cell(merged["task"], label, n)
                   if metric == "exact_match" else None)
            cells.append(cell if ref is None else f"{cell} ({ref:.2f})")
        rows.append([label, *cells, _minutes(label, merged.get("seconds", {}))])
    return _markdown(header, rows)


def curve_markdown(records: list[dict[str, Any]], points: int = 4) -> str:
    """Validation learning curves of extrapolation jobs, one row per job (model, seed): at
    ``points`` evaluations spread evenly over the longest run, ``minutes / validation loss /
    token accuracy / exact match`` on the validation samples (training lengths)."""
    runs = []
    for rec in records:
        for run in rec["results"]["runs"]:
            evals = [e for e in run.get("train", {}).get("history", []) if "val/loss" in e]
            if evals:
                runs.append((f"{rec['job']['label']} s{rec['job']['seed']}", evals))
    if not runs:
        return "no validation history in these results"
    last = max(e["step"] for _, evals in runs for e in evals)
    marks = sorted({max(1, round(last * (i + 1) / points)) for i in range(points)})
    rows = [[name, *(_curve_cell(evals, mark, last / (2 * points)) for mark in marks)]
            for name, evals in runs]
    return _markdown(["job"] + [f"step {m}" for m in marks], rows)


def _curve_cell(evals: list[dict[str, Any]], mark: int, slack: float) -> str:
    """The last evaluation at or before step ``mark``; "-" if there is none within ``slack``
    steps of it (the run stopped short of the mark)."""
    before = [e for e in evals if e["step"] <= mark]
    if not before or mark - before[-1]["step"] > slack:
        return "-"
    e = before[-1]
    return (f"{e.get('elapsed_s', 0.0) / 60:.1f} / {e['val/loss']:.3f} / "
            f"{e.get('val/token_accuracy', float('nan')):.3f} / "
            f"{e.get('val/exact_match', float('nan')):.3f}")


def summarize(out: str | Path, plot: bool = True) -> str:
    """Markdown tables (and figures) of every result under ``out``; written to
    ``<out>/summary.md`` and returned."""
    from . import plots

    out = Path(out)
    parts = []
    for (task, setting), records in _groups(load_results(out)).items():
        slug = f"{task}-{setting.replace('+', '-')}"
        steps = sorted({rec["results"]["runs"][0]["train"]["steps"] for rec in records
                        if rec["results"]["runs"] and "train" in rec["results"]["runs"][0]})
        title = f"## {task}, preset {setting} ({len(records)} jobs, steps {steps})"
        if task == "regbench":
            merged = regbench_rows(records)
            parts += [title, "accuracy / TVD on the test automata; mean ± std (seeds) when "
                      "several seeds", regbench_markdown(merged)]
            if plot:
                parts.append(f"![{slug}]({plots.plot_regbench(merged, out / f'{slug}.png').name})")
        else:
            merged = extrapolation_rows(records)
            parts += [title, "exact match (teacher-forced argmax) by test length; mean ± std "
                      "(seeds) when several seeds; the paper's in parentheses",
                      extrapolation_markdown(merged),
                      "token accuracy (teacher-forced) by test length",
                      extrapolation_markdown(merged, "token_accuracy"),
                      "validation curve: minutes / loss / token accuracy / exact match",
                      curve_markdown(records)]
            if plot:
                parts.append(f"![{slug}]"
                             f"({plots.plot_extrapolation(merged, out / f'{slug}.png').name})")
    failures = load_failures(out)
    if failures:
        parts.append("## failed jobs")
        parts += [f"- {f['job']['name']}: exit {f['status']}, log {f['log']}" for f in failures]
    text = "\n\n".join(parts) + "\n" if parts else "no results yet\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text)
    return text


def _child_main(argv: list[str] | None = None) -> int:
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


if __name__ == "__main__":
    sys.exit(_child_main())
