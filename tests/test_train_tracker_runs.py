"""One tracker run per training run: the W&B / MLflow run ids are saved in the run folder and
reopened after a kill, and the run then holds every step once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mosaics.training.config import TrainConfig
from mosaics.training.trainer import Hook
from tests.test_trackers import RandomTokens


class Killed(Exception):
    pass


class KillAt(Hook):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, step, metrics) -> None:
        if step == self.step:
            raise Killed


def _run(run_dir: Path, log_with: str, kill_at: int | None = None):
    from mosaics import MosaicsConfig, MosaicsForCausalLM
    from mosaics.training.trainer import Trainer, make_accelerator

    cfg = TrainConfig(run_dir=str(run_dir), max_steps=6, lr=2e-3, min_lr=2e-4, warmup_steps=1,
                      eval_interval=0, log_interval=1, checkpoint_interval=2,
                      progress_bar=False, log_with=log_with)
    torch.manual_seed(0)
    model = MosaicsForCausalLM(MosaicsConfig(vocab_size=32, n_layer=1, n_embd=16, n_head=2,
                                             block_size=16))
    hooks = [KillAt(kill_at)] if kill_at else []
    trainer = Trainer(cfg, model, RandomTokens(), [], hooks=hooks,
                      accelerator=make_accelerator(cfg, "cpu"))
    try:
        trainer.fit()
    except Killed:  # the process dies here: its trackers are never finished
        return None
    trainer.close()
    return trainer


def _jsonl(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_mlflow_run_reopened_after_a_kill_holds_every_step_once(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = tmp_path / "run"
    try:
        _run(run_dir, "mlflow", kill_at=5)
        first = json.loads((run_dir / "tracker_runs.json").read_text())["mlflow"]
        mlflow.end_run()  # what the killed process's exit does
        _run(run_dir, "mlflow")
        uri = mlflow.get_tracking_uri()
    finally:
        mlflow.end_run()
        mlflow.set_tracking_uri("")
    assert json.loads((run_dir / "tracker_runs.json").read_text()) == {"mlflow": first}
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("mosaics").experiment_id])
    assert run.info.run_id == first
    points = client.get_metric_history(first, "train/loss")
    steps = sorted(p.step for p in points)
    assert steps == [1, 2, 3, 4, 5, 6]  # steps 5 of the killed attempt not sent twice
    assert {p.step: p.value for p in points} == pytest.approx(_jsonl(run_dir))


def test_fresh_run_gets_a_new_id(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    try:
        _run(tmp_path / "a", "mlflow")
        _run(tmp_path / "b", "mlflow")
    finally:
        mlflow.set_tracking_uri("")
    a = json.loads((tmp_path / "a" / "tracker_runs.json").read_text())["mlflow"]
    b = json.loads((tmp_path / "b" / "tracker_runs.json").read_text())["mlflow"]
    assert a != b


@pytest.mark.integration
def test_wandb_offline_run_reopened_after_a_kill(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import wandb

    from tests.test_trackers import _wandb_records

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    _run(run_dir, "wandb", kill_at=5)
    first = json.loads((run_dir / "tracker_runs.json").read_text())["wandb"]
    wandb.finish()  # what the killed process's exit leaves: the records written so far
    _run(run_dir, "wandb")
    assert json.loads((run_dir / "tracker_runs.json").read_text()) == {"wandb": first}
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{first}.wandb" for f in files)
    history: list[tuple[int, float]] = []
    for path in files:  # `wandb sync` uploads both into run `first`
        for record in _wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                if "train/loss" in items:
                    history.append((items["_step"], items["train/loss"]))
    assert sorted(s for s, _ in history) == [1, 2, 3, 4, 5, 6]
    assert dict(history) == pytest.approx(_jsonl(run_dir))
