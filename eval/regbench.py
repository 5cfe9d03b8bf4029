"""RegBench: train and score Memory Mosaics (any kernel) and a GPT-2 baseline.

    python eval/regbench.py --preset cpu --sizes 1000 --arch mosaics gpt2 \
        --kernel gaussian epanechnikov --out runs/regbench

Prints accuracy / TVD per training size (n-gram and oracle rows included) and writes
<out>/results.json and <out>/regbench.png. ``--model DIR ...`` scores saved models instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mosaics.evaluation.cli import (  # noqa: E402
    check_kernels,
    check_model_dirs,
    default_device,
    kernel_kwargs_arg,
    offline,
    positive_int,
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=["mosaics"], choices=["mosaics", "gpt2", "llama"])
    p.add_argument("--kernel", nargs="+", default=["gaussian"], help="Memory Mosaics kernels")
    p.add_argument("--kernel-kwargs", type=kernel_kwargs_arg, default=None)
    p.add_argument("--sizes", nargs="+", type=positive_int, default=[1000],
                   help="training automata (paper: 100 500 1000 2500 5000 10000 20000 40000)")
    p.add_argument("--preset", choices=["reference", "cpu"], default="reference")
    p.add_argument("--epochs", type=positive_int)
    p.add_argument("--max-steps", type=positive_int)
    p.add_argument("--batch-size", type=positive_int)
    p.add_argument("--lr", type=float)
    p.add_argument("--eval-every", type=positive_int, help="validation every N steps")
    p.add_argument("--n-val", type=positive_int)
    p.add_argument("--n-test", type=positive_int)
    p.add_argument("--n-layer", type=positive_int)
    p.add_argument("--n-embd", type=positive_int)
    p.add_argument("--n-head", type=positive_int)
    p.add_argument("--pmem-size", type=positive_int)
    p.add_argument("--time-budget-min", type=float, help="stop each training run after this")
    p.add_argument("--model", nargs="+", help="score saved model directories instead of training")
    p.add_argument("--merge", nargs="+", metavar="RESULTS_JSON",
                   help="combine results.json files of separate runs into one table and plot")
    p.add_argument("--save-models", action="store_true", help="save_pretrained each trained model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default="runs/regbench")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    offline()
    if args.merge:
        return merge(p, args)
    check_model_dirs(p, args.model)
    if "mosaics" in args.arch and not args.model:
        check_kernels(p, args.kernel)

    from mosaics.evaluation import experiments, plots

    proto = experiments.with_overrides(
        experiments.REGBENCH_PRESETS[args.preset], epochs=args.epochs, max_steps=args.max_steps,
        batch_size=args.batch_size, lr=args.lr, eval_every=args.eval_every, n_val=args.n_val,
        n_test=args.n_test, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
        pmem_size=args.pmem_size,
        time_budget_s=None if args.time_budget_min is None else 60 * args.time_budget_min)
    try:
        results = experiments.run_regbench(
            args.arch, args.kernel, sorted(args.sizes), proto, args.seed, args.kernel_kwargs,
            args.device or default_device(), args.out, args.save_models, args.model,
            not args.no_progress)
    except ValueError as err:
        p.error(str(err))
    results["preset"] = args.preset
    out = Path(args.out)
    experiments.write_json(out / "results.json", results)
    print(experiments.regbench_table(results))
    if any(r["size"] is not None for r in results["runs"]):
        print(f"plot: {plots.plot_regbench(results, out / 'regbench.png')}")
    print(f"results: {out / 'results.json'}")


def merge(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    import json

    from mosaics.evaluation import experiments, plots

    parts = []
    for path in args.merge:
        try:
            parts.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as err:
            p.error(f"--merge {path}: cannot read results ({err})")
    try:
        results = experiments.merge_regbench(parts)
    except ValueError as err:
        p.error(str(err))
    out = Path(args.out)
    experiments.write_json(out / "results.json", results)
    print(experiments.regbench_table(results))
    print(f"plot: {plots.plot_regbench(results, out / 'regbench.png')}")
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
