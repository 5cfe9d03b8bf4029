"""Pre-tokenize a corpus into the cache and print what it holds.

    python data/prepare.py                              # built-in procedural story corpus
    python data/prepare.py --source data/babistories    # folder with traindataset.txt ...
    python data/prepare.py --source docs.jsonl --text-column body --skip-malformed
    python data/prepare.py --measure                    # + in-context recall oracle report

Training calls ``prepare_corpus`` with the same arguments and finds everything cached.
"""

from __future__ import annotations

import argparse
import logging
import time

from mosaics.data import context_oracle_report, generate_story_records, prepare_corpus
from mosaics.data.corpus import default_cache_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--source", default=None, help="file, folder, saved dataset or hub id")
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder (default: train)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--val-fraction", type=float, default=0.005)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None, help=f"default {default_cache_dir()}")
    p.add_argument("--num-proc", type=int, default=1)
    p.add_argument("--text-column", default="text")
    p.add_argument("--skip-malformed", action="store_true")
    p.add_argument("--num-train-stories", type=int, default=20000)
    p.add_argument("--save-tokenizer", default=None, help="also save the tokenizer here")
    p.add_argument(
        "--measure",
        action="store_true",
        help="print how well context predicts the recall answers of generated stories",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    t0, c0 = time.perf_counter(), time.process_time()
    corpus = prepare_corpus(
        source=args.source,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        seed=args.seed,
        cache_dir=args.cache_dir,
        num_proc=args.num_proc,
        text_column=args.text_column,
        skip_malformed=args.skip_malformed,
        num_train_stories=args.num_train_stories,
    )
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    eos = corpus.eos_token_id
    print(f"source        {corpus.source}")
    print(f"vocab size    {corpus.vocab_size} (eos id {eos})")
    for name, tokens in (("train", corpus.train_tokens), ("validation", corpus.val_tokens)):
        docs = int((tokens == eos).sum())
        print(f"{name:<13} {len(tokens):,} tokens, {docs:,} documents, dtype {tokens.dtype}")
    print(f"prepared in   {dt:.2f} s wall, {cpu:.2f} s CPU (this process, all threads)")
    if args.save_tokenizer:
        corpus.tokenizer.save_pretrained(args.save_tokenizer)
        print(f"tokenizer     saved to {args.save_tokenizer}")
    if args.measure:
        train = generate_story_records(5000, seed=args.seed)
        test = generate_story_records(2000, seed=args.seed + 1)
        r = context_oracle_report(train, test)
        print("\nrecall answers of 2000 generated stories (word level; 5000 train stories):")
        print(f"{'predictor':<10} {'accuracy':>9} {'NLL (nats)':>11}")
        for name in ("global", "context", "assoc"):
            print(f"{name:<10} {r[name + '_acc']:>9.3f} {r[name + '_nll']:>11.3f}")


if __name__ == "__main__":
    main()
