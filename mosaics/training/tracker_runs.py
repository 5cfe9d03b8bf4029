"""One tracker run per training run: the W&B and MLflow run ids live in
``<run_dir>/tracker_runs.json`` and a resumed run (requeue, kill + resume) reopens them
(W&B ``id=..., resume="allow"``; MLflow ``run_id``), so one run holds every step once."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FILE = "tracker_runs.json"


def load_ids(run_dir: Path) -> dict[str, str]:
    """{tracker: run id} saved by an earlier attempt of this run ({} if none)."""
    path = run_dir / FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: str(v) for k, v in data.items() if isinstance(v, str)}


def save_ids(run_dir: Path, trackers: list[Any]) -> dict[str, str]:
    """Write the ids of the started ``trackers`` (atomically); returns them."""
    ids = load_ids(run_dir)
    for tracker in trackers:
        run_id = tracker_run_id(tracker)
        if run_id is not None:
            ids[tracker.name] = run_id
    tmp = run_dir / f".tmp-{FILE}"
    tmp.write_text(json.dumps(ids, indent=1) + "\n")
    os.replace(tmp, run_dir / FILE)
    return ids


def tracker_run_id(tracker: Any) -> str | None:
    """The run id of an accelerate tracker (W&B, MLflow), else None."""
    if tracker.name == "wandb" and getattr(tracker, "run", None) is not None:
        return str(tracker.run.id)
    if tracker.name == "mlflow" and getattr(tracker, "active_run", None) is not None:
        return str(tracker.active_run.info.run_id)
    return None


def init_kwargs(run_dir: Path, ids: dict[str, str]) -> dict[str, dict[str, Any]]:
    """accelerate ``init_trackers`` keyword arguments: names, folders and saved ids."""
    wandb: dict[str, Any] = {"name": run_dir.name, "dir": str(run_dir)}
    mlflow: dict[str, Any] = {"run_name": run_dir.name}
    if "wandb" in ids:
        wandb.update(id=ids["wandb"], resume="allow")
    if "mlflow" in ids:
        mlflow["run_id"] = ids["mlflow"]
    return {"wandb": wandb, "mlflow": mlflow}


def store_config(trackers: list[Any], config: dict[str, Any], resumed: bool) -> None:
    """The run's config on each tracker; a reopened MLflow run keeps its parameters (MLflow
    refuses to change one) and gets only those it lacks."""
    for tracker in trackers:
        if tracker.name == "mlflow" and resumed:
            import mlflow

            have = mlflow.get_run(tracker.active_run.info.run_id).data.params
            new = {k: v for k, v in config.items() if k not in have}
            if new:
                tracker.store_init_configuration(new)
        else:
            tracker.store_init_configuration(config)
