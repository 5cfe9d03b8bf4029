"""The recall report of a saved causal LM: the needle grid (length x depth, with the no-gold
and recent controls), the corpus's own question and the loss by position, written as one JSON
per cell, a heatmap, a markdown table and ``recall.json``.

Cells already on disk are kept, so an interrupted report resumes where it stopped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .needle import CONTROLS, DEPTHS, MULTIPLIERS, Cell, NeedleBuilder, NeedleError

STORY_VAL_SEED_OFFSET = 1_000_003  # the validation stream of mosaics.data.make_default_corpus


def validation_texts(source: str | None, num_val: int = 1000, seed: int = 0,
                     text_column: str = "text") -> tuple[list[str], list[Any] | None]:
    """The validation documents of ``source`` (None: the built-in story corpus of ``seed``,
    with its records for the own-question reference)."""
    if source is None:
        from ..data.storygen import generate_story_records

        records = generate_story_records(num_val, seed + STORY_VAL_SEED_OFFSET)
        return [r.text for r in records], records
    from ..data import load_texts
    from ..data.loading import MissingSplitError

    try:
        ds = load_texts(source, "validation", text_column=text_column)
    except MissingSplitError:
        raise NeedleError(f"{source} has no validation split; the probe reads only text the "
                          "model never trained on: add a validation file (valdataset.txt / "
                          "a validation split)") from None
    return list(ds["text"]), None


def context_limit(model: Any) -> int | None:
    """Positions a model can address (a learned table), or None (any length)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) == "gpt2":
        return cfg.n_positions
    return None


def _write_json(path: Path, obj: Any) -> None:
    from .jobs import write_json

    write_json(path, obj)


