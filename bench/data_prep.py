"""What preparing a pretraining corpus costs: time, disk and memory per stage, scaled to
BabiStories' size (474.7M GPT-2 tokens of training text, about 2.0 GB).

    OMP_NUM_THREADS=1 python bench/data_prep.py --megabytes 100
    OMP_NUM_THREADS=1 python bench/data_prep.py --megabytes 100 --num-proc 2

A synthetic corpus of ``--megabytes`` of story text in BabiStories' file format (one JSON string
per line) is written to a temporary folder, then prepared stage by stage exactly as
``prepare_corpus`` does: text -> Arrow (memory-mapped), byte-level BPE training, tokenization
into one ``.npy`` token stream that every training process memory-maps. Each stage streams
(Arrow record batches, then the token stream chunk by chunk), so memory stays flat in the
corpus size; the table reports the peak resident memory to show it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path

BABI_TRAIN_TOKENS = 474.7e6  # GPT-2 tokens in BabiStories' training split
BABI_TRAIN_BYTES = 2.0e9  # its training text, about 4.2 bytes per GPT-2 token


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


class AnonPeak:
    """Peak anonymous resident memory (``RssAnon``: heap, not file pages), sampled every
    50 ms by a thread while the ``with`` block runs (this process only)."""

    def __enter__(self) -> AnonPeak:
        self.peak, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.is_set():
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    self.peak = max(self.peak, int(line.split()[1]) / 1024)
            self._stop.wait(0.05)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def write_corpus(path: Path, megabytes: float, seed: int) -> tuple[int, int]:
    """Stories in BabiStories' format until ``megabytes`` of text; returns (stories, bytes)."""
    from mosaics.data import generate_stories

    target, written, stories, batch = megabytes * 1e6, 0, 0, 0
    with open(path, "w", encoding="utf-8") as handle:
        while written < target:
            for story in generate_stories(5000, seed=seed + batch):
                line = json.dumps(story) + "\n"
                handle.write(line)
                written += len(line.encode())
                stories += 1
            batch += 1
    return stories, written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megabytes", type=float, default=100.0, help="training text to generate")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--num-proc", type=int, default=1, help="tokenization processes")
    p.add_argument("--workdir", default=None, help="default: a temporary folder (removed)")
    args = p.parse_args()

    from mosaics.data import load_texts, tokenize_to_stream, train_bpe_tokenizer

    work = Path(args.workdir or tempfile.mkdtemp(prefix="mosaics-prep-"))
    source, cache = work / "source", work / "cache"
    source.mkdir(parents=True, exist_ok=True)
    rows = []

    t = time.perf_counter()
    stories, text_bytes = write_corpus(source / "traindataset.txt", args.megabytes, seed=0)
    rows.append(("write synthetic text", time.perf_counter() - t, text_bytes, None, None))

    t = time.perf_counter()
    with AnonPeak() as heap:
        ds = load_texts(str(source), "train", cache_dir=str(cache / "datasets"))
    rows.append(("text -> Arrow", time.perf_counter() - t, folder_bytes(cache / "datasets"),
                 peak_rss_mb(), heap.peak))

    t = time.perf_counter()
    with AnonPeak() as heap:
        texts = (ds[i: i + 1000]["text"] for i in range(0, len(ds), 1000))
        tokenizer = train_bpe_tokenizer((x for chunk in texts for x in chunk), args.vocab_size)
    rows.append((f"BPE training (vocab {args.vocab_size})", time.perf_counter() - t, None,
                 peak_rss_mb(), heap.peak))

    t = time.perf_counter()
    with AnonPeak() as heap:
        tokens = tokenize_to_stream(ds, tokenizer, num_proc=args.num_proc,
                                    cache_dir=cache / "tokens")
    stream_bytes = sum(f.stat().st_size for f in (cache / "tokens").glob("tokens-*.npy"))
    rows.append((f"tokenize -> .npy ({args.num_proc} proc)", time.perf_counter() - t,
                 folder_bytes(cache / "datasets") - rows[1][2] + stream_bytes, peak_rss_mb(),
                 heap.peak))

    n_tokens = len(tokens)
    scale = BABI_TRAIN_BYTES / text_bytes
    print(f"corpus: {stories:,} stories, {text_bytes / 1e6:.1f} MB of text, {n_tokens:,} tokens "
          f"({text_bytes / n_tokens:.2f} bytes/token, stream {tokens.dtype})")
    print(f"scale to BabiStories' training text (~{BABI_TRAIN_BYTES / 1e9:.1f} GB, "
          f"{BABI_TRAIN_TOKENS / 1e6:.0f}M GPT-2 tokens): x{scale:.1f} by text bytes\n")
    print("peak RSS counts the memory-mapped file pages read (reclaimable); heap is the peak "
          "anonymous memory of this process during the stage\n")
    print(f"{'stage':<32}{'seconds':>9}{'disk MB':>10}{'peak RSS MB':>13}{'heap MB':>9}"
          f"{'scaled s':>10}{'scaled GB':>11}")
    for name, seconds, disk, rss, anon in rows:
        disk_mb = f"{disk / 1e6:.0f}" if disk is not None else "-"
        scaled_gb = f"{disk * scale / 1e9:.1f}" if disk is not None else "-"
        rss_mb = f"{rss:.0f}" if rss is not None else "-"
        anon_mb = f"{anon:.0f}" if anon is not None else "-"
        print(f"{name:<32}{seconds:>9.1f}{disk_mb:>10}{rss_mb:>13}{anon_mb:>9}"
              f"{seconds * scale:>10.0f}{scaled_gb:>11}")
    total = sum(r[1] for r in rows[1:])
    print(f"{'prepare (all but writing)':<32}{total:>9.1f}{'':>10}{'':>13}{'':>9}"
          f"{total * scale:>10.0f}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
