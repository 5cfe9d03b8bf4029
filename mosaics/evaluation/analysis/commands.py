"""The ``mosaics eval`` subcommands of the research probes: ``retrieval`` (where the
contextual memory of saved task models looks, per test length), ``empty-rows`` (the rows whose
kernel weights no past entry) and ``routes`` (which route of MQMTAR's recall a run takes
during training, from its log). The measurements: :mod:`mosaics.evaluation.analysis.retrieval`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..arguments import check_model_dirs, default_device, positive_int, setting_arg

# --- retrieval --------------------------------------------------------------------------------

def _retrieval_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", nargs="+", required=True, metavar="DIR",
                   help="saved Memory Mosaics task models (v1 memory, a score kernel)")
    p.add_argument("--model-set", dest="config_changes", type=setting_arg, action="append",
                   default=[], metavar="KEY=VALUE",
                   help="change a field of each saved model's config first, e.g. "
                        "--model-set alibi=false")
    p.add_argument("--labels", nargs="+", metavar="LABEL",
                   help="a table label per --model (default: the folders)")
    p.add_argument("--task", choices=["sort", "mqmtar"], default="mqmtar")
    p.add_argument("--lengths", nargs="+", type=positive_int, default=[64, 512, 4096],
                   help="test lengths (default 64 512 4096: 1x, 8x and 64x of MQMTAR's 64)")
    p.add_argument("--samples", type=positive_int, default=20,
                   help="test samples per length: the first of the extrapolation job's test "
                        "set (default 20)")
    p.add_argument("--seed", nargs="+", type=int, default=[0],
                   help="the seed of each model's job, one for all or one per --model; the "
                        "job's test sets use seed + 1000 (default 0)")
    p.add_argument("--bandwidth", type=bandwidth_arg, action="append", default=[],
                   metavar="LAYER.HEAD=BETA",
                   help="a test-time intervention: set one head's bandwidth beta before "
                        "scoring, e.g. --bandwidth 3.0=15 (repeatable)")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path,
                   help="folder for retrieval.json, retrieval.md and retrieval.png")


def bandwidth_arg(text: str) -> tuple[int, int, float]:
    """``LAYER.HEAD=BETA`` -> (layer, head, beta)."""
    where, sep, value = text.partition("=")
    layer, dot, head = where.partition(".")
    try:
        if not sep or not dot:
            raise ValueError
        return int(layer), int(head), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYER.HEAD=BETA (e.g. 3.0=15), got "
                                         f"{text!r}") from None


def retrieval_command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_model_dirs(p, args.model, args.config_changes)
    n = len(args.model)
    if args.labels and len(args.labels) != n:
        p.error(f"--labels: {len(args.labels)} value(s) for {n} --model folder(s); give one "
                "per folder")
    if len(args.seed) not in (1, n):
        p.error(f"--seed: {len(args.seed)} value(s) for {n} --model folder(s); give one per "
                "folder or one for all")
    from .. import experiments, models, plots, tasks
    from ..jobs import write_json
    from . import retrieval

    device = args.device or default_device()
    changes = dict(args.config_changes)
    seeds = args.seed * n if len(args.seed) == 1 else args.seed
    set_beta = "".join(f", beta {layer}.{head}={beta:g}" for layer, head, beta in args.bandwidth)
    labels = args.labels or [models.saved_label(d, changes) + set_beta for d in args.model]
    if len(set(labels)) != len(labels):
        p.error("two --model folders share a label; name them with --labels")
    profiles: dict[str, dict[int, dict[str, Any]]] = {}
    for d, label, seed in zip(args.model, labels, seeds):
        try:
            model = models.load_model(d, device, changes)
            experiments.check_vocab(model, tasks.TASKS[args.task].vocab_size, d, args.task)
            for layer, head, beta in args.bandwidth:
                retrieval.set_bandwidth(model, layer, head, beta)
            profiles[label] = {
                length: retrieval.retrieval_profile(
                    model, args.task,
                    tasks.fixed_set(args.task, args.samples, length, seed + 1000), device)
                for length in sorted(args.lengths)}
        except ValueError as err:
            p.error(f"--model {d}: {err}")
    table = retrieval.retrieval_table(profiles)
    paths = retrieval.paths_table(profiles)
    if paths:  # MQMTAR
        table += ("\n\nThe recall's paths (the best head of each at the shortest length):\n\n"
                  + paths)
    print(table)
    if args.out:
        write_json(args.out / "retrieval.json",
                   {"task": args.task, "samples": args.samples, "config_changes": changes,
                    "bandwidths": args.bandwidth, "seeds": dict(zip(labels, seeds)),
                    "profiles": profiles})
        (args.out / "retrieval.md").write_text(table + "\n")
        plot = plots.plot_retrieval(profiles, args.out / "retrieval.png")
        print(f"results: {args.out / 'retrieval.json'}\nplot: {plot}")
    return 0


# --- empty-rows ------------------------------------------------------------------------------

def _empty_rows_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", nargs="+", default=[], metavar="DIR",
                   help="saved Memory Mosaics task models (v1 memory, a score kernel)")
    p.add_argument("--labels", nargs="+", metavar="LABEL",
                   help="a table label per --model (default: the folders)")
    p.add_argument("--init", nargs="+", type=init_arg, default=[], metavar="KERNEL[:JSON]",
                   help="fresh models as a job of --preset builds them before its first step, "
                        "e.g. epanechnikov_fixed or 'epanechnikov_fixed:{\"parametrization\""
                        ": \"synthetic-code\"}'")
    p.add_argument("--init-seed", nargs="+", type=int, default=[0],
                   help="the job seeds of the --init models (default 0)")
    p.add_argument("--preset", default="cpu-recall",
                   help="the extrapolation preset whose model the --init models are (default "
                        "cpu-recall)")
    p.add_argument("--task", choices=["sort", "mqmtar"], default="mqmtar")
    p.add_argument("--length", type=positive_int, default=64,
                   help="test length (default 64, the training length)")
    p.add_argument("--samples", type=positive_int, default=32,
                   help="test samples (default 32)")
    p.add_argument("--device", default=None)


def init_arg(text: str) -> tuple[str, dict[str, Any]]:
    """``KERNEL`` or ``KERNEL:{json kwargs}`` -> (kernel, kwargs)."""
    kernel, sep, kwargs = text.partition(":")
    try:
        parsed = json.loads(kwargs) if sep else {}
        if not isinstance(parsed, dict):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"--init {text!r}: expected KERNEL or KERNEL:{{json "
                                         "object of kernel_kwargs}}") from None
    return kernel, parsed


def empty_rows_command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not args.model and not args.init:
        p.error("nothing to measure: give --model folders and/or --init kernels")
    check_model_dirs(p, args.model or None, [])
    if args.labels and len(args.labels) != len(args.model):
        p.error(f"--labels: {len(args.labels)} value(s) for {len(args.model)} --model "
                "folder(s); give one per folder")
    import torch

    from .. import experiments, models, tasks
    from ..jobs import model_label
    from ..protocols import EXTRAPOLATION_PRESETS
    from . import retrieval

    if args.preset not in EXTRAPOLATION_PRESETS:
        p.error(f"--preset {args.preset!r}: choose from "
                f"{', '.join(EXTRAPOLATION_PRESETS)}")
    device = args.device or default_device()
    spec = tasks.TASKS[args.task]
    samples = tasks.fixed_set(args.task, args.samples, args.length, 1000)
    ids = tasks.collate(samples, spec.pad)["input_ids"].to(device)
    shares: dict[str, list[list[float]]] = {}
    labels = args.labels or [models.saved_label(d, None) for d in args.model]
    for d, label in zip(args.model, labels):
        try:
            model = models.load_model(d, device)
            experiments.check_vocab(model, spec.vocab_size, d, args.task)
            shares[label] = retrieval.empty_rows(model, ids)
        except ValueError as err:
            p.error(f"--model {d}: {err}")
    proto = EXTRAPOLATION_PRESETS[args.preset]
    for kernel, kwargs in args.init:
        for seed in args.init_seed:
            torch.manual_seed(seed)
            name = model_label(kernel, kwargs)
            try:
                model = experiments.extrapolation_model(args.task, "mosaics", kernel, proto,
                                                        kwargs, args.length).to(device)
                shares[f"{name} s{seed}, init"] = retrieval.empty_rows(model, ids)
            except (KeyError, TypeError, ValueError) as err:
                p.error(f"--init {kernel}: {err}")
    print(retrieval.empty_rows_table(shares))
    return 0


# --- routes ------------------------------------------------------------------------------------

def _routes_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="[LABEL=]FILE",
                   help="MQMTAR training logs of Memory Mosaics runs: a sweep job's result "
                        "file (<out>/results/<job>.json), an extrapolation result file, or a "
                        "run's metrics.jsonl (readable while the run trains)")
    p.add_argument("--every", type=positive_int, default=1,
                   help="print every N-th validation of each run (default 1: all)")
    p.add_argument("--out", type=Path, help="PNG of the routes against the step (optional)")


def _route_histories(path: Path, label: str | None) -> dict[str, list[dict[str, Any]]]:
    """{run label: its history rows} of one result file or metrics.jsonl."""
    if path.suffix == ".jsonl":
        from ...training.metrics import read_metrics

        rows = read_metrics(path)
        # <out>/jobs/<job>/runs/<run>/metrics.jsonl in a sweep: the job's name says more
        job = path.parent.parent
        return {label or (job.parent.name if job.name == "runs" else path.parent.name): rows}
    data = json.loads(path.read_text())
    results = data.get("results", data)  # a sweep job's file wraps the experiment's results
    runs = results.get("runs") if isinstance(results, dict) else None
    if not runs:
        raise ValueError("not a result file (no 'runs')")
    out = {}
    for run in runs:
        name = label or f"{run['label']} s{results.get('seed', '?')}"
        out[name if len(runs) == 1 else f"{name} {run['label']}"] = run["train"]["history"]
    return out


def routes_command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from . import retrieval

    histories: dict[str, list[dict[str, Any]]] = {}
    for arg in args.files:
        label, sep, name = arg.partition("=")
        if Path(arg).is_file() or not sep:  # a bare path (which may hold an "=")
            label, name = "", arg
        path = Path(name)
        if not path.is_file():
            p.error(f"{path}: no such file")
        try:
            found = _route_histories(path, label or None)
        except (ValueError, KeyError, TypeError) as err:
            p.error(f"{path}: {err}")
        for run, rows in found.items():
            routes = retrieval.route_history(rows)
            if not routes:
                p.error(f"{path}: {run} logged no routes (only MQMTAR runs of Memory Mosaics "
                        "models trained with this version log them)")
            histories[run] = routes
    print(retrieval.routes_table({k: v[args.every - 1::args.every]
                                  for k, v in histories.items()}))
    if args.out:
        from ..plots import plot_routes

        plot_routes(histories, args.out)
        print(f"plot: {args.out}")
    return 0


COMMANDS = {
    "retrieval": (_retrieval_parser, retrieval_command,
                  "where the contextual memory looks: block mass, support and effective "
                  "support of the retrieval weights of saved task models, per test length"),
    "empty-rows": (_empty_rows_parser, empty_rows_command,
                   "the share of rows whose kernel weights no past entry (no output, no "
                   "gradient to keys or bandwidth), per head, of saved or freshly built models"),
    "routes": (_routes_parser, routes_command,
               "MQMTAR: which route of the recall a Memory Mosaics run takes during training "
               "(each path's best-head entry mass and the v1 / v2 accuracy per validation)"),
}
