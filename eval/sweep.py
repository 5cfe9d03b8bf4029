"""Run many task experiments (RegBench, Sort, MQMTAR) as separate processes and merge them.

    python eval/sweep.py --task sort --model mosaics/gaussian mosaics/epanechnikov llama \
        --seed 0 1 2 --preset cpu --jobs 2 --out runs/sweep
    python eval/sweep.py --task regbench --model mosaics/gaussian gpt2 --size 1000 5000 \
        --preset cpu --set max_steps=100
    python eval/sweep.py --file jobs.yaml --jobs 4 --device cuda --out runs/mine
    python eval/sweep.py --suite paper --jobs 8 --device cuda --out runs/paper
    python eval/sweep.py --out runs/sweep --summary-only

Jobs are the cartesian product of --task x --model x --seed (x --size for RegBench), come
from --file (YAML/JSON), or are the paper's tables (--suite paper). Each job writes
<out>/results/<name>.json; jobs that already have one are skipped, so rerunning a stopped
sweep resumes it. The merged tables go to stdout and
<out>/summary.md, the figures next to it. Exit status 1 when a job failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mosaics.evaluation.cli import (  # noqa: E402
    default_device,
    kernel_kwargs_arg,
    offline,
    positive_int,
)


def setting_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE read as YAML (numbers, lists, null)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip().replace("-", "_"), yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise argparse.ArgumentTypeError(f"--set {text}: {err}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", nargs="+", choices=["regbench", "sort", "mqmtar"])
    p.add_argument("--model", nargs="+", default=["mosaics/gaussian"],
                   help="mosaics/<kernel> (or just <kernel>), gpt2 (RegBench only), llama")
    p.add_argument("--seed", nargs="+", type=int, default=[0])
    p.add_argument("--size", nargs="+", type=positive_int, default=[1000],
                   help="RegBench training automata (paper: 100 500 1000 2500 5000 10000 "
                        "20000 40000)")
    p.add_argument("--preset", default="reference",
                   help="protocol preset of each task (reference, cpu, ...)")
    p.add_argument("--set", dest="settings", type=setting_arg, action="append", default=[],
                   metavar="KEY=VALUE", help="protocol override, e.g. --set steps=2000 "
                   "--set multipliers=[1,2]; applied to the tasks whose protocol has KEY")
    p.add_argument("--kernel-kwargs", type=kernel_kwargs_arg, default=None)
    p.add_argument("--file", help="YAML/JSON job file (instead of --task ...)")
    p.add_argument("--suite", choices=["paper"], help="paper: every job of the sparse-kernel "
                   "paper's RegBench and extrapolation tables (with --preset, --set, --seed)")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="processes at a time; each gets max(1, cores // N) threads")
    p.add_argument("--device", default=None, help="cpu or cuda (jobs share the GPU)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads per job (default: the cores split between --jobs); set it "
                        "when other work shares the machine")
    p.add_argument("--out", default="runs/sweep")
    p.add_argument("--dry-run", action="store_true", help="list the jobs and exit")
    p.add_argument("--summary-only", action="store_true",
                   help="merge the results already under --out, run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    offline()
    from mosaics.evaluation import sweep

    out = Path(args.out)
    if args.summary_only:
        print(sweep.summarize(out), end="")
        return 0
    if sum(map(bool, (args.file, args.task, args.suite))) != 1:
        p.error("give one of --task ..., --file JOBS.yaml or --suite paper")
    try:
        if args.suite:
            jobs, notes = sweep.paper_jobs(args.seed, args.preset, dict(args.settings)), []
        elif args.file:
            jobs, notes = sweep.load_job_file(args.file)
        else:
            jobs, notes = sweep.expand_jobs(args.task, args.model, args.seed, args.size,
                                            args.preset, dict(args.settings), args.kernel_kwargs)
    except (ValueError, TypeError, KeyError) as err:
        p.error(str(err))
    for note in notes:
        print(f"note: {note}")
    if args.dry_run:
        for job in jobs:
            state = "done" if sweep.result_path(out, job).exists() else "todo"
            print(f"{state}  {job.name}")
        return 0
    done = sweep.run_sweep(jobs, out, args.jobs, args.device or default_device(),
                           threads=args.threads)
    print(sweep.summarize(out), end="")
    print(f"summary: {out / 'summary.md'}")
    if done["failed"]:
        print(f"{len(done['failed'])} job(s) failed: "
              + ", ".join(j.name for j in done["failed"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
