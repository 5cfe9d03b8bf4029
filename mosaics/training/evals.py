"""Evaluations run on the live model during training (see :mod:`mosaics.training.eval_hook`).

``TrainConfig.evals`` names them, each with its own interval (steps) and time budget (s)::

    evals: {position_loss: 50, sample: {interval: 100, tokens: 32}, recall: 100,
            needle: {interval: 500, lengths: [1, 2]},
            lm_eval: {interval: 500, tasks: [hellaswag], limit: 50, budget_s: 600}}

An evaluation returns scalars (and the sample's text) that go to metrics.jsonl and every
tracker under ``eval/<name>/...``. ``every_rank`` evaluations run on all processes (sharded,
one reduction); the others on the main process only, which the other processes do not wait
for (they block in the next step's all-reduce until it is done).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

DEFAULT_BUDGET_S = 60.0


@dataclass
class EvalSpec:
    """One named evaluation: run every ``interval`` steps, stop after ``budget_s`` seconds."""

    name: str
    interval: int
    budget_s: float = DEFAULT_BUDGET_S
    options: dict[str, Any] = field(default_factory=dict)


OPTIONS = {"position_loss": {"buckets"}, "sample": {"tokens", "prompt", "top_k"},
           "recall": {"prompts"}, "needle": {"prompts", "lengths", "depth", "facts", "batch_size"},
           "lm_eval": {"tasks", "include_path", "limit", "batch_size", "num_fewshot"}}


def parse_evals(value: dict[str, Any] | None) -> list[EvalSpec]:
    """``TrainConfig.evals`` as specs: ``{name: interval}`` or ``{name: {interval, budget_s,
    option...}}``; a bad name, interval or option raises one-line ``ConfigError``."""
    specs = []
    for name, setting in (value or {}).items():
        if name not in OPTIONS:
            raise ConfigError(f"evals: unknown evaluation {name!r}; choose from "
                              f"{', '.join(OPTIONS)}.")
        setting = {"interval": setting} if not isinstance(setting, dict) else dict(setting)
        interval, budget = setting.pop("interval", None), setting.pop("budget_s",
                                                                       DEFAULT_BUDGET_S)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise ConfigError(f"evals.{name}: interval must be a positive number of steps, "
                              f"got {interval!r} (write {name}: 100 or {name}: {{interval: "
                              "100}).")
        if not isinstance(budget, (int, float)) or budget <= 0:
            raise ConfigError(f"evals.{name}: budget_s must be positive seconds, got {budget!r}.")
        unknown = set(setting) - OPTIONS[name]
        if unknown:
            raise ConfigError(f"evals.{name}: unknown option(s) {', '.join(sorted(unknown))}; "
                              f"it takes interval, budget_s, {', '.join(sorted(OPTIONS[name]))}.")
        specs.append(EvalSpec(name, interval, float(budget), setting))
    return specs


class Evaluation:
    """Base: ``run(model, deadline, trainer)`` -> {metric: value}; ``model`` is the unwrapped
    module in eval mode under ``torch.no_grad``; stop at ``deadline`` (``time.monotonic()``).
    An ``every_rank`` evaluation returns this process's ``_sums`` (1-D) and ``_count`` (0-D)
    tensors instead; they are summed over processes and passed to ``finish``."""

    every_rank = False

    def __init__(self, spec: EvalSpec) -> None:
        self.spec = spec

    def run(self, model: nn.Module, deadline: float, trainer: Any) -> dict[str, Any]:
        raise NotImplementedError

    def finish(self, sums: torch.Tensor, count: float) -> dict[str, Any]:
        raise NotImplementedError


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class PositionLoss(Evaluation):
    """Validation loss by position in the window, in ``buckets`` (default 4) equal spans of
    the scored positions 1..T-1 (``eval/position_loss/pos<first>-<last>``) and overall
    (``loss``, the validation loss); sharded over processes."""

    every_rank = True

    def run(self, model: nn.Module, deadline: float, trainer: Any) -> dict[str, Any]:
        acc = trainer.accelerator
        rank, world = acc.process_index, acc.num_processes
        device = _device(model)
        sums: torch.Tensor | None = None
        count = torch.zeros((), dtype=torch.float64)
        for batch in trainer.val_batches:
            if time.monotonic() > deadline:
                break
            ids = batch["input_ids"][rank::world].to(device)
            if ids.numel() == 0:
                continue
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            nll = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:],
                                              reduction="none").double().sum(0).cpu()
            sums = nll if sums is None else sums + nll
            count += ids.shape[0]
        if sums is None:
            length = int(trainer.val_batches[0]["input_ids"].shape[1]) if trainer.val_batches \
                else 2
            sums = torch.zeros(length - 1, dtype=torch.float64)
        return {"_sums": sums, "_count": count}

    def finish(self, sums: torch.Tensor, count: float) -> dict[str, Any]:
        """Mean losses by bucket from the (reduced) per-position sums and window count."""
        if count == 0:
            return {}
        by_pos = sums / count
        buckets = int(self.spec.options.get("buckets", 4))
        out = {"loss": float(by_pos.mean()), "windows": float(count)}
        width = len(str(len(by_pos)))  # zero-padded, so trackers sort the buckets in order
        for part in torch.arange(len(by_pos)).tensor_split(min(buckets, len(by_pos))):
            first, last = int(part[0]) + 1, int(part[-1]) + 1
            out[f"pos{first:0{width}d}-{last:0{width}d}"] = float(by_pos[part].mean())
        return out


class SampleText(Evaluation):
    """A sampled continuation of ``prompt`` (default ``TrainConfig.sample_prompt``), seeded by
    the run's seed so samples at different steps compare; ``eval/sample/text``."""

    def __init__(self, spec: EvalSpec, tokenizer: Any, prompt: str, seed: int) -> None:
        super().__init__(spec)
        self.tokenizer, self.seed = tokenizer, seed
        self.prompt = str(spec.options.get("prompt", prompt))

    def run(self, model: nn.Module, deadline: float, trainer: Any) -> dict[str, Any]:
        tok = self.tokenizer
        ids = tok(self.prompt, return_tensors="pt").input_ids.to(_device(model))
        torch.manual_seed(self.seed)
        out = model.generate(ids, max_new_tokens=int(self.spec.options.get("tokens", 32)),
                             do_sample=True, top_k=int(self.spec.options.get("top_k", 40)),
                             temperature=0.8, pad_token_id=tok.pad_token_id,
                             max_time=max(deadline - time.monotonic(), 0.01))
        return {"text": tok.decode(out[0], skip_special_tokens=True)}


