"""Sweep jobs: what one job is, how a grid, a job file or the paper's suite expands into jobs,
and where a job's files live under a sweep's output folder.

A job is one (task, model, seed, size) under a preset with overrides, or the scoring of a
saved model. Under ``<out>``: ``results/<name>.json`` (its result record, written
atomically: a job with one is done), ``failed/<name>.json`` (the record of its last failed
attempt), ``logs/<name>.log`` and ``jobs/<name>/`` (its work folder: runs, checkpoints,
saved models).

Like :mod:`mosaics.evaluation.protocols`, this module does not import torch: jobs are
defined, listed and checked without the training stack (the kernel registry is read only
when a job names a kernel).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .models import MOSAICS_ARCHS, check_config_changes, is_mosaics, saved_label
from .protocols import ALL_TASKS, MODEL_OVERRIDES, TASKS, presets, task_overrides

BASELINE_ARCHS = ("gpt2", "llama")


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
        changes = (self.overrides.get("train") or {}).get("model_kwargs") or {}
        if changes:  # a pretraining job's model changes (an ablation)
            label += " " + ",".join(f"{k}={v}" for k, v in sorted(changes.items()))
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


def _check_preset(task: str, preset: str) -> None:
    if preset not in presets(task):
        raise ValueError(f"unknown {task} preset {preset!r}; choose from "
                         f"{', '.join(presets(task))}")


def make_job(task: str, model: str, seed: int = 0, size: int | None = None,
             preset: str = "reference", overrides: dict[str, Any] | None = None,
             kernel_kwargs: dict[str, Any] | None = None, model_dir: str | None = None,
             config_changes: dict[str, Any] | None = None) -> Job:
    """A checked :class:`Job` (known task, model, kernel, preset and settings); with
    ``model_dir`` a job that scores that saved model directory (``model`` is ignored), after
    the ``config_changes`` to its config (fields of its config.json)."""
    if task not in ALL_TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(ALL_TASKS)}")
    if model_dir is not None:
        path = Path(model_dir).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise ValueError(f"{model_dir}: not a saved model directory (no config.json); pass "
                             "a folder written by save_pretrained")
        _check_preset(task, preset)
        check_config_changes(path, config_changes or {})
        return Job(task, "saved", int(seed), None, preset,
                   task_overrides(task, dict(overrides or {})), {}, str(path),
                   dict(config_changes or {}))
    if config_changes:
        raise ValueError("model config changes apply to a saved model directory only; to train "
                         "a model with another setting use the protocol override (e.g. "
                         "--set alibi=true) or the kernel arguments")
    model = normalize_model(model)
    kernel = model.split("/", 1)[1] if "/" in model else None
    if kernel is not None:
        from mosaics import available_kernels  # the registry (imports the model code)

        if kernel not in available_kernels():
            raise ValueError(f"unknown kernel {kernel!r}; registered kernels: "
                             f"{', '.join(available_kernels())}")
    if task in ("sort", "mqmtar") and model == "gpt2":
        raise ValueError("gpt2 cannot be scored past its learned position table; the "
                         "extrapolation baseline is llama")
    _check_preset(task, preset)
    if task == "regbench" and size is None:
        raise ValueError("a regbench job needs a size (training automata)")
    return Job(task, model, int(seed), size if task == "regbench" else None, preset,
               task_overrides(task, dict(overrides or {})), dict(kernel_kwargs or {}))


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
        if task in ("sort", "mqmtar") and normalize_model(model) == "gpt2":
            notes.append(f"{task} x gpt2 left out: learned positions cannot extrapolate "
                         "(llama is the transformer baseline there)")
            continue
        for size in sizes if task == "regbench" else [None]:
            job = make_job(task, model, seed, size, preset, overrides, kernel_kwargs)
            jobs.setdefault(job.name, job)
    return list(jobs.values()), list(dict.fromkeys(notes))


def saved_model_jobs(tasks: Iterable[str], model_dirs: Iterable[str],
                     seeds: Iterable[int] = (0,), preset: str = "reference",
                     overrides: dict[str, Any] | None = None,
                     config_changes: dict[str, Any] | None = None) -> list[Job]:
    """One scoring job per task x saved model directory x seed (the seed draws the test
    data), each after the ``config_changes`` to the saved config."""
    return [make_job(task, "saved", seed, None, preset, overrides, model_dir=d,
                     config_changes=config_changes)
            for task, d, seed in itertools.product(tasks, model_dirs, seeds)]


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


# --- a job's files under <out> -------------------------------------------------------------

def result_path(out: Path, job: Job) -> Path:
    return Path(out) / "results" / f"{job.name}.json"


def failure_path(out: Path, job: Job) -> Path:
    return Path(out) / "failed" / f"{job.name}.json"


def log_path(out: Path, job: Job) -> Path:
    return Path(out) / "logs" / f"{job.name}.log"


def job_record(job: Job) -> dict[str, Any]:
    """The ``job`` entry of a result or failure record: its fields, name, label and setting."""
    return {**asdict(job), "name": job.name, "label": job.label, "setting": job.setting}


def write_json(path: str | Path, obj: Any) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=float))
    tmp.replace(path)
