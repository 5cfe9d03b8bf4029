"""Compare the validation loss and loss by position of several models, from the
``perplexity.json`` files that ``eval/perplexity.py`` wrote.

    python eval/compare_loss.py v1=runs/v1/final/perplexity.json v2=runs/v2/final/... \\
        --out runs/compare.png

Prints a markdown table (loss, perplexity, mean loss over the first / middle / last 10% of
positions, window length) and draws the log-binned loss by position of every model on one
figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mosaics.evaluation.plots import plot_loss_by_position  # noqa: E402


def _labelled(arg: str) -> tuple[str, Path]:
    label, sep, path = arg.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=path/to/perplexity.json, got {arg!r}")
    return label, Path(path)


def _tenths(loss: list[float]) -> tuple[float, float, float]:
    x = np.asarray(loss, dtype=float)
    k = max(1, len(x) // 10)
    mid = (len(x) - k) // 2
    return float(x[:k].mean()), float(x[mid:mid + k].mean()), float(x[-k:].mean())


def table(results: dict[str, dict]) -> str:
    lines = ["| model | window | loss | perplexity | first 10% | middle 10% | last 10% |",
             "|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        first, mid, last = _tenths(r["loss_by_position"])
        lines.append(f"| {label} | {r['block_size']} | {r['loss']:.3f} | {r['perplexity']:.2f} "
                     f"| {first:.3f} | {mid:.3f} | {last:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=_labelled, help="LABEL=path/to/perplexity.json")
    p.add_argument("--out", type=Path, help="PNG of the loss by position (optional)")
    p.add_argument("--title", default="loss by position")
    args = p.parse_args(argv)
    results = {}
    for label, path in args.runs:
        if not path.is_file():
            p.error(f"{path}: no such file; run eval/perplexity.py first")
        results[label] = json.loads(path.read_text())
    print(table(results))
    if args.out:
        plot_loss_by_position({k: r["loss_by_position"] for k, r in results.items()}, args.out,
                              args.title)
        print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
