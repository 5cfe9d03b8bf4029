"""The table writer: every result file under a sweep's output folder merged into markdown
tables (one per task and setting: RegBench accuracy / TVD by training size, exact match and
token accuracy by test length, learning curves, the wall minutes of each model's jobs, the
paper's numbers beside this project's) and figures, written to ``<out>/summary.md``.

Seeds of one model are merged as mean ± std; result folders of several sweeps merge into one
(:func:`merge_results`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from . import paper
from .jobs import write_json


def load_results(out: str | Path) -> list[dict[str, Any]]:
    """Every job result under ``<out>/results``, in name order."""
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("results/*.json"))]


def load_failures(out: str | Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("failed/*.json"))]


def merge_results(sources: Iterable[str | Path], out: str | Path) -> int:
    """Copy the result files of other output folders into ``<out>/results`` (one table over
    all of them); returns how many were copied. Jobs of the same name must agree."""
    copied = 0
    for source in map(Path, sources):
        files = sorted(source.glob("results/*.json"))
        if not files:
            raise ValueError(f"{source}: no result files (results/*.json); pass folders "
                             "written by a sweep's --out")
        for path in files:
            record = json.loads(path.read_text())
            target = Path(out) / "results" / path.name
            if target.exists() and json.loads(target.read_text())["results"] != \
                    record["results"]:
                raise ValueError(f"{path} and {target} hold different results for the same "
                                 "job; keep one of them")
            write_json(target, record)
            copied += 1
    return copied


def _cell(values: list[float]) -> str:
    """``mean`` or ``mean ± std (n)`` over seeds."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f} ({len(values)})"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _groups(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Records by (task, setting): one table per task and protocol."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        groups[(rec["job"]["task"], rec["job"]["setting"])].append(rec)
    return dict(sorted(groups.items()))


def regbench_rows(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Merged RegBench runs (one per job, with its seed) and baselines averaged over seeds,
    in the layout :func:`plots.plot_regbench` reads."""
    runs, baselines = [], defaultdict(lambda: defaultdict(list))
    seen_seeds = set()
    for rec in records:
        res = rec["results"]
        for run in res["runs"]:
            runs.append({**run, "label": rec["job"]["label"], "seed": rec["job"]["seed"]})
        if res["seed"] not in seen_seeds:
            seen_seeds.add(res["seed"])
            for name, score in res["baselines"].items():
                for key in ("accuracy", "tvd"):
                    baselines[name][key].append(score[key])
    return {"runs": runs, "baselines": {name: {k: float(np.mean(v)) for k, v in s.items()}
                                        for name, s in baselines.items()},
            "baseline_values": {name: dict(s) for name, s in baselines.items()},
            "seconds": _job_seconds(records)}


def regbench_markdown(merged: dict[str, Any]) -> str:
    """Accuracy / TVD per model x training size (mean ± std over seeds; the paper's in
    parentheses where it has one), n-gram rows below, wall minutes per model."""
    runs = merged["runs"]
    sizes = sorted({r["size"] for r in runs}, key=lambda s: (s is None, s or 0))
    header = ["model"] + [f"n={s} accuracy / TVD" if s is not None else "saved model "
                          "accuracy / TVD" for s in sizes] + ["minutes"]
    rows = []
    for label in dict.fromkeys(r["label"] for r in runs):
        cells = []
        for size in sizes:
            mine = [r for r in runs if r["label"] == label and r["size"] == size]
            cell = (f"{_cell([r['accuracy'] for r in mine])} / "
                    f"{_cell([r['tvd'] for r in mine])}" if mine else "-")
            ref = None if size is None else paper.regbench_cell(label, size)
            cells.append(cell if ref is None else f"{cell} ({ref[0]:.3f} / {ref[1]:.3f})")
        rows.append([label, *cells, _minutes(label, merged.get("seconds", {}))])
    for name, values in merged["baseline_values"].items():
        cell = f"{_cell(values['accuracy'])} / {_cell(values['tvd'])}"
        rows.append([name, *[cell] * len(sizes), "-"])
    return _markdown(header, rows)


def _minutes(label: str, seconds: dict[str, dict[str, list[float]]]) -> str:
    """Wall minutes of a model's jobs (mean over its jobs), per device when its jobs ran on
    more than one (``59.1 cpu / 6.0 cuda``)."""
    by_device = seconds.get(label)
    if not by_device:
        return "-"
    if len(by_device) == 1:
        return f"{np.mean(next(iter(by_device.values()))) / 60:.1f}"
    return " / ".join(f"{np.mean(v) / 60:.1f} {d}" for d, v in sorted(by_device.items()))


def _job_seconds(records: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Wall seconds of the jobs by label, then by the device they ran on."""
    seconds: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        device = str(rec.get("device", "cpu")).split(":")[0]
        seconds[rec["job"]["label"]][device].append(float(rec.get("seconds", 0.0)))
    return {label: dict(v) for label, v in seconds.items()}


def extrapolation_rows(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Merged extrapolation runs (one per job, with its seed) for the table and the plot."""
    runs = [{**run, "label": rec["job"]["label"], "seed": rec["job"]["seed"]}
            for rec in records for run in rec["results"]["runs"]]
    lengths = sorted({int(n) for rec in records for n in rec["results"]["lengths"]})
    return {"task": records[0]["job"]["task"], "lengths": lengths, "runs": runs,
            "seconds": _job_seconds(records)}


def extrapolation_markdown(merged: dict[str, Any], metric: str = "exact_match") -> str:
    """Exact match (or ``metric``, e.g. ``token_accuracy``) per model x test length (mean ±
    std over seeds), the paper's exact match in parentheses where it has one, and the wall
    minutes of each model's jobs."""
    header = ["model"] + [f"len {n}" for n in merged["lengths"]] + ["minutes"]
    rows = []
    for label in dict.fromkeys(r["label"] for r in merged["runs"]):
        mine = [r for r in merged["runs"] if r["label"] == label]
        cells = []
        for n in merged["lengths"]:
            values = [r[metric][str(n)] for r in mine if str(n) in r.get(metric, {})]
            cell = _cell(values) if values else "-"
            ref = (paper.extrapolation_cell(merged["task"], label, n)
                   if metric == "exact_match" else None)
            cells.append(cell if ref is None else f"{cell} ({ref:.2f})")
        rows.append([label, *cells, _minutes(label, merged.get("seconds", {}))])
    return _markdown(header, rows)


def curve_markdown(records: list[dict[str, Any]], points: int = 4) -> str:
    """Validation learning curves of extrapolation jobs, one row per job (model, seed): at
    ``points`` evaluations spread evenly over the longest run, ``minutes / validation loss /
    token accuracy / exact match`` on the validation samples (training lengths)."""
    runs = []
    for rec in records:
        for run in rec["results"]["runs"]:
            evals = [e for e in run.get("train", {}).get("history", []) if "val/loss" in e]
            if evals:
                runs.append((f"{rec['job']['label']} s{rec['job']['seed']}", evals))
    if not runs:
        return "no validation history in these results"
    last = max(e["step"] for _, evals in runs for e in evals)
    marks = sorted({max(1, round(last * (i + 1) / points)) for i in range(points)})
    rows = [[name, *(_curve_cell(evals, mark, last / (2 * points)) for mark in marks)]
            for name, evals in runs]
    return _markdown(["job"] + [f"step {m}" for m in marks], rows)


def _curve_cell(evals: list[dict[str, Any]], mark: int, slack: float) -> str:
    """The last evaluation at or before step ``mark``; "-" if there is none within ``slack``
    steps of it (the run stopped short of the mark)."""
    before = [e for e in evals if e["step"] <= mark]
    if not before or mark - before[-1]["step"] > slack:
        return "-"
    e = before[-1]
    return (f"{e.get('elapsed_s', 0.0) / 60:.1f} / {e['val/loss']:.3f} / "
            f"{e.get('val/token_accuracy', float('nan')):.3f} / "
            f"{e.get('val/exact_match', float('nan')):.3f}")


def summarize(out: str | Path, plot: bool = True) -> str:
    """Markdown tables (and figures) of every result under ``out``; written to
    ``<out>/summary.md`` and returned."""
    from . import plots

    out = Path(out)
    parts = []
    for (task, setting), records in _groups(load_results(out)).items():
        slug = f"{task}-{setting.replace('+', '-')}"
        steps = sorted({rec["results"]["runs"][0]["train"]["steps"] for rec in records
                        if rec["results"]["runs"] and "train" in rec["results"]["runs"][0]})
        title = f"## {task}, preset {setting} ({len(records)} jobs, steps {steps})"
        if task == "pretrain":
            from .recall_tables import pretrain_markdown

            parts += [title, pretrain_markdown(records)]
        elif task == "regbench":
            merged = regbench_rows(records)
            parts += [title, "accuracy / TVD on the test automata; mean ± std (seeds) when "
                      "several seeds", regbench_markdown(merged)]
            if plot:
                parts.append(f"![{slug}]({plots.plot_regbench(merged, out / f'{slug}.png').name})")
        else:
            merged = extrapolation_rows(records)
            parts += [title, "exact match (teacher-forced argmax) by test length; mean ± std "
                      "(seeds) when several seeds; the paper's in parentheses",
                      extrapolation_markdown(merged),
                      "token accuracy (teacher-forced) by test length",
                      extrapolation_markdown(merged, "token_accuracy"),
                      "validation curve: minutes / loss / token accuracy / exact match",
                      curve_markdown(records)]
            if plot:
                parts.append(f"![{slug}]"
                             f"({plots.plot_extrapolation(merged, out / f'{slug}.png').name})")
    failures = load_failures(out)
    if failures:
        parts.append("## failed jobs")
        parts += [f"- {f['job']['name']}: exit {f['status']}, log {f['log']}" for f in failures]
    text = "\n\n".join(parts) + "\n" if parts else "no results yet\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text)
    return text

