"""lm-evaluation-harness runs a saved model as a Hugging Face model (``--model hf``,
``trust_remote_code=True``): local multiple-choice and ``generate_until`` tasks (tests/data/
lm_eval) give the same scores, and the same answers request by request, at batch size 1 and
8 (loglikelihood batches are right-padded by lm-eval, generation batches left-padded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.data.tokenizer import train_bpe_tokenizer
from mosaics.evaluation.cli import build_parser

TASKS = Path(__file__).parent / "data" / "lm_eval"
NAMES = ["mosaics_toy_choice", "mosaics_toy_answer"]


def _texts() -> list[str]:
    """Each question with its answer, the tiny model's training text."""
    texts = []
    for name in ("toy_choice.jsonl", "toy_answer.jsonl"):
        for line in (TASKS / name).read_text().splitlines():
            d = json.loads(line)
            answer = d["choices"][d["answer"]] if "choices" in d else d["answer"]
            texts.append(f"{d['question']} {answer}.")
    return texts


def _save_model(out: Path, **options) -> None:
    """A tokenizer and a small model trained 40 steps on the tasks' text (partly right, so
    the scores are neither 0 nor 1 everywhere), saved as the project saves models."""
    texts = _texts()
    tok = train_bpe_tokenizer(texts * 4, vocab_size=400)
    torch.manual_seed(0)
    config = MosaicsConfig(vocab_size=len(tok), n_layer=2, n_head=4, n_embd=64, dropout=0.0,
                           block_size=64, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, **options)
    model = MosaicsForCausalLM(config)
    batch = tok(texts, padding=True, return_tensors="pt")
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(40):
        loss = model(batch.input_ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)


def test_eval_help_points_to_lm_evaluation_harness():
    text = build_parser().format_help()
    assert "lm_eval --model hf" in text and "trust_remote_code=True" in text


@pytest.mark.integration
@pytest.mark.parametrize("options", [dict(), dict(gated_keys=True, adaptive_bandwidth=True,
                                                  three_level_memory=True, short_term_window=8,
                                                  long_term_gap=4)],
                         ids=["v1", "v2"])
def test_lm_eval_scores_agree_at_batch_1_and_8(tmp_path, monkeypatch, options):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is part of the dev extra")
    from lm_eval.tasks import TaskManager

    _save_model(tmp_path / "model", **options)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(TASKS)  # the task files name their data relative to their folder
    tasks = TaskManager(include_path=str(TASKS), include_defaults=False)  # the local ones only
    runs = {}
    for batch_size in (1, 8):
        runs[batch_size] = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={tmp_path / 'model'},trust_remote_code=True",
            tasks=NAMES, task_manager=tasks,
            batch_size=batch_size, device="cpu", log_samples=True)
    one, eight = runs[1], runs[8]
    acc = one["results"]["mosaics_toy_choice"]["acc,none"]
    match = one["results"]["mosaics_toy_answer"]["exact_match,none"]
    assert eight["results"]["mosaics_toy_choice"]["acc,none"] == acc
    assert eight["results"]["mosaics_toy_answer"]["exact_match,none"] == match
    assert match > 0 and acc > 0.25  # scores that say something (chance: 0.25)
    for name in NAMES:  # request by request
        a = sorted(one["samples"][name], key=lambda s: s["doc_id"])
        b = sorted(eight["samples"][name], key=lambda s: s["doc_id"])
        assert len(a) == len(b) == len((TASKS / f"{name[8:]}.jsonl").read_text().splitlines())
        for sa, sb in zip(a, b):
            if name == "mosaics_toy_answer":  # generated text, greedy: identical
                assert sa["filtered_resps"] == sb["filtered_resps"]
            else:  # (loglikelihood, is_greedy) per choice, float32 batches of other shapes
                for (la, ga), (lb, gb) in zip(sa["filtered_resps"], sb["filtered_resps"]):
                    assert la == pytest.approx(lb, abs=1e-4) and ga == gb