class RecallProbe(Evaluation):
    """The corpus's own question on validation stories (the built-in story corpus): the
    story up to its answer, then the greedy next word; ``exact_match`` over ``prompts``
    stories (those done within the budget; ``prompts_scored`` says how many)."""

    def __init__(self, spec: EvalSpec, tokenizer: Any, stories: list[Any]) -> None:
        super().__init__(spec)
        self.tokenizer = tokenizer
        self.stories = stories[: int(spec.options.get("prompts", 32))]

    def run(self, model: nn.Module, deadline: float, trainer: Any) -> dict[str, Any]:
        tok, device, right, done = self.tokenizer, _device(model), 0, 0
        limit = getattr(model.config, "block_size", None) or 1 << 30
        for story in self.stories:
            if time.monotonic() > deadline:
                break
            ids = tok(story.text[: story.answer_start].rstrip(), return_tensors="pt").input_ids
            ids = ids[:, -(limit - 8):].to(device)
            out = model.generate(ids, max_new_tokens=4, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            words = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split()
            right += bool(words) and words[0].strip(".,!?").lower() == story.answer.lower()
            done += 1
        return {"exact_match": right / done if done else float("nan"),
                "prompts_scored": float(done)}


class SourceLoss(Evaluation):
    """Validation loss of each source of a data mixture (``eval/source_loss/<name>``), on
    that source's own windows; sharded over processes."""

    every_rank = True

    def __init__(self, spec: EvalSpec, windows: dict[str, torch.Tensor], rows: int) -> None:
        super().__init__(spec)
        self.windows, self.rows = windows, max(int(rows), 1)

    def run(self, model: nn.Module, deadline: float, trainer: Any) -> dict[str, Any]:
        acc = trainer.accelerator
        device = _device(model)
        sums = torch.zeros(2 * len(self.windows), dtype=torch.float64)  # nll, tokens
        for i, wins in enumerate(self.windows.values()):
            mine = wins[acc.process_index::acc.num_processes]
            for ids in mine.split(self.rows):
                ids = ids.to(device)
                out = model(input_ids=ids, labels=ids, use_cache=False)
                loss = out.lm_loss if getattr(out, "lm_loss", None) is not None else out.loss
                n = ids.shape[0] * (ids.shape[1] - 1)
                sums[2 * i] += float(loss) * n
                sums[2 * i + 1] += n
        return {"_sums": sums, "_count": torch.ones((), dtype=torch.float64)}

    def finish(self, sums: torch.Tensor, count: float) -> dict[str, Any]:
        return {name: float(sums[2 * i] / sums[2 * i + 1].clamp_min(1))
                for i, name in enumerate(self.windows)}
