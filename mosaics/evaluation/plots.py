"""Matplotlib figures of the evaluation results (PNG, no display needed)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: str | Path) -> Path:  # noqa: ANN001
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


_BASELINE_STYLES = ["-", "--", "-.", ":", (0, (5, 1, 1, 1))]  # oracle, 2-, 3-, 4-gram


def _mean_std(points: list[tuple[float, float]]) -> tuple[list, list, list]:
    """x, mean y and standard deviation of y (0 for one value) of (x, y) pairs grouped by x:
    several seeds of one model become one point with an error bar."""
    by_x: dict[float, list[float]] = {}
    for x, y in points:
        by_x.setdefault(x, []).append(y)
    xs = sorted(by_x)
    means = [float(np.mean(by_x[x])) for x in xs]
    stds = [float(np.std(by_x[x], ddof=1)) if len(by_x[x]) > 1 else 0.0 for x in xs]
    return xs, means, stds


def _line(ax, points: list[tuple[float, float]], label: str) -> None:  # noqa: ANN001
    xs, means, stds = _mean_std(points)
    if any(stds):
        ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=label)
    else:
        ax.plot(xs, means, marker="o", label=label)


def plot_regbench(results: dict[str, Any], path: str | Path) -> Path:
    """Accuracy and TVD against the number of training automata; baselines as dashed lines.
    Runs of one label at one size (several seeds) are drawn as mean ± std."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    runs = [r for r in results["runs"] if r["size"] is not None]
    for metric, ax in zip(("accuracy", "tvd"), axes):
        for label in dict.fromkeys(r["label"] for r in runs):
            _line(ax, [(r["size"], r[metric]) for r in runs if r["label"] == label], label)
        for i, (name, r) in enumerate(results["baselines"].items()):
            ax.axhline(r[metric], linestyle=_BASELINE_STYLES[i % len(_BASELINE_STYLES)],
                       color="0.35", label=name, linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("training automata")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("RegBench")
    return _save(fig, path)


def plot_extrapolation(results: dict[str, Any], path: str | Path) -> Path:
    """Exact match and token accuracy against test length (log2 axis), one line per model
    (mean ± std over the runs that share a label, e.g. seeds)."""
    metrics = [m for m in ("exact_match", "token_accuracy")
               if any(r.get(m) for r in results["runs"])]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for label in dict.fromkeys(r["label"] for r in results["runs"]):
            points = [(int(k), v) for r in results["runs"] if r["label"] == label
                      for k, v in r.get(metric, {}).items()]
            if points:
                _line(ax, points, label)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("test length")
        ax.set_ylabel(metric.replace("_", " "))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{results['task']}: length extrapolation")
    return _save(fig, path)


def plot_retrieval(profiles: dict[str, dict[int, dict[str, Any]]], path: str | Path) -> Path:
    """Block mass and effective support of each model's retrieval head
    (:func:`mosaics.evaluation.analysis.retrieval.retrieval_head`), and the entry mass of the
    direct and the second path (each its own best head), against test length (log2 axes)."""
    from .analysis.retrieval import retrieval_head

    metrics = [m for m in ("block_mass", "direct_mass", "second_mass", "effective")
               if all(m in p for prof in profiles.values() for p in prof.values())]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    palette = plt.get_cmap("tab10" if len(profiles) <= 10 else "tab20")  # one colour a model
    for ax, metric in zip(axes[0], metrics):
        for i, (label, by_length) in enumerate(profiles.items()):
            layer, head = retrieval_head(by_length[min(by_length)],
                                         "block_mass" if metric == "effective" else metric)
            lengths = sorted(by_length)
            ax.plot(lengths, [by_length[n][metric][layer][head] for n in lengths], marker="o",
                    color=palette(i % palette.N), label=f"{label} ({layer}.{head})")
        ax.set_xscale("log", base=2)
        if metric == "effective":
            ax.set_yscale("log", base=2)
        else:
            ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("test length")
        ax.set_ylabel({"block_mass": "weight on the answering block",
                       "direct_mass": "v1 rows: weight on the entry with v1",
                       "second_mass": "v2 rows: weight on the entry with v2",
                       "effective": "effective support (exp entropy)"}[metric])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)  # (layer.head) differs between panels
    fig.suptitle("retrieval head by test length")
    return _save(fig, path)


def _log_bins(loss: np.ndarray) -> tuple[list[float], list[float]]:
    """Centers and means of logarithmic bins of positions 1..len(loss)."""
    edges = np.unique(np.geomspace(1, len(loss) + 1, num=24).astype(int))
    centers = [float(np.sqrt(lo * (hi - 1))) for lo, hi in zip(edges[:-1], edges[1:])]
    means = [float(loss[lo - 1:hi - 1].mean()) for lo, hi in zip(edges[:-1], edges[1:])]
    return centers, means


