"""Evaluations on the live model every K steps (``TrainConfig.evals``): their rows in
metrics.jsonl, identical training losses with and without them, a failing one logs one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mosaics.errors import ConfigError
from mosaics.training.config import TrainConfig
from mosaics.training.evals import EvalSpec, Evaluation, parse_evals

TASKS = Path(__file__).parent / "data" / "lm_eval"


@pytest.fixture(scope="module")
def story_tokenizer():
    from mosaics.data.storygen import generate_stories
    from mosaics.data.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(generate_stories(60, seed=5), vocab_size=300)


class Windows:
    """Micro-batch i: 2 windows of 24 tokens of a fixed stream (a pure function of i)."""

    def __init__(self, stream: torch.Tensor) -> None:
        self.stream = stream

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        starts = torch.randint(0, len(self.stream) - 24, (2,), generator=g)
        ids = torch.stack([self.stream[s:s + 24] for s in starts.tolist()])
        return {"input_ids": ids, "labels": ids.clone()}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _fit(tmp: Path, tok, evals: dict, extra: list[Evaluation] = ()):
    from mosaics import MosaicsConfig, MosaicsForCausalLM
    from mosaics.data.storygen import generate_stories
    from mosaics.training.components import build_hooks
    from mosaics.training.eval_hook import EvalHook
    from mosaics.training.trainer import Trainer, make_accelerator

    cfg = TrainConfig(run_dir=str(tmp), max_steps=4, lr=3e-3, min_lr=3e-4, warmup_steps=1,
                      eval_interval=2, log_interval=1, checkpoint_interval=0, seed=3,
                      progress_bar=False, log_with="none", evals=evals, sample_tokens=6,
                      sample_prompt="Once upon")
    stream = torch.tensor(tok(" ".join(generate_stories(20, seed=1))).input_ids)
    torch.manual_seed(0)
    model = MosaicsForCausalLM(MosaicsConfig(
        vocab_size=len(tok), n_layer=1, n_embd=16, n_head=2, block_size=32, dropout=0.2,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    hooks = build_hooks(cfg, tok)
    if extra:
        hooks.append(EvalHook(list(extra)))
    val = [Windows(stream).batch(10_000 + i) for i in range(2)]
    trainer = Trainer(cfg, model, Windows(stream), val, hooks=hooks,
                      accelerator=make_accelerator(cfg, "cpu"))
    result = trainer.fit()
    trainer.close()
    rows = [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()]
    return result, rows, hooks


@pytest.fixture(scope="module")
def plain(tmp_path_factory, story_tokenizer):
    """The rows of the same run without evaluations."""
    return _fit(tmp_path_factory.mktemp("plain"), story_tokenizer, {})[1]


def _losses(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r] + \
        [(r["step"], r["val/loss"]) for r in rows if "val/loss" in r]


def test_parse_evals_shorthand_and_one_line_errors():
    specs = parse_evals({"sample": 5, "lm_eval": {"interval": 7, "budget_s": 9, "tasks": ["x"]}})
    assert [(s.name, s.interval, s.budget_s) for s in specs] == [("sample", 5, 60.0),
                                                                  ("lm_eval", 7, 9.0)]
    assert specs[1].options == {"tasks": ["x"]}
    with pytest.raises(ConfigError, match="unknown evaluation 'perplexity'; choose from"):
        TrainConfig(evals={"perplexity": 5})
    with pytest.raises(ConfigError, match="interval must be a positive number"):
        TrainConfig(evals={"sample": 0})
    with pytest.raises(ConfigError, match="unknown option.*tokns.*it takes"):
        TrainConfig(evals={"sample": {"interval": 2, "tokns": 3}})
    from mosaics.training.config import load_config

    assert load_config(overrides={"evals": "{recall: 3}"}).evals == {"recall": 3}


def test_evaluations_leave_training_losses_identical(tmp_path, story_tokenizer, plain):
    evals = {"position_loss": {"interval": 2, "buckets": 3}, "sample": 2,
             "recall": {"interval": 4, "prompts": 3},
             "needle": {"interval": 4, "prompts": 2, "lengths": [1, 2]}}
    result, rows, hooks = _fit(tmp_path / "evals", story_tokenizer, evals)
    assert _losses(rows) == _losses(plain)  # exactly: same RNG draws, same train mode
    evaluated = {r["step"]: r for r in rows if any(k.startswith("eval/") for k in r)}
    assert sorted(evaluated) == [2, 4]
    four = evaluated[4]
    names = ("pos01-08", "pos09-16", "pos17-23")  # 23 scored positions of a 24-token window
    assert {f"eval/position_loss/{k}" for k in names} <= four.keys()
    parts = [four[f"eval/position_loss/{k}"] for k in names]
    assert four["eval/position_loss/loss"] == pytest.approx((8 * parts[0] + 8 * parts[1]
                                                             + 7 * parts[2]) / 23)
    assert four["eval/sample/text"].startswith("Once upon")
    assert four["eval/recall/prompts_scored"] == 3.0
    assert 0.0 <= four["eval/recall/exact_match"] <= 1.0
    assert "eval/recall/exact_match" not in evaluated[2]
    for multiple in ("x1", "x2"):  # the needle probe at 1x and 2x the training length
        assert 0.0 <= four[f"eval/needle/{multiple}/exact_match"] <= 1.0
        assert 0.0 <= four[f"eval/needle/{multiple}/top1"] <= 1.0
    assert 0.0 < four["eval/needle/chance"] < 1.0
    # the position loss is the validation loss the trainer computes, split by position
    assert four["eval/position_loss/loss"] == pytest.approx(
        next(r["val/loss"] for r in rows if r["step"] == 4 and "val/loss" in r), rel=1e-5)
    assert any("eval/sample/text" in h for h in result.history)


class Broken(Evaluation):
    def run(self, model, deadline, trainer):
        raise RuntimeError("no such file: probe.json\nsecond line")


def test_failing_evaluation_logs_one_line_and_training_goes_on(tmp_path, story_tokenizer,
                                                                  capsys, plain):
    capsys.readouterr()
    result, rows, hooks = _fit(tmp_path / "broken", story_tokenizer, {"sample": 2},
                               [Broken(EvalSpec("broken", 2))])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "evaluation broken" in line]
    assert lines == ["warning: evaluation broken at step 2 failed: RuntimeError: no such file: "
                     "probe.json; training goes on",
                     "warning: evaluation broken at step 4 failed: RuntimeError: no such file: "
                     "probe.json; training goes on"]
    assert result.steps == 4 and _losses(rows) == _losses(plain)
    assert any("eval/sample/text" in r for r in rows)  # the others still ran


def test_time_budget_stops_an_evaluation_early(tmp_path, story_tokenizer):
    _, rows, _ = _fit(tmp_path / "budget", story_tokenizer,
                      {"recall": {"interval": 4, "prompts": 50, "budget_s": 1e-9}})
    (row,) = [r for r in rows if "eval/recall/prompts_scored" in r]
    assert row["eval/recall/prompts_scored"] == 0.0


@pytest.mark.integration
def test_lm_eval_tasks_on_the_live_model(tmp_path, story_tokenizer, monkeypatch, plain):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    evals = {"lm_eval": {"interval": 4, "tasks": ["mosaics_toy_choice"], "limit": 4,
                         "include_path": str(TASKS), "budget_s": 300}}
    _, rows, hooks = _fit(tmp_path / "lm", story_tokenizer, evals)
    assert not hooks[0].failures
    (row,) = [r for r in rows if "eval/lm_eval/mosaics_toy_choice/acc" in r]
    assert 0.0 <= row["eval/lm_eval/mosaics_toy_choice/acc"] <= 1.0
    assert _losses(rows) == _losses(plain)


@pytest.mark.integration
def test_evaluations_on_two_gloo_ranks_do_not_deadlock(tmp_path):
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    settings = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2, max_steps=4,
                    num_train_stories=200, vocab_size=300, eval_interval=2, eval_windows=4,
                    eval_batch_size=2, log_interval=1, checkpoint_interval=2,
                    progress_bar=False, sample_tokens=0, save_final=False,
                    data_cache_dir=str(tmp_path / "cache"), run_dir=str(run_dir),
                    evals="{position_loss: 2, sample: {interval: 2, tokens: 4}, "
                          "recall: {interval: 4, prompts: 2}}")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="0")
    done = subprocess.run([sys.executable, "-m", "mosaics", "train", "--nproc", "2",
                           *(f"{k}={v}" for k, v in settings.items())], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    four = {k: v for r in rows if r["step"] == 4 for k, v in r.items()}
    assert four["eval/position_loss/loss"] == pytest.approx(four["val/loss"], rel=1e-5)
    assert "eval/sample/text" in four and four["eval/recall/prompts_scored"] == 2.0


def test_probes_without_their_corpus_are_skipped_with_one_line(tmp_path, story_tokenizer,
                                                                capsys):
    from mosaics.training.components import build_evaluations

    text = tmp_path / "plain.txt"
    text.write_text("One document.\n\nAnother document.\n")
    cfg = TrainConfig(data_source=str(text), evals={"recall": 2, "needle": 2, "sample": 2})
    names = [e.spec.name for e in build_evaluations(cfg, story_tokenizer)]
    assert names == ["sample"]
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("evals.")]
    assert len(err) == 2 and "recall" in err[0] and "validation split" in err[1]
