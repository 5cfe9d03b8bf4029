"""Weighted multi-source data (``data_source: {source: weight}``): each window's source is a
pure function of (seed, step), the global batch is the same on any process count, one
tokenizer, a validation loss per source, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mosaics.data.mixture import MixtureBatches, parse_mixture, source_names
from mosaics.errors import ConfigError, DataError, InputError
from mosaics.training.config import TrainConfig, load_config

A = np.arange(0, 100, dtype=np.uint16)  # stream "a": ids 0..99
B = np.arange(100, 400, dtype=np.uint16)  # stream "b": ids 100..399


def _batches(**kw) -> MixtureBatches:
    args = dict(block_size=8, batch_size=4, seed=7, names=["a", "b"])
    args.update(kw)
    return MixtureBatches([A, B], [3.0, 1.0], **args)


def test_weights_parse_and_one_line_errors():
    assert parse_mixture({"a.txt": 3, "b": 1}) == {"a.txt": 3.0, "b": 1.0}
    assert parse_mixture("plain.txt") is None and parse_mixture(None) is None
    assert load_config(overrides={"data_source": "{a.txt: 3, b.txt: 1}"}).data_source == \
        {"a.txt": 3.0, "b.txt": 1.0}
    for bad, match in [({"a": -1}, "weight of 'a' must be a number >= 0"),
                       ({"a": "x"}, "weight of 'a' must be a number >= 0"),
                       ({"a": 0, "b": 0}, "weights sum to 0"),
                       ({}, "empty mapping"),
                       ("{a: [1", "not a readable mapping")]:
        with pytest.raises(ConfigError, match=match) as info:
            TrainConfig(data_source=bad)
        assert "\n" not in str(info.value)
    assert source_names(["/d/x.txt", "/e/x.jsonl", "org/data"]) == ["x", "x-2", "data"]


def test_source_and_window_a_pure_function_of_seed_and_step():
    one, other = _batches(), _batches()
    for index in (0, 5, 123):
        assert torch.equal(one.batch(index)["input_ids"], other.batch(index)["input_ids"])
    assert not torch.equal(one.batch(0)["input_ids"], one.batch(1)["input_ids"])
    assert not torch.equal(one.batch(0)["input_ids"], _batches(seed=8).batch(0)["input_ids"])
    for index in range(50):  # every window lies in the source drawn for it
        ids, sources = one.batch(index)["input_ids"], one.sources(index)
        for row, source in zip(ids, sources):
            lo, hi = (0, 100) if source == 0 else (100, 400)
            assert lo <= int(row.min()) and int(row.max()) < hi
            assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 8))


def test_global_batch_same_on_any_process_count():
    single = _batches(batch_size=8, accumulation=2)
    ranks = [_batches(batch_size=4, rank=r, world_size=2, accumulation=2) for r in range(2)]
    for step in range(3):
        whole = torch.cat([single.batch(2 * step + k)["input_ids"] for k in range(2)])
        split = torch.cat([ranks[r].batch(2 * step + k)["input_ids"] for k in range(2)
                           for r in range(2)])
        assert torch.equal(whole, split)
    ranks[0].load_state_dict(single.state_dict())  # same global batch: resumable


def test_shares_follow_the_weights_and_resume_checks_them():
    batches = _batches(batch_size=16)
    drawn = np.concatenate([batches.sources(i) for i in range(400)])
    assert abs(drawn.mean() - 0.25) < 0.02  # b has weight 1 of 4
    zero = MixtureBatches([A, B], [1.0, 0.0], block_size=8, batch_size=16)
    assert all((zero.sources(i) == 0).all() for i in range(20))
    other = MixtureBatches([A, B], [1.0, 1.0], block_size=8, batch_size=4, seed=7,
                           names=["a", "b"])
    with pytest.raises(DataError, match="weights=.*same data_source mixture"):
        other.load_state_dict(_batches().state_dict())
    with pytest.raises(DataError, match="'b'.*shorter than block_size"):
        MixtureBatches([A, B[:5]], [1, 1], block_size=8, names=["a", "b"])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from mosaics.data.storygen import generate_stories, write_story_file

    root = tmp_path_factory.mktemp("mixture")
    write_story_file(root / "tales.txt", generate_stories(120, seed=1))
    write_story_file(root / "fables.txt", generate_stories(40, seed=2))
    return root


TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2, vocab_size=300,
            eval_interval=2, eval_windows=4, eval_batch_size=4, log_interval=1,
            checkpoint_interval=2, progress_bar=False, sample_tokens=0, save_final=False,
            log_with="none", schedule_steps=4, warmup_steps=1)


def _train(run_dir: Path, data: dict, **settings):
    from mosaics.training import train

    cfg = load_config(None, dict(TINY, run_dir=str(run_dir), data_cache_dir=str(run_dir.parent
                                                                             / "cache"),
                                 data_source=json.dumps(data), **settings))
    train(cfg)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mixture_trains_with_a_loss_per_source_and_print_config(tmp_path, sources, capsys):
    from mosaics.cli import train_main

    data = {str(sources / "tales.txt"): 3, str(sources / "fables.txt"): 1}
    assert train_main(["--print-config", f"data_source={json.dumps(data)}"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data_source"] == {k: float(v) for k, v in data.items()}
    rows = _train(tmp_path / "run", data, max_steps=2)
    assert "data: tales 75.0%, fables 25.0%" in capsys.readouterr().err
    (row,) = [r for r in rows if "eval/source_loss/tales" in r]
    assert row["step"] == 2 and 0 < row["eval/source_loss/fables"] < 10
    assert any("val/loss" in r for r in rows)


def test_missing_source_is_one_line(tmp_path, sources):
    data = {str(sources / "tales.txt"): 1, str(tmp_path / "nowhere.txt"): 1}
    with pytest.raises(InputError, match="nowhere.txt") as info:
        _train(tmp_path / "run", data, max_steps=1)
    assert "\n" not in str(info.value)


@pytest.mark.integration
def test_mixture_resume_is_exact(tmp_path, sources):
    data = {str(sources / "tales.txt"): 3, str(sources / "fables.txt"): 1}
    straight = _train(tmp_path / "straight", data, max_steps=4)
    _train(tmp_path / "resumed", data, max_steps=2)
    resumed = _train(tmp_path / "resumed", data, max_steps=4)

    def losses(rows):
        return [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]

    assert losses(resumed) == losses(straight) and len(losses(straight)) == 4


@pytest.mark.integration
def test_mixture_resume_on_two_processes_matches(tmp_path, sources):
    """Two steps on one process, then resumed on two gloo ranks (batch 1 each: the same global
    batch): the losses of the straight one-process run, to float tolerance."""
    import os
    import subprocess
    import sys

    data = {str(sources / "tales.txt"): 3, str(sources / "fables.txt"): 1}
    straight = _train(tmp_path / "straight", data, max_steps=4)
    _train(tmp_path / "moved", data, max_steps=2)
    settings = dict(TINY, run_dir=str(tmp_path / "moved"), max_steps=4, batch_size=1,
                    data_cache_dir=str(tmp_path / "cache"), data_source=json.dumps(data))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="0")
    done = subprocess.run([sys.executable, "-m", "mosaics", "train", "--nproc", "2",
                           *(f"{k}={v}" for k, v in settings.items())], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "on 2 process(es), written by 1" in done.stderr, \
        done.stderr[-3000:]
    moved = [json.loads(x) for x in (tmp_path / "moved" / "metrics.jsonl").read_text()
             .splitlines()]

    def losses(rows):
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    assert losses(moved).keys() == losses(straight).keys() == {1, 2, 3, 4}
    for step, value in losses(straight).items():
        assert losses(moved)[step] == pytest.approx(value, abs=1e-4, rel=0), step
