"""Validation loss, perplexity and loss by position of a saved causal LM.

    python eval/perplexity.py runs/model --data path/to/valdataset.txt --block-size 4096

``--data``: anything mosaics.data accepts (BabiStories folder or file, saved dataset,
.txt/.jsonl) tokenized with the model directory's tokenizer, or a .npy token stream.
Writes <out>/perplexity.json and <out>/loss_by_position.png (out defaults to the model dir).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mosaics.evaluation.cli import (  # noqa: E402
    check_model_dirs,
    default_device,
    offline,
    positive_int,
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = p.parse_args(argv)
    offline()
    check_model_dirs(p, [args.model])
    data = Path(args.data).expanduser()
    if data.suffix in (".npy", ".txt", ".jsonl", ".json") and not data.exists():
        p.error(f"--data {args.data}: no such file")

    from mosaics.evaluation import experiments, lm, models, plots

    device = args.device or default_device()
    model = models.load_model(args.model, device)
    cfg = model.config
    block = args.block_size or getattr(cfg, "block_size", None) or lm.context_length(model)
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
    experiments.write_json(out / "perplexity.json", result)
    plot = plots.plot_loss_by_position(result["loss_by_position"], out / "loss_by_position.png",
                                       f"{Path(args.model).name}: loss by position")
    lbp = result["loss_by_position"]
    n = len(lbp)
    tenth = max(1, n // 10)
    spans = [(0, tenth), (max(0, (n - tenth) // 2), max(0, (n - tenth) // 2) + tenth),
             (n - tenth, n)]
    q = [sum(lbp[a:b]) / (b - a) for a, b in spans]
    print(f"windows {result['windows']} x {block} tokens ({result['tokens_scored']} scored)")
    print(f"loss {result['loss']:.4f}  perplexity {result['perplexity']:.3f}")
    print("mean loss over the first 10% / middle 10% / last 10% of positions: "
          + " / ".join(f"{x:.3f}" for x in q))
    print(f"results: {out / 'perplexity.json'}\nplot: {plot}")


if __name__ == "__main__":
    main()
