"""Tables of the ``pretrain`` jobs: per model (seeds merged), the needle's exact match by
prompt length (mean over depths), the controls, the corpus's own question, the validation
loss and the training speed."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np


def _ms(values: list[float]) -> str:
    if not values:
        return ""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f}"


def _by_length(recall: dict[str, Any], control: str | None, metric: str) -> dict[float, float]:
    """Mean of ``metric`` over the depth cells (control None) or a control's cells, by
    multiplier; cells a model cannot run are left out."""
    acc: dict[float, list[float]] = defaultdict(list)
    for c in recall["cells"]:
        if c["control"] == control and c["status"] == "ok":
            acc[c["multiplier"]].append(c[metric])
    return {m: float(np.mean(v)) for m, v in acc.items()}


def pretrain_markdown(records: list[dict[str, Any]], metric: str = "exact_match") -> str:
    """Model x length (mean over depths; mean ± sd over seeds), then own question, controls at
    the longest length, validation loss, tokens/s, wall minutes per job (training and probe)
    and the number of seeds."""
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    minutes: dict[str, list[float]] = defaultdict(list)
    for rec in records:
        for run in rec["results"]["runs"]:
            rows[run["label"]].append(run)
        minutes[rec["results"]["runs"][0]["label"]].append(rec.get("seconds", 0.0) / 60)
    mults = sorted({c["multiplier"] for runs in rows.values() for r in runs
                    for c in r["recall"]["cells"]})
    head = (["model"] + [f"{m:g}x" for m in mults]
            + ["no gold", "recent", "own question", "val loss", "tokens/s", "job minutes",
               "seeds"])
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for label, runs in sorted(rows.items()):
        cells = []
        for m in mults:
            vals = [v for r in runs if (v := _by_length(r["recall"], None, metric).get(m))
                    is not None]
            cells.append(_ms(vals) if vals else "n/a")
        for control in ("no_gold", "recent"):
            vals = []
            for r in runs:
                by = _by_length(r["recall"], control, metric)
                if by:
                    vals.append(by[max(by)])
            cells.append(_ms(vals))
        own = [r["recall"]["own_question"][metric] for r in runs
               if r["recall"].get("own_question")]
        val = [r["train"]["val_loss"] for r in runs
               if r.get("train", {}).get("val_loss") is not None]
        tps = [r["train"]["tokens_per_s"] for r in runs
               if r.get("train", {}).get("tokens_per_s")]
        cells += [_ms(own), f"{np.mean(val):.3f}" if val else "",
                  f"{np.mean(tps):.0f}" if tps else "", f"{np.mean(minutes[label]):.0f}",
                  str(len(runs))]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    any_run = next(iter(rows.values()))[0]["recall"]
    note = (f"needle {metric.replace('_', ' ')} by prompt length (x the training length "
            f"{any_run['block_size']}), mean over the gold fact's depths; {any_run['facts']} "
            f"facts per prompt, {any_run['prompts_per_cell']} prompts per cell, chance "
            f"{any_run['chance']:.2f}; controls at the longest length")
    return note + "\n\n" + "\n".join(lines)
