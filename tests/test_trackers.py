"""``TrainConfig.log_with``: metrics through accelerate's trackers, read back from what each
tracker wrote (TensorBoard events, an MLflow store, a W&B offline run) and compared with
``metrics.jsonl``."""

import json
import struct
from pathlib import Path

import pytest
import torch

from mosaics.errors import ConfigError
from mosaics.training.config import TrainConfig
from mosaics.training.metrics import check_installed, flat_config, tracker_names


class RandomTokens:
    """Micro-batch i: 2 windows of 16 random ids (a pure function of i)."""

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _train(run_dir: Path, log_with) -> TrainConfig:
    from mosaics import MosaicsConfig, MosaicsForCausalLM
    from mosaics.training.trainer import Trainer, make_accelerator

    cfg = TrainConfig(run_dir=str(run_dir), max_steps=4, lr=2e-3, min_lr=2e-4, warmup_steps=1,
                      eval_interval=2, log_interval=1, checkpoint_interval=0,
                      progress_bar=False, log_with=log_with)
    torch.manual_seed(0)
    model = MosaicsForCausalLM(MosaicsConfig(vocab_size=32, n_layer=1, n_embd=16, n_head=2,
                                             block_size=16))
    val = [RandomTokens().batch(1000)]
    trainer = Trainer(cfg, model, RandomTokens(), val, accelerator=make_accelerator(cfg, "cpu"))
    trainer.fit()
    trainer.close()
    return cfg


def _jsonl(run_dir: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def test_log_with_names_and_errors():
    assert tracker_names("tensorboard") == ["tensorboard"]
    assert tracker_names("wandb, MLflow,wandb") == ["wandb", "mlflow"]
    assert tracker_names(["tensorboard", "wandb"], tensorboard=False) == ["wandb"]
    assert tracker_names(None) == tracker_names("none") == tracker_names([]) == []
    with pytest.raises(ConfigError, match="unknown tracker.*tensorbord.*choose from"):
        TrainConfig(log_with="tensorbord")
    with pytest.raises(ConfigError, match="comet_ml is not installed: pip install comet_ml"):
        check_installed(["comet_ml"])
    flat = flat_config(TrainConfig(model_kwargs={"a": [1, 2]}, time_budget_s=None))
    assert flat["model_kwargs"] == '{"a": [1, 2]}' and flat["time_budget_s"] == "null"
    assert flat["lr"] == TrainConfig().lr and flat["log_with"] == "tensorboard"


def test_tensorboard_events_and_config_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    _train(run_dir, "tensorboard")
    events = EventAccumulator(str(run_dir / "tb" / "mosaics"))
    events.Reload()
    for key in ("train/loss", "lr", "val/loss"):
        logged = {e.step: e.value for e in events.Scalars(key)}
        expected = _jsonl(run_dir, key)
        assert logged.keys() == expected.keys() and len(logged) >= 2
        assert logged == pytest.approx(expected, rel=1e-6)  # float32 in the event file
    (hparams,) = (run_dir / "tb" / "mosaics").glob("*/hparams.yml")
    assert "lr: 0.002" in hparams.read_text() and "max_steps: 4" in hparams.read_text()


def test_tensorboard_false_and_no_run_dir_log_nothing_but_jsonl(tmp_path):
    cfg = TrainConfig(run_dir=str(tmp_path / "quiet"), tensorboard=False)
    from mosaics.training.trainer import make_accelerator

    assert make_accelerator(cfg, "cpu").log_with == []
    _train(tmp_path / "none", "none")
    assert (tmp_path / "none" / "metrics.jsonl").is_file()
    assert not (tmp_path / "none" / "tb").exists()


def test_mlflow_store_in_the_run_read_back(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # restored after the test
    run_dir = tmp_path / "run"
    try:
        _train(run_dir, ["mlflow"])
        uri = mlflow.get_tracking_uri()
    finally:
        mlflow.set_tracking_uri("")
    assert str(run_dir.resolve()) in uri  # the store lives inside the run folder
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("mosaics")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.data.params["lr"] == "0.002"
    assert run.data.params["log_with"] == '["mlflow"]'
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert history == pytest.approx(_jsonl(run_dir, "train/loss"))
    assert not (run_dir / "tb").exists()


def _wandb_records(path: Path):
    """The protobuf records of a W&B run file (blocks of 32 KiB after a 7-byte file header;
    each chunk: crc32 (4 bytes), length (2), type (1: full, 2: first, 3: middle, 4: last))."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunks = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == kind == 0:
            pos += block - pos % block
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


@pytest.mark.integration
def test_wandb_offline_run_read_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    _train(run_dir, "wandb,tensorboard")
    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    config, history = {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            assert (record.run.project, record.run.display_name) == ("mosaics", "run")
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}  # "train/loss" is stored as a nested key
            if "train/loss" in items:
                history[items["_step"]] = items["train/loss"]
    assert config["lr"] == 0.002 and config["max_steps"] == 4
    assert history == pytest.approx(_jsonl(run_dir, "train/loss"))
    assert list((run_dir / "tb" / "mosaics").glob("events.out.tfevents.*"))
