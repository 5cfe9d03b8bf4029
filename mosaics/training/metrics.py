"""Training metrics: ``<run_dir>/metrics.jsonl`` (one JSON object per line, always) and the
trackers of ``TrainConfig.log_with`` through accelerate (``Accelerator(log_with=...)``,
``init_trackers`` with the run's config, ``accelerator.log``).

Where each tracker writes (``project`` is ``mosaics``):

- ``tensorboard``: ``<run_dir>/tb/mosaics`` (``tensorboard --logdir <run_dir>/tb``);
- ``wandb``: project ``mosaics``, run name = the run folder's name, files under ``<run_dir>``
  (``WANDB_MODE=offline`` keeps them local; ``wandb sync`` uploads later);
- ``mlflow``: experiment ``mosaics`` (or ``MLFLOW_EXPERIMENT_NAME``) at ``MLFLOW_TRACKING_URI``;
  when that is unset, a store inside the run: ``sqlite:///<run_dir>/mlflow.db`` if SQLAlchemy is
  installed, else the file store ``<run_dir>/mlruns`` (``mlflow-skinny`` has no SQLAlchemy).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

PROJECT = "mosaics"
_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow",
            "comet_ml": "comet_ml", "aim": "aim", "clearml": "clearml", "dvclive": "dvclive",
            "swanlab": "swanlab", "trackio": "trackio"}


def tracker_names(log_with: str | list[str] | tuple[str, ...] | None,
                  tensorboard: bool = True) -> list[str]:
    """The trackers of ``log_with`` (a name, comma-separated names, a list, or None/"none"),
    checked against accelerate's; ``tensorboard=False`` drops TensorBoard."""
    if log_with is None:
        return []
    items = log_with.split(",") if isinstance(log_with, str) else list(log_with)
    names = [str(n).strip().lower() for n in items if str(n).strip()]
    names = [n for n in names if n != "none"]
    unknown = [n for n in names if n not in _MODULES]
    if unknown:
        raise ConfigError(f"log_with: unknown tracker(s) {', '.join(unknown)}; choose from "
                          f"{', '.join(_MODULES)} (or none)")
    names = list(dict.fromkeys(names))
    return [n for n in names if tensorboard or n != "tensorboard"]


def check_installed(names: list[str]) -> None:
    """Raise ``ConfigError`` naming the install command of any tracker that is missing."""
    import importlib.util

    for name in names:
        module = "torch.utils.tensorboard" if name == "tensorboard" else _MODULES[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            extra = "pip install 'mosaics[trackers]'" if name in ("wandb", "mlflow") \
                else f"pip install {name}"
            raise ConfigError(f"log_with includes {name!r} but {module} is not installed: "
                              f"{extra}, or drop it from log_with")


def flat_config(config: Any) -> dict[str, bool | int | float | str]:
    """The run's config as scalars every tracker accepts (lists / dicts as JSON, None as
    "null")."""
    values = asdict(config) if is_dataclass(config) else dict(config)
    flat: dict[str, bool | int | float | str] = {}
    for key, value in values.items():
        if isinstance(value, (bool, int, float, str)):
            flat[key] = value
        else:
            flat[key] = json.dumps(value, default=str)
    return flat


def _mlflow_store(run_dir: Path) -> None:
    """Point MLflow at a store inside the run unless ``MLFLOW_TRACKING_URI`` says where."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return
    import importlib.util

    import mlflow

    if importlib.util.find_spec("sqlalchemy") is not None:
        mlflow.set_tracking_uri(f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    else:  # mlflow-skinny: the file store, which MLflow 3 only opens on request
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri((run_dir.resolve() / "mlruns").as_uri())


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (as :class:`MetricsLog` writes them), in file order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class MetricsLog:
    """Writes on the main process only; a resumed run first drops rows past its start step.

    ``accelerator`` (optional) carries the trackers of ``log_with``; they are started here
    with ``config`` and finished by :meth:`close`."""

    def __init__(self, run_dir: Path, enabled: bool, start_step: int,
                 accelerator: Any = None, config: Any = None) -> None:
        self.enabled = enabled
        self.accelerator = accelerator
        self.path = run_dir / "metrics.jsonl"
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.tracked_through = -1  # steps the trackers hold from an earlier attempt
        self.reopened: set[str] = set()  # trackers that reopened that attempt's run
        if self.path.exists():
            rows = [r for r in self.path.read_text().splitlines() if r.strip()]
            steps = [json.loads(r)["step"] for r in rows]
            self.tracked_through = max(steps, default=-1)
            rows = [r for r, s in zip(rows, steps) if s <= start_step]
            self.path.write_text("".join(r + "\n" for r in rows))
        names = [str(t) for t in getattr(accelerator, "log_with", None) or []]
        if not names:
            self.accelerator = None
            return
        if "mlflow" in names:
            _mlflow_store(run_dir)
        from . import tracker_runs

        ids = tracker_runs.load_ids(run_dir) if start_step else {}
        kwargs = tracker_runs.init_kwargs(run_dir, ids)
        if start_step:
            kwargs["tensorboard"] = {"purge_step": start_step}
        accelerator.init_trackers(PROJECT, init_kwargs=kwargs)
        tracker_runs.save_ids(run_dir, accelerator.trackers)
        self.reopened = set(ids) & set(names)
        if config:
            tracker_runs.store_config(accelerator.trackers, flat_config(config), bool(ids))

    def log(self, step: int, values: dict[str, float]) -> None:
        """A row to metrics.jsonl and the trackers; a tracker that reopened an earlier
        attempt's run only gets the steps it lacks (TensorBoard purges them instead)."""
        if not self.enabled:
            return
        if self.accelerator is not None:
            for tracker in self.accelerator.trackers:
                if tracker.name not in self.reopened or step > self.tracked_through:
                    tracker.log(values, step=step)
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")

    def close(self) -> None:
        """Finish the trackers (flushes TensorBoard, ends the W&B and MLflow runs)."""
        if self.accelerator is not None:
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self.accelerator.trackers.clear()
            self.accelerator = None


def log_row(trainer: Any, step: int, values: dict[str, Any], history: bool = True) -> None:
    """A row of a hook's values at ``step``: metrics.jsonl and the trackers (main process),
    and ``trainer.history`` (so a resumed run keeps it) unless ``history=False``."""
    if history:
        trainer.history.append({"step": step, **values})
    if trainer.metrics is not None:
        trainer.metrics.log(step, values)
