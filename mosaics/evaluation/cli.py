"""Every evaluation entry point: ``main([COMMAND, ...])`` (``mosaics eval COMMAND``, or the
scripts under ``eval/``, which call it). Each subcommand is a parser and a function that hands
the work to the modules of :mod:`mosaics.evaluation`.

``sweep`` runs task jobs (a grid, a job file or the paper's suite) through one engine
(:mod:`mosaics.evaluation.sweep`): each job runs in its own process (locally, or as a SLURM
array task with ``--executor slurm``), writes ``<out>/results/<name>.json``, and is skipped
when that file exists; the tables of everything under ``--out`` go to ``<out>/summary.md``.
``regbench`` and ``extrapolation`` are ``sweep`` with the task fixed and the protocol settings
as named flags. ``perplexity`` and ``compare-loss`` score and compare saved language models;
``paper-figure`` merges result files beside the paper's rows; ``retrieval``, ``empty-rows``
and ``routes`` are the research probes of :mod:`mosaics.evaluation.analysis`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..training.signals import EXIT_PREEMPTED
from .analysis import commands as analysis_commands
from .arguments import (
    check_model_dirs,
    default_device,
    kernel_kwargs_arg,
    labelled_path,
    positive_int,
    setting_arg,
)
from .protocols import EXTRAPOLATION_PRESETS


def offline() -> None:
    """Never reach the network at run time."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


# --- running jobs: the options and the run shared by sweep and its aliases --------------------

