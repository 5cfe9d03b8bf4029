"""Length extrapolation (Sort or MQMTAR): train on lengths U{32..64}, test at 64 x 2^k.

    python eval/extrapolation.py --task sort --kernel gaussian epanechnikov --preset cpu
    python eval/extrapolation.py --task sort --arch mosaics llama --kernel gaussian

Prints exact match per test length and model; writes <out>/results.json and
<out>/extrapolation.png. ``--model DIR ...`` scores saved models instead.
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
from mosaics.evaluation.experiments import EXTRAPOLATION_PRESETS as PRESETS  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["sort", "mqmtar"], required=True)
    p.add_argument("--arch", nargs="+", default=["mosaics"], choices=["mosaics", "llama"],
                   help="llama: the rotary-position transformer baseline of the same size")
    p.add_argument("--kernel", nargs="+", default=["gaussian"], help="Memory Mosaics kernels")
    p.add_argument("--kernel-kwargs", type=kernel_kwargs_arg, default=None)
    p.add_argument("--preset", choices=list(PRESETS), default="reference")
    p.add_argument("--steps", type=positive_int)
    p.add_argument("--warmup-frac", type=float, help="warm-up steps as a fraction of --steps")
    p.add_argument("--batch-size", type=positive_int)
    p.add_argument("--lr", type=float)
    p.add_argument("--eval-every", type=positive_int)
    p.add_argument("--multipliers", nargs="+", type=positive_int,
                   help="test lengths = 64 x these (reference: 1 2 4 8 16 32 64)")
    p.add_argument("--n-samples", type=positive_int, help="test samples per length")
    p.add_argument("--n-val", type=positive_int)
    p.add_argument("--n-layer", type=positive_int)
    p.add_argument("--n-embd", type=positive_int)
    p.add_argument("--n-head", type=positive_int)
    p.add_argument("--time-budget-min", type=float)
    p.add_argument("--model", nargs="+", help="score saved model directories instead of training")
    p.add_argument("--save-models", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="default runs/extrapolation-<task>")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    offline()
    check_model_dirs(p, args.model)
    if "mosaics" in args.arch and not args.model:
        check_kernels(p, args.kernel)

    from mosaics.evaluation import experiments, plots

    proto = experiments.with_overrides(
        experiments.EXTRAPOLATION_PRESETS[args.preset], steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, warmup_frac=args.warmup_frac,
        eval_every=args.eval_every,
        multipliers=tuple(args.multipliers) if args.multipliers else None,
        n_samples=args.n_samples, n_val=args.n_val, n_layer=args.n_layer, n_embd=args.n_embd,
        n_head=args.n_head,
        time_budget_s=None if args.time_budget_min is None else 60 * args.time_budget_min)
    out = Path(args.out or f"runs/extrapolation-{args.task}")
    try:
        results = experiments.run_extrapolation(
            args.task, args.kernel, proto, args.seed, args.kernel_kwargs,
            args.device or default_device(), out, args.save_models, args.model,
            not args.no_progress, args.arch)
    except ValueError as err:
        p.error(str(err))
    results["preset"] = args.preset
    experiments.write_json(out / "results.json", results)
    print(experiments.extrapolation_table(results))
    print(f"plot: {plots.plot_extrapolation(results, out / 'extrapolation.png')}")
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
