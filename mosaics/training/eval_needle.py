"""The needle probe of ``mosaics eval`` (:mod:`mosaics.evaluation.needle`) on the live model:
``facts`` facts in the corpus's own phrasing (or pass keys, for a corpus without the story
templates), a haystack of validation documents, the gold fact at ``depth``, the question at
the end; at ``lengths`` multiples of the training length. Logs ``x<m>/exact_match`` (greedy
answer) and ``x<m>/top1`` (gold first among the candidates by log-likelihood), and the
``chance`` of the latter."""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from ..errors import ConfigError
from .evals import EvalSpec, Evaluation


class NeedleProbe(Evaluation):
    """``prompts`` needle prompts per length (main process)."""

    def __init__(self, spec: EvalSpec, tokenizer: Any, texts: list[str], block_size: int,
                 seed: int) -> None:
        super().__init__(spec)
        from ..evaluation.needle import NeedleBuilder, NeedleError

        opts = spec.options
        try:
            self.builder = NeedleBuilder(tokenizer, texts, facts=int(opts.get("facts", 3)),
                                         block_size=block_size, seed=seed)
        except NeedleError as err:
            raise ConfigError(f"evals.needle: {err}") from None
        self.tokenizer, self.block_size = tokenizer, block_size
        lengths = opts.get("lengths", [1])
        self.lengths = [float(m) for m in (lengths if isinstance(lengths, list) else [lengths])]
        self.depth = float(opts.get("depth", 0.5))
        self.prompts = int(opts.get("prompts", 16))

    def run(self, model: nn.Module, deadline: float, trainer: Any) -> dict[str, Any]:
        from ..evaluation.needle import run_cell

        device = next(model.parameters()).device
        out: dict[str, Any] = {}
        for multiple in self.lengths:
            if time.monotonic() > deadline:
                break
            cell = run_cell(model, self.builder, self.tokenizer, int(multiple * self.block_size),
                            self.depth, None, self.prompts,
                            batch_size=int(self.spec.options.get("batch_size", 8)),
                            device=device)
            key = f"x{multiple:g}"
            out[f"{key}/exact_match"], out[f"{key}/top1"] = cell.exact_match, cell.top1
            out["chance"] = cell.chance
        return out


def needle_texts(cfg: Any) -> list[str] | None:
    """The validation documents the probe reads (never training text), or None when the
    corpus has no validation split."""
    from ..evaluation.needle import NeedleError
    from ..evaluation.recall_probe import validation_texts

    if isinstance(cfg.data_source, dict):
        return None
    num_val = cfg.num_val_stories or max(100, cfg.num_train_stories // 20)
    try:
        texts, _ = validation_texts(cfg.data_source, num_val=num_val, seed=cfg.data_seed,
                                    text_column=cfg.text_column)
    except NeedleError:
        return None
    return texts