def add_engine_args(p: argparse.ArgumentParser, out: str) -> None:
    g = p.add_argument_group("running the jobs")
    g.add_argument("--out", default=out, help=f"results folder (default {out}); jobs with a "
                   "result file there are skipped, so rerunning resumes")
    g.add_argument("--device", default=None,
                   help="cpu or cuda (default: cuda if present; on SLURM cuda when "
                        "--gpus-per-job > 0)")
    g.add_argument("--jobs", type=positive_int, default=1,
                   help="local runner: processes at a time (they share the GPU)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="local runner: CPU threads per job (default: the cores split between "
                        "--jobs)")
    g.add_argument("--save-models", action="store_true",
                   help="save_pretrained each trained model under <out>/jobs/<name>/models")
    g.add_argument("--dry-run", action="store_true",
                   help="list the jobs with their state (done, running at step N, stopped at "
                        "a checkpoint, failed, todo) and exit")
    g.add_argument("--no-progress", action="store_true",
                   help="accepted for older command lines: jobs never draw progress bars "
                        "(their output goes to <out>/logs/<name>.log)")
    s = p.add_argument_group("scheduler (--executor slurm; values also from a job file's "
                             "'resources:')")
    s.add_argument("--executor", default="local", choices=["local", "slurm", "submitit-local"],
                   help="local: child processes here; slurm: one job array through submitit; "
                        "submitit-local: submitit's local processes (no scheduler)")
    s.add_argument("--partition", default=None)
    s.add_argument("--gpus-per-job", type=int, default=None)
    s.add_argument("--cpus-per-job", type=positive_int, default=None,
                   help="CPUs per array task (also the job's thread count)")
    s.add_argument("--time-min", type=positive_int, default=None,
                   help="time limit of each task in minutes")
    s.add_argument("--mem-gb", type=float, default=None)
    s.add_argument("--array-parallelism", type=positive_int, default=None,
                   help="array tasks running at once")
    s.add_argument("--slurm", type=setting_arg, action="append", default=[],
                   metavar="KEY=VALUE", help="further #SBATCH option, e.g. --slurm account=me "
                   "--slurm qos=high")


def run_engine(p: argparse.ArgumentParser, args: argparse.Namespace, jobs: list,
               notes: list[str], file_resources: dict | None = None) -> int:
    """List (``--dry-run``) or run ``jobs``, then print the merged tables; exit status 1 when
    a job failed."""
    from .cluster import Resources
    from .runner import job_state
    from .sweep import run_sweep
    from .tables import summarize

    out = Path(args.out)
    for note in notes:
        print(f"note: {note}")
    if args.dry_run:
        for job in jobs:
            print(job_state(out, job))
        return 0
    try:
        resources = Resources.from_mapping(file_resources, "job file 'resources'").merged(
            partition=args.partition, gpus_per_job=args.gpus_per_job,
            cpus_per_job=args.cpus_per_job, time_min=args.time_min, mem_gb=args.mem_gb,
            array_parallelism=args.array_parallelism, slurm=dict(args.slurm))
    except (ValueError, TypeError) as err:
        p.error(str(err))
    device = args.device
    if device is None:
        device = (("cuda" if resources.gpus_per_job else "cpu") if args.executor != "local"
                  else default_device())
    try:
        done = run_sweep(jobs, out, args.jobs, device, threads=args.threads,
                         executor=args.executor, resources=resources,
                         save_model=args.save_models)
    except (ImportError, RuntimeError) as err:
        p.error(str(err))
    print(summarize(out), end="")
    print(f"summary: {out / 'summary.md'}")
    if done["stopped"]:
        print(f"{len(done['stopped'])} job(s) stopped: "
              + ", ".join(j.name for j in done["stopped"])
              + "; run the same command again to resume them from their checkpoints",
              file=sys.stderr)
    if done["failed"]:
        print(f"{len(done['failed'])} job(s) failed: "
              + ", ".join(j.name for j in done["failed"]), file=sys.stderr)
        return 1
    return EXIT_PREEMPTED if done["stopped"] else 0


def run_grid(p: argparse.ArgumentParser, args: argparse.Namespace, tasks: list[str],
             models: list[str], sizes: list[int], settings: dict[str, Any],
             model_dirs: list[str] | None = None,
             config_changes: dict[str, Any] | None = None) -> int:
    """Run the jobs of tasks x models x ``--seed`` (x sizes for RegBench) under ``--preset``
    with the protocol ``settings`` and ``--kernel-kwargs``; with ``model_dirs``, the scoring
    jobs of tasks x saved models x ``--seed`` instead."""
    from .jobs import expand_jobs, saved_model_jobs

    try:
        if model_dirs:
            jobs = saved_model_jobs(tasks, model_dirs, args.seed, args.preset, settings,
                                    config_changes)
            notes: list[str] = []
        else:
            jobs, notes = expand_jobs(tasks, models, args.seed, sizes, args.preset, settings,
                                      args.kernel_kwargs)
    except (ValueError, TypeError, KeyError) as err:
        p.error(str(err))
    return run_engine(p, args, jobs, notes)


def merge_command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--merge``: copy the result files of other output folders into ``--out``, print the
    tables."""
    from .tables import merge_results, summarize

    try:
        copied = merge_results(args.merge, args.out)
    except ValueError as err:
        p.error(str(err))
    print(f"merged {copied} result file(s) into {args.out}")
    print(summarize(args.out), end="")
    print(f"summary: {Path(args.out) / 'summary.md'}")
    return 0


# --- sweep ----------------------------------------------------------------------------------

def _sweep_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", nargs="+", choices=["regbench", "sort", "mqmtar", "pretrain"])
    p.add_argument("--model", nargs="+", default=["mosaics/gaussian"],
                   help="mosaics/<kernel> (or just <kernel>), mosaics-v2/<kernel>, gpt2 "
                        "(RegBench only), llama")
    p.add_argument("--seed", nargs="+", type=int, default=[0])
    p.add_argument("--size", nargs="+", type=positive_int, default=[1000],
                   help="RegBench training automata (paper: 100 500 1000 2500 5000 10000 "
                        "20000 40000)")
    p.add_argument("--preset", default="reference",
                   help="protocol preset of each task (reference, cpu, ...)")
    p.add_argument("--set", dest="settings", type=setting_arg, action="append", default=[],
                   metavar="KEY=VALUE", help="protocol override, e.g. --set steps=2000 "
                   "--set multipliers=[1,2]; applied to the tasks whose protocol has KEY (with "
                   "--file: on top of each job's own settings)")
    p.add_argument("--kernel-kwargs", type=kernel_kwargs_arg, default=None)
    p.add_argument("--file", help="YAML/JSON job file (instead of --task ...)")
    p.add_argument("--suite", choices=["paper"], help="paper: every job of the sparse-kernel "
                   "paper's RegBench and extrapolation tables (with --preset, --set, --seed)")
    p.add_argument("--summary-only", action="store_true",
                   help="merge the results already under --out, run nothing")
    add_engine_args(p, "runs/sweep")


def sweep_command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .jobs import job_file_resources, load_job_file, paper_jobs
    from .tables import summarize

    if args.summary_only:
        print(summarize(args.out), end="")
        return 0
    if sum(map(bool, (args.file, args.task, args.suite))) != 1:
        p.error("give one of --task ..., --file JOBS.yaml or --suite paper")
    if args.task:
        return run_grid(p, args, args.task, args.model, args.size, dict(args.settings))
    resources: dict = {}
    try:
        if args.suite:
            jobs, notes = paper_jobs(args.seed, args.preset, dict(args.settings)), []
        else:
            ignored = ["--" + dest.replace("_", "-")
                       for dest in ("model", "seed", "size", "preset", "kernel_kwargs")
                       if getattr(args, dest) != p.get_default(dest)]
            if ignored:
                p.error(f"{', '.join(ignored)} choose a grid and do nothing with --file; put "
                        "them in the job file (defaults: or each job), or use --set "
                        "KEY=VALUE, which applies on top of the file's jobs")
            jobs, notes = load_job_file(args.file, dict(args.settings))
            resources = job_file_resources(args.file)
    except (ValueError, TypeError, KeyError) as err:
        p.error(str(err))
    return run_engine(p, args, jobs, notes, resources)


# --- regbench and extrapolation: sweep with the task fixed ------------------------------------
# Models are --arch x --kernel, or saved --model directories; each protocol flag is sweep's
# --set of the protocol field of the same name (--max-steps 7 is --set max_steps=7), in this
# order, and --time-budget-min M is --set time_budget_s=60M.

REGBENCH_SETTINGS = ("epochs", "max_steps", "batch_size", "lr", "eval_every", "n_val", "n_test",
                     "n_layer", "n_embd", "n_head", "pmem_size")
EXTRAPOLATION_SETTINGS = ("steps", "batch_size", "lr", "warmup_frac", "eval_every", "n_samples",
                          "n_val", "n_layer", "n_embd", "n_head", "multipliers")


def add_saved_model_args(p: argparse.ArgumentParser) -> None:
    """``--model DIR ...`` (score saved models instead of training) and ``--model-set``."""
    p.add_argument("--model", nargs="+", metavar="DIR",
                   help="score saved model directories instead of training")
    p.add_argument("--model-set", dest="config_changes", type=setting_arg, action="append",
                   default=[], metavar="KEY=VALUE",
                   help="with --model: change a field of each saved model's config before "
                        "scoring it, e.g. --model-set alibi=false (the same weights without "
                        "the position bias)")


def _models(archs: list[str], kernels: list[str]) -> list[str]:
    """``--arch`` x ``--kernel`` as sweep model names (``mosaics/<kernel>``, ``gpt2``, ...)."""
    from .models import is_mosaics

    models: list[str] = []
    for arch in archs:
        models += [f"{arch}/{k}" for k in kernels] if is_mosaics(arch) else [arch]
    return models


def run_alias(p: argparse.ArgumentParser, args: argparse.Namespace, tasks: list[str],
              sizes: list[int], names: tuple[str, ...]) -> int:
    """An alias's command line as sweep's: the protocol flags ``names`` as settings."""
    check_model_dirs(p, args.model, args.config_changes)
    settings = {name: getattr(args, name) for name in names}
    if args.time_budget_min is not None:
        settings["time_budget_s"] = 60 * args.time_budget_min
    settings = {k: v for k, v in settings.items() if v is not None}
    return run_grid(p, args, tasks, _models(args.arch, args.kernel), sizes, settings,
                    args.model, dict(args.config_changes))


def _regbench_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", nargs="+", default=["mosaics"],
                   choices=["mosaics", "mosaics-v2", "gpt2", "llama"])
    p.add_argument("--kernel", nargs="+", default=["gaussian"], help="Memory Mosaics kernels")
    p.add_argument("--kernel-kwargs", type=kernel_kwargs_arg, default=None)
    p.add_argument("--sizes", nargs="+", type=positive_int, default=[1000],
                   help="training automata (paper: 100 500 1000 2500 5000 10000 20000 40000)")
    p.add_argument("--preset", choices=["reference", "cpu"], default="reference")
    p.add_argument("--seed", nargs="+", type=int, default=[0], help="one job per seed")
    for flag in ("--epochs", "--max-steps", "--batch-size", "--eval-every", "--n-val",
                 "--n-test", "--n-layer", "--n-embd", "--n-head", "--pmem-size"):
        p.add_argument(flag, type=positive_int)
    p.add_argument("--lr", type=float)
    p.add_argument("--time-budget-min", type=float, help="stop each training run after this")
    add_saved_model_args(p)
    p.add_argument("--merge", nargs="+", metavar="OUT_DIR",
                   help="copy the result files of other --out folders into --out and print "
                        "the merged tables (runs nothing)")
    add_engine_args(p, "runs/regbench")


def regbench_command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``sweep --task regbench --size SIZES ...``."""
    if args.merge:
        return merge_command(p, args)
    return run_alias(p, args, ["regbench"], args.sizes, REGBENCH_SETTINGS)


def _extrapolation_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", nargs="+", choices=["sort", "mqmtar"], required=True)
    p.add_argument("--arch", nargs="+", default=["mosaics"],
                   choices=["mosaics", "mosaics-v2", "llama"],
                   help="llama: the rotary-position transformer baseline of the same size")
    p.add_argument("--kernel", nargs="+", default=["gaussian"], help="Memory Mosaics kernels")
    p.add_argument("--kernel-kwargs", type=kernel_kwargs_arg, default=None)
    p.add_argument("--preset", choices=list(EXTRAPOLATION_PRESETS), default="reference")
    p.add_argument("--seed", nargs="+", type=int, default=[0], help="one job per seed")
    for flag in ("--steps", "--batch-size", "--eval-every", "--n-samples", "--n-val",
                 "--n-layer", "--n-embd", "--n-head"):
        p.add_argument(flag, type=positive_int)
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup-frac", type=float, help="warm-up steps as a fraction of --steps")
    p.add_argument("--multipliers", nargs="+", type=positive_int,
                   help="test lengths = 64 x these (reference: 1 2 4 8 16 32 64)")
    p.add_argument("--time-budget-min", type=float)
    add_saved_model_args(p)
    add_engine_args(p, "runs/extrapolation")


def extrapolation_command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``sweep --task sort|mqmtar ...``."""
    return run_alias(p, args, args.task, [], EXTRAPOLATION_SETTINGS)


# --- perplexity --------------------------------------------------------------------------------

def _perplexity_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="saved model directory (config.json + weights + tokenizer)")
    p.add_argument("--data", required=True, help="evaluation text source or .npy token stream")
    p.add_argument("--split", default="validation")
    p.add_argument("--text-column", default="text")
    p.add_argument("--block-size", type=positive_int,
                   help="window length (default: the model's block_size / n_positions)")
    p.add_argument("--max-windows", type=positive_int, default=64)
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="output folder (default: the model directory)")
    p.add_argument("--no-progress", action="store_true")


def perplexity_command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_model_dirs(p, [args.model])
    data = Path(args.data).expanduser()
    if data.suffix in (".npy", ".txt", ".jsonl", ".json") and not data.exists():
        p.error(f"--data {args.data}: no such file")

    from . import lm, models, plots
    from .jobs import write_json

    device = args.device or default_device()
    model = models.load_model(args.model, device)
    block = (args.block_size or getattr(model.config, "block_size", None)
             or lm.context_length(model))
    limit = lm.context_length(model)
    if limit is not None and block > limit:
        p.error(f"--block-size {block} exceeds this model's {limit} learned positions")
    try:
        tokens = lm.load_tokens(args.data, args.model, args.split, args.text_column)
        wins = lm.windows(tokens, block, args.max_windows, args.seed)
        result = lm.evaluate_windows(model, wins, args.batch_size, device,
                                     not args.no_progress)
    except (ValueError, OSError) as err:
        p.error(str(err))
    result.update(model=str(args.model), data=str(args.data), split=args.split)
    out = Path(args.out or args.model)
    write_json(out / "perplexity.json", result)
    plot = plots.plot_loss_by_position(result["loss_by_position"], out / "loss_by_position.png",
                                       f"{Path(args.model).name}: loss by position")
    print(f"windows {result['windows']} x {block} tokens ({result['tokens_scored']} scored)")
    print(f"loss {result['loss']:.4f}  perplexity {result['perplexity']:.3f}")
    print("mean loss over the first 10% / middle 10% / last 10% of positions: "
          + " / ".join(f"{x:.3f}" for x in lm.position_tenths(result["loss_by_position"])))
    print(f"results: {out / 'perplexity.json'}\nplot: {plot}")
    return 0



# --- needle ------------------------------------------------------------------------------------

def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _needle_parser(p: argparse.ArgumentParser) -> None:
    from .needle import DEPTHS, MULTIPLIERS

    p.add_argument("model", help="saved model directory (config.json + weights + tokenizer)")
    p.add_argument("--data", default=None,
                   help="text source whose validation split builds the haystack (default: the "
                        "built-in story corpus; another corpus gets the passkey prompts)")
    p.add_argument("--corpus-seed", type=int, default=0,
                   help="seed of the built-in story corpus the model trained on")
    p.add_argument("--lengths", type=_float_list,
                   default=list(MULTIPLIERS), metavar="M1,M2,...",
                   help="prompt lengths as multiples of the training length (default "
                        f"{','.join(map(str, MULTIPLIERS))})")
    p.add_argument("--depths", type=_float_list, default=list(DEPTHS), metavar="D1,D2,...",
                   help="depths of the gold fact in [0, 1] (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--prompts", type=positive_int, default=None,
                   help="prompts per cell (default 100 on a GPU, 20 on the CPU)")
    p.add_argument("--facts", type=positive_int, default=3,
                   help="facts per prompt, the gold one included (default 3)")
    p.add_argument("--mode", choices=("auto", "story", "passkey"), default="auto")
    p.add_argument("--no-controls", action="store_true",
                   help="skip the no-gold and recent-window control cells")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="the training length (default: the config's block_size / n_positions; "
                        "needed for rotary models, whose config does not record it)")
    p.add_argument("--model-set", dest="config_changes", type=setting_arg, action="append",
                   default=[], metavar="KEY=VALUE",
                   help="change a field of the saved config first (a test-time ablation), e.g. "
                        "--model-set long_term_gap=1000000000 (v2 without its long-term memory)")
    p.add_argument("--loss-multiplier", type=int, default=16,
                   help="loss by position in windows of this many training lengths (0: skip)")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None,
                   help="output folder (default: <model>/recall); existing cells are kept")
    p.add_argument("--no-progress", action="store_true")


def needle_command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_model_dirs(p, [args.model], args.config_changes)
    if any(not 0 <= d <= 1 for d in args.depths):
        p.error(f"--depths must lie in [0, 1], got {args.depths}")
    from ..data.loading import DataError
    from ..errors import InputError
    from . import recall_probe
    from .needle import CONTROLS, NeedleError

    device = args.device or default_device()
    prompts = args.prompts or (100 if device.startswith("cuda") else 20)
    out = Path(args.out or Path(args.model) / "recall")
    try:
        result = recall_probe.probe(
            args.model, out, args.data, args.lengths, args.depths, prompts, args.facts,
            args.seed, args.batch_size, () if args.no_controls else CONTROLS, args.mode,
            loss_multiplier=args.loss_multiplier, device=device,
            progress=not args.no_progress, corpus_seed=args.corpus_seed,
            block_size=args.block_size, config_changes=dict(args.config_changes))
    except (NeedleError, DataError, InputError, OSError) as err:
        p.error(str(err))
    print(recall_probe.markdown(result))
    print(f"results: {out / 'recall.json'} (cells: {out / 'cells'})\n"
          f"heatmap: {out / 'needle_heatmap.png'}")
    return 0


# --- compare-loss ------------------------------------------------------------------------------

def _compare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", type=labelled_path, help="LABEL=path/to/perplexity.json")
    p.add_argument("--out", type=Path, help="PNG of the loss by position (optional)")
    p.add_argument("--title", default="loss by position")


def compare_command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from . import lm
    from .plots import plot_loss_by_position

    results = {}
    for label, path in args.runs:
        if not path.is_file():
            p.error(f"{path}: no such file; run the perplexity command first")
        results[label] = json.loads(path.read_text())
    print(lm.loss_table(results))
    if args.out:
        plot_loss_by_position({k: r["loss_by_position"] for k, r in results.items()}, args.out,
                              args.title)
        print(f"plot: {args.out}")
    return 0


# --- paper-figure ------------------------------------------------------------------------------

def _paper_figure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", type=Path, metavar="FILE",
                   help="sweep result files of one task (<out>/results/<job>.json), from any "
                        "number of sweeps and settings; runs with the same model label are "
                        "seeds of one row")
    p.add_argument("--out", type=Path, help="PNG: one panel per model against the paper's "
                                            "row (optional)")


def paper_figure_command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .tables import extrapolation_markdown, extrapolation_rows

    records = []
    for path in args.files:
        if not path.is_file():
            p.error(f"{path}: no such file")
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or "job" not in record or "results" not in record:
            p.error(f"{path}: not a sweep result file (no 'job' and 'results'); pass the "
                    "files under <out>/results of a sweep")
        records.append(record)
    tasks = sorted({rec["job"]["task"] for rec in records})
    if len(tasks) != 1 or tasks[0] == "regbench":
        p.error(f"the files hold tasks {tasks}: pass results of one extrapolation task "
                "(sort or mqmtar)")
    merged = extrapolation_rows(records)
    print("exact match by test length, mean ± std over seeds; the paper's in parentheses\n")
    print(extrapolation_markdown(merged))
    print("\ntoken accuracy by test length\n")
    print(extrapolation_markdown(merged, "token_accuracy"))
    if args.out:
        from .plots import plot_against_paper

        print(f"plot: {plot_against_paper(merged, args.out)}")
    return 0


COMMANDS = {
    "regbench": (_regbench_parser, regbench_command,
                 "RegBench: train and score models (accuracy / TVD per training size, n-gram "
                 "and oracle rows), one job per (model, size, seed)"),
    "extrapolation": (_extrapolation_parser, extrapolation_command,
                      "length extrapolation (Sort, MQMTAR): train on lengths 32..64, exact "
                      "match at 64 x multipliers, one job per (task, model, seed)"),
    "perplexity": (_perplexity_parser, perplexity_command,
                   "validation loss, perplexity and loss by position of a saved causal LM"),
    "needle": (_needle_parser, needle_command,
               "recall beyond the training length: a multi-key needle (the story corpus's "
               "facts, or a passkey) at lengths x depths, with controls; JSON per cell, "
               "heatmap, table"),
    "sweep": (_sweep_parser, sweep_command,
              "any grid of task jobs (--task x --model x --seed x --size), a job file, or the "
              "paper's suite; --summary-only merges what is under --out"),
    **analysis_commands.COMMANDS,
    "compare-loss": (_compare_parser, compare_command,
                     "table and figure of the loss by position of several perplexity.json"),
    "paper-figure": (_paper_figure_parser, paper_figure_command,
                     "Sort / MQMTAR: one table and one figure (a panel per model) of result "
                     "files from any sweeps, seeds merged, beside the paper's rows"),
}


STANDARD_BENCHMARKS = """\
standard LM benchmarks (HellaSwag, ARC, PIQA, ...): a saved model runs in lm-evaluation-harness
as a Hugging Face model, batched generation included (docs/evaluation.md, "Standard
benchmarks with lm-evaluation-harness"):
  lm_eval --model hf --model_args pretrained=runs/default/final,trust_remote_code=True \\
      --tasks hellaswag,arc_easy --batch_size 8"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mosaics eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=STANDARD_BENCHMARKS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_args, run, text) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        add_args(p)
        p.set_defaults(run=run, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one evaluation command; returns the exit status (argument errors exit with 2)."""
    args = build_parser().parse_args(argv)
    offline()
    return int(args.run(args.parser, args) or 0)


if __name__ == "__main__":
    sys.exit(main())