def plot_loss_by_position(loss_by_position: list[float] | dict[str, list[float]],
                          path: str | Path, title: str = "loss by position") -> Path:
    """Mean next-token loss at each position of the window (position t predicts token t), with
    its average over logarithmic bins of positions (the trend a few windows leave noisy).
    A dict {label: losses} draws the binned means of several models on one figure."""
    fig, ax = plt.subplots(figsize=(6, 4))
    if isinstance(loss_by_position, dict):
        for label, values in loss_by_position.items():
            centers, means = _log_bins(np.asarray(values, dtype=float))
            ax.plot(centers, means, marker="o", linewidth=2, label=label)
    else:
        loss = np.asarray(loss_by_position, dtype=float)
        ax.plot(np.arange(1, len(loss) + 1), loss, linewidth=0.6, alpha=0.35,
                label="per position")
        ax.plot(*_log_bins(loss), marker="o", linewidth=2, label="log-binned mean")
    ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("position in window")
    ax.set_ylabel("mean loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_routes(histories: dict[str, list[dict[str, Any]]], path: str | Path) -> Path:
    """One panel per MQMTAR run: the best-head entry mass of each path of the recall and the
    v1 accuracy and validation exact match against the training step
    (:func:`mosaics.evaluation.analysis.retrieval.route_history` rows)."""
    from .analysis.retrieval import PATHS

    cols = min(3, len(histories))
    rows = -(-len(histories) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(histories):]:
        ax.set_visible(False)
    for ax, (label, history) in zip(axes.flat, histories.items()):
        steps = [r["step"] for r in history]
        for key in PATHS:
            ax.plot(steps, [r[f"val/{key}"] for r in history], label=key.removesuffix("_mass"))
        ax.plot(steps, [r["val/v1_accuracy"] for r in history], "k--", label="v1 accuracy")
        ax.plot(steps, [r.get("val/exact_match", np.nan) for r in history], "k:",
                label="exact match")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("training step")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes.flat[0].set_ylabel("best-head entry mass / accuracy")
    axes.flat[0].legend(fontsize=6)
    fig.suptitle("MQMTAR: the recall's routes during training (validation samples)")
    return _save(fig, path)


def plot_against_paper(merged: dict[str, Any], path: str | Path) -> Path:
    """One panel per model: exact match against the test length as a multiple of the training
    length, each seed a thin line, their mean a thick one, and the paper's row (where it has
    one) dashed in black. ``merged`` is :func:`mosaics.evaluation.tables.extrapolation_rows`."""
    from . import paper

    task, unit = merged["task"], paper.TRAIN_LENGTH
    order = list(paper.EXTRAPOLATION.get(task, {}))  # the paper's row order, then the rest

    def rank(label: str) -> int:
        row = paper.paper_row(label)
        return order.index(row) if row in order else len(order)

    labels = sorted(dict.fromkeys(r["label"] for r in merged["runs"]), key=rank)
    cols = min(4, len(labels))
    rows = -(-len(labels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.9 * rows), squeeze=False,
                             sharex=True, sharey=True)
    for ax in axes.flat[len(labels):]:
        ax.set_visible(False)
    for ax, label in zip(axes.flat, labels):
        runs = [r for r in merged["runs"] if r["label"] == label]
        for run in runs:
            lengths = sorted(int(n) for n in run["exact_match"])
            ax.plot([n / unit for n in lengths], [run["exact_match"][str(n)] for n in lengths],
                    color="C0", alpha=0.35, lw=0.8)
        lengths, means, _ = _mean_std([(int(n), v) for r in runs
                                       for n, v in r["exact_match"].items()])
        xs = [n / unit for n in lengths]
        ax.plot(xs, means, color="C0", marker="o", ms=3, lw=2, label="this project")
        ref = [(n / unit, y) for n in lengths
               if (y := paper.extrapolation_cell(task, label, n)) is not None]
        if ref:
            ax.plot(*zip(*ref), "k--", marker="o", mfc="none", ms=4, lw=1, label="paper")
        title = f"{label.removeprefix('mosaics/')} ({len(runs)} seed{'s' * (len(runs) > 1)})"
        ax.set_title("\n".join(textwrap.wrap(title, 42)), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}x" for x in xs], fontsize=7)
        ax.minorticks_off()
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("test length / training length")
    for ax in axes[:, 0]:
        ax.set_ylabel("exact match")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{task}: exact match against the paper's table")
    return _save(fig, path)
