"""One call from a data source to train/validation token streams and a tokenizer."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .loading import MissingSplitError, load_texts
from .storygen import make_default_corpus
from .stream import tokenize_to_stream
from .tokenizer import load_tokenizer, train_bpe_tokenizer

__all__ = ["Corpus", "default_cache_dir", "prepare_corpus"]

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$MOSAICS_CACHE`` if set, else ``~/.cache/mosaics``."""
    return Path(os.environ.get("MOSAICS_CACHE", "~/.cache/mosaics")).expanduser()


@dataclass
class Corpus:
    """Token streams (1-D, documents separated by eos) and the tokenizer that made them."""

    train_tokens: np.ndarray
    val_tokens: np.ndarray
    tokenizer: object
    source: str

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id


def _carve_validation(ds, val_fraction: float, seed: int):
    """Split documents into (train, validation), seeded; at least one doc on each side."""
    n = len(ds)
    if n < 2:
        raise ValueError(
            f"the source has {n} document(s): need at least 2 to carve out a validation split"
        )
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    parts = ds.train_test_split(test_size=n_val, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def _save_tokenizer_atomic(tok, target: Path) -> None:
    """save_pretrained into a temporary sibling folder, then rename it to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        tok.save_pretrained(str(tmp))
        os.rename(tmp, target)
    except OSError:
        if not (target / "tokenizer.json").is_file():  # not another process winning the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _iter_texts(ds, batch_size: int = 1000):
    for i in range(0, len(ds), batch_size):
        yield from ds[i : i + batch_size]["text"]


def prepare_corpus(
    source: str | None = None,
    tokenizer: str | None = None,
    vocab_size: int = 4096,
    val_fraction: float = 0.005,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int = 1,
    text_column: str = "text",
    skip_malformed: bool = False,
    num_train_stories: int = 20000,
    num_val_stories: int | None = None,
) -> Corpus:
    """Load ``source``, get a tokenizer, and tokenize both splits (everything cached).

    Args:
        source: anything ``load_texts`` accepts; ``None`` = the built-in procedural story
            corpus (``num_train_stories`` train stories, ``num_val_stories`` validation
            stories, default max(100, num_train_stories // 20)), generated into the cache.
        tokenizer: a local tokenizer folder / cached hub id; ``None`` trains a byte-level BPE
            of ``vocab_size`` on the training text (cached, keyed by data and vocab size).
        val_fraction: share of documents carved out (seeded) when the source has no
            validation split.
        cache_dir: root of all caches (default ``default_cache_dir()``).
    """
    t0 = time.perf_counter()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    hf_cache = str(root / "datasets")
    if source is None:
        n_val = num_val_stories
        if n_val is None:
            n_val = max(100, num_train_stories // 20)
        out = root / "storygen" / f"seed{seed}-train{num_train_stories}-val{n_val}"
        make_default_corpus(out, num_train=num_train_stories, num_val=n_val, seed=seed)
        source = str(out)
        log.info("story corpus ready in %s (%.1f s)", out, time.perf_counter() - t0)
    # local sources are converted to Arrow under the cache root; hub datasets stay in the
    # standard Hugging Face cache, where an offline machine may already hold them
    local = Path(source).expanduser().exists()
    kwargs = dict(
        text_column=text_column,
        skip_malformed=skip_malformed,
        cache_dir=hf_cache if local else None,
    )
    train_ds = load_texts(source, "train", **kwargs)
    try:
        val_ds = load_texts(source, "validation", **kwargs)
    except MissingSplitError:
        train_ds, val_ds = _carve_validation(train_ds, val_fraction, seed)
        log.info("carved %d validation documents out of %s", len(val_ds), source)
    log.info("texts loaded (%.1f s)", time.perf_counter() - t0)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        key = hashlib.sha256(f"{train_ds._fingerprint}|{vocab_size}".encode()).hexdigest()[:24]
        tok_dir = root / "tokenizers" / f"bpe{vocab_size}-{key}"
        if (tok_dir / "tokenizer.json").is_file():
            tok = load_tokenizer(tok_dir)
        else:
            tok = train_bpe_tokenizer(_iter_texts(train_ds), vocab_size)
            _save_tokenizer_atomic(tok, tok_dir)
            log.info("trained a %d-token BPE (%.1f s)", len(tok), time.perf_counter() - t0)
    tokens_dir = root / "tokens"
    train_tokens = tokenize_to_stream(train_ds, tok, num_proc=num_proc, cache_dir=tokens_dir)
    val_tokens = tokenize_to_stream(val_ds, tok, num_proc=num_proc, cache_dir=tokens_dir)
    log.info(
        "corpus %s: %d train / %d val tokens, vocab %d, %.1f s",
        source,
        len(train_tokens),
        len(val_tokens),
        len(tok),
        time.perf_counter() - t0,
    )
    return Corpus(train_tokens=train_tokens, val_tokens=val_tokens, tokenizer=tok, source=source)