def probe(model_dir: str | Path, out: str | Path, source: str | None = None,
          multipliers: Sequence[float] = MULTIPLIERS, depths: Sequence[float] = DEPTHS,
          prompts: int = 20, facts: int = 3, seed: int = 0, batch_size: int = 8,
          controls: Sequence[str] = CONTROLS, mode: str = "auto", own_prompts: int = 100,
          loss_multiplier: int = 16, loss_windows: int = 4, device: str = "cpu",
          progress: bool = True, corpus_seed: int = 0,
          block_size: int | None = None, batch_tokens: int = 16384,
          config_changes: dict[str, Any] | None = None,
          label: str | None = None) -> dict[str, Any]:
    """Run the recall report of ``model_dir`` into ``out``; returns ``recall.json``'s content.
    ``block_size``: the training length the lengths are multiples of (default: the config's
    ``block_size`` or ``n_positions``; a rotary model's config does not record it).
    ``batch_tokens``: prompts per forward are cut to this many tokens (at least one prompt).
    ``config_changes``: fields of the saved config changed before scoring (a test-time
    ablation, e.g. ``{"long_term_gap": 10**9}``: a v2 model without its long-term memory)."""
    from tqdm.auto import tqdm

    from ..data import load_tokenizer
    from ..data.loading import DataError
    from . import models

    model_dir, out = Path(model_dir), Path(out)
    try:
        tokenizer = load_tokenizer(model_dir)
    except DataError:
        raise NeedleError(f"{model_dir} holds no tokenizer (tokenizer.json); the probe needs "
                          "the model's own: save it beside the model (the trainer's final/ "
                          "has it)") from None
    model = models.load_model(model_dir, device, config_changes)
    block = int(block_size or getattr(model.config, "block_size", 0)
                or getattr(model.config, "n_positions", 0))
    if block <= 0:
        raise NeedleError(f"{model_dir}/config.json names no training length (block_size); "
                          "pass it (--block-size)")
    limit = context_limit(model)
    texts, records = validation_texts(source, seed=corpus_seed)
    builder = NeedleBuilder(tokenizer, texts, mode, facts, block, seed)
    lengths = [int(round(m * block)) for m in multipliers]
    grid = [(L, d, None) for L in lengths for d in depths]
    grid += [(L, None, c) for L in lengths for c in controls]
    runnable = [g for g in grid if limit is None or g[0] <= limit]
    cells: list[dict[str, Any]] = []
    bar = tqdm(total=len(runnable) * prompts, desc="needle prompts", disable=not progress)
    for L, d, c in grid:
        cell = Cell(L, L / block, d, c, prompts)
        path = out / "cells" / f"{cell.key}.json"
        if path.is_file():
            cells.append(json.loads(path.read_text()))
            bar.update(prompts if (L, d, c) in runnable else 0)
            continue
        if (L, d, c) not in runnable:
            cell.status = f"n/a: {limit} learned positions"
            cell.prompts = 0
        else:
            from .needle import run_cell

            rows = max(1, min(batch_size, batch_tokens // L))  # bounded activations
            cell = run_cell(model, builder, tokenizer, L, d, c, prompts, rows, device,
                            bar.update)
        _write_json(path, cell.as_dict())
        cells.append(cell.as_dict())
    bar.close()
    result: dict[str, Any] = {
        "model": str(model_dir), "label": label or model_dir.resolve().parent.name,
        "config_changes": dict(config_changes or {}),
        "mode": builder.mode, "block_size": block, "facts": facts,
        "prompts_per_cell": prompts, "seed": seed, "chance": cells[0]["chance"] if cells else None,
        "cells": [{k: v for k, v in c.items() if k != "rows"} for c in cells]}
    if records is not None and builder.mode == "story" and own_prompts > 0:
        from .needle import own_question_cell

        own = own_question_cell(model, tokenizer, records, own_prompts, block, device)
        result["own_question"] = {k: v for k, v in own.as_dict().items() if k != "rows"}
    if loss_multiplier:
        result["loss_by_length"] = loss_by_length(model, tokenizer, texts, block,
                                                  loss_multiplier, loss_windows, limit, device)
    _write_json(out / "recall.json", result)
    (out / "recall.md").write_text(markdown(result) + "\n")
    heatmap(result, out / "needle_heatmap.png")
    return result


def loss_by_length(model: Any, tokenizer: Any, texts: Sequence[str], block: int,
                   multiplier: int, windows: int, limit: int | None,
                   device: str) -> dict[str, Any]:
    """Validation loss by position in windows of ``multiplier`` x the training length (or the
    longest the model addresses), as the mean of each training-length segment."""
    from . import lm

    T = block * multiplier if limit is None else min(limit, block * multiplier)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False)["input_ids"] + [eos]
        if len(ids) >= T * windows:
            break
    if len(ids) < T:
        return {"window": T, "note": "validation split shorter than one window"}
    wins = lm.windows(np.asarray(ids), T, windows)
    r = lm.evaluate_windows(model, wins, 1, device)
    by_pos = np.asarray(r["loss_by_position"])
    segs = [float(by_pos[i: i + block].mean()) for i in range(0, len(by_pos), block)]
    return {"window": T, "windows": r["windows"], "loss": r["loss"],
            "segment_loss": segs, "segment": block,
            "note": "flat loss shows stability, not recall"}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def markdown(result: dict[str, Any]) -> str:
    """Depth (rows) x length (columns) of exact match / top-1, then the controls."""
    cells = result["cells"]
    lengths = sorted({c["length"] for c in cells})
    head = "| gold at | " + " | ".join(f"{c / result['block_size']:g}x" for c in lengths) + " |"
    lines = [f"exact match / top-1 of {result['prompts_per_cell']} prompts per cell "
             f"({result['mode']} mode, {result['facts']} facts, chance "
             f"{_fmt(result['chance'])}); {result['model']}", "", head,
             "|---" * (len(lengths) + 1) + "|"]
    rows: dict[str, dict[int, str]] = {}
    for c in cells:
        name = c["control"] or f"depth {round(100 * c['depth'])}%"
        val = (c["status"] if c["status"] != "ok"
               else f"{_fmt(c['exact_match'])} / {_fmt(c['top1'])}")
        rows.setdefault(name, {})[c["length"]] = "n/a" if val.startswith("n/a") else val
    for name, by_len in rows.items():
        lines.append(f"| {name} | " + " | ".join(by_len.get(L, "") for L in lengths) + " |")
    share: dict[str, dict[int, list[float]]] = {}
    for c in cells:
        if c["status"] == "ok" and c.get("distractor") is not None:
            name = "no gold" if c["control"] == "no_gold" else "gold present"
            share.setdefault(name, {}).setdefault(c["length"], []).append(c["distractor"])
    if share:
        lines += ["", "share of greedy answers naming another fact's answer (the wrong key "
                      "retrieved), mean over the cells of a length:", "", head.replace(
                          "gold at", "prompts"), "|---" * (len(lengths) + 1) + "|"]
        for name, by_len in share.items():
            lines.append(f"| {name} | " + " | ".join(
                _fmt(float(np.mean(by_len[L]))) if L in by_len else "n/a" for L in lengths)
                + " |")
    own = result.get("own_question")
    if own:
        lines += ["", f"the corpus's own question (single stories, {own['prompts']} prompts): "
                      f"exact match {_fmt(own['exact_match'])}, top-1 {_fmt(own['top1'])}"]
    lbl = result.get("loss_by_length")
    if lbl and "segment_loss" in lbl:
        segs = lbl["segment_loss"]
        lines += ["", f"validation loss per {lbl['segment']}-token segment of "
                      f"{lbl['window']}-token windows ({lbl['note']}): "
                      + ", ".join(f"{x:.3f}" for x in segs)]
    return "\n".join(lines)


def heatmap(result: dict[str, Any], path: str | Path) -> Path:
    """Exact match over length (x) and depth (y)."""
    from .plots import _save, plt

    cells = [c for c in result["cells"] if c["control"] is None]
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for c in cells:
        if c["status"] == "ok":
            grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["exact_match"]
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(lengths), 1.0 + 0.6 * len(depths)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(lengths)),
                  [f"{L / result['block_size']:g}x" for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{round(100 * d)}%" for d in depths])
    ax.set_xlabel("prompt length (x training length)")
    ax.set_ylabel("gold fact depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, "n/a" if np.isnan(grid[i, j]) else f"{grid[i, j]:.2f}",
                    ha="center", va="center", color="w", fontsize=8)
    ax.set_title(result.get("label") or result["model"], fontsize=9)
    fig.colorbar(im, ax=ax, label="exact match")
    return _save(fig, path)
