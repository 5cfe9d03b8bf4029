"""Token streams and the windows sampled from them.

``tokenize_to_stream`` turns a text Dataset into one 1-D token array, every document followed
by the eos (end-of-text) token, cached as ``.npy`` keyed by the dataset fingerprint and the
tokenizer. ``RandomWindowBatches`` draws training windows of ``block_size`` tokens at uniformly
random offsets (the reference recipe); batch ``step`` is a pure function of (seed, step, rank),
so resuming is exact. ``fixed_validation_windows`` gives a reproducible validation set.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from ..errors import DataError

__all__ = [
    "RandomWindowBatches",
    "fixed_validation_windows",
    "stream_dtype",
    "tokenize_to_stream",
    "tokenizer_fingerprint",
]

log = logging.getLogger(__name__)


def stream_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65535), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of a tokenizer's full definition (its tokenizer.json) and its eos id."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        raw = backend.to_str()
    else:  # slow tokenizer: its vocabulary in id order
        vocab = tokenizer.get_vocab()
        raw = "\n".join(sorted(vocab, key=vocab.get))
    raw += f"\neos={tokenizer.eos_token_id}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def _encode_batch(batch: dict, tokenizer, eos: int) -> dict:
    ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
    return {"ids": [x + [eos] for x in ids], "n": [len(x) + 1 for x in ids]}


def _save_npy_atomic(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tokenize_to_stream(
    dataset, tokenizer, num_proc: int = 1, cache_dir: str | os.PathLike | None = None
) -> np.ndarray:
    """Tokenize every document of ``dataset["text"]`` and concatenate: [doc0, eos, doc1, eos...].

    Args:
        dataset: a ``datasets.Dataset`` with a string column ``text``.
        tokenizer: a Hugging Face tokenizer with ``eos_token_id``.
        num_proc: worker processes for ``dataset.map``.
        cache_dir: where ``tokens-<key>.npy`` is kept, key = hash(dataset fingerprint,
            tokenizer fingerprint). ``None`` disables this cache.
    Returns:
        (N,) uint16 array (uint32 when the vocabulary exceeds 65535 ids).
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; set tokenizer.eos_token first")
    dtype = stream_dtype(len(tokenizer))
    key = hashlib.sha256(
        f"{dataset._fingerprint}|{tokenizer_fingerprint(tokenizer)}|{dtype.str}".encode()
    ).hexdigest()[:32]
    cached = Path(cache_dir).expanduser() / f"tokens-{key}.npy" if cache_dir else None
    if cached is not None and cached.is_file():
        return np.load(cached, mmap_mode="r", allow_pickle=False)
    if len(dataset) == 0:
        arr = np.zeros(0, dtype=dtype)
        if cached is not None:
            _save_npy_atomic(cached, arr)
        return arr
    features = datasets.Features(
        {"ids": datasets.Sequence(datasets.Value(dtype.name)), "n": datasets.Value("int64")}
    )
    mapped = dataset.select_columns(["text"]).map(
        _encode_batch,
        fn_kwargs={"tokenizer": tokenizer, "eos": eos},
        batched=True,
        batch_size=1000,
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        remove_columns=["text"],
        features=features,
        new_fingerprint=key,
        desc="tokenizing",
    )
    total = int(pc.sum(mapped.data.column("n")).as_py())
    if cached is None:
        arr = np.empty(total, dtype=dtype)
        _fill(arr, mapped)
        return arr
    cached.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cached.parent, prefix=f".{cached.name}.", suffix=".tmp")
    os.close(fd)
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(total,))
        _fill(out, mapped)
        out.flush()
        del out
        os.replace(tmp, cached)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return np.load(cached, mmap_mode="r", allow_pickle=False)


def _fill(out: np.ndarray, mapped) -> None:
    """Copy the flattened ``ids`` column of ``mapped`` into ``out`` chunk by chunk."""
    pos = 0
    for chunk in mapped.data.column("ids").chunks:
        flat = chunk.flatten().to_numpy(zero_copy_only=False)
        out[pos : pos + len(flat)] = flat
        pos += len(flat)
    if pos != len(out):
        raise RuntimeError(f"token stream has {pos} tokens, expected {len(out)}")


def _generator(seed: int, step: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, step]))


class RandomWindowBatches:
    """Batches of ``block_size``-token windows at uniformly random offsets of a token stream.

    The windows of optimizer step ``s`` are a pure function of (seed, s, global batch): the
    ``batch_size * world_size * accumulation`` offsets of the step are drawn from
    ``PCG64([seed, s])``, and micro-batch ``k`` of rank ``r`` takes rows
    ``[(k * world_size + r) * batch_size, ... + batch_size)``. So ranks get different windows,
    a step's global batch is the same however it is split over processes and micro-batches
    (2 ranks x 8 == 1 rank x 16 == 1 rank x 2 micro-batches of 8), and resuming at any step,
    on any number of processes with the same global batch, is exact. Labels equal
    ``input_ids`` (the model shifts them).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        batch_size: int = 1,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        accumulation: int = 1,
    ):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if len(tokens) < block_size:
            raise DataError(
                f"the token stream ({len(tokens)} tokens) is shorter than block_size "
                f"({block_size}); use a bigger corpus or a smaller block_size"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world={world_size}")
        if block_size < 1 or batch_size < 1 or accumulation < 1:
            raise ValueError("block_size, batch_size and accumulation must be >= 1")
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.accumulation = accumulation

    @property
    def global_rows(self) -> int:
        """Windows per optimizer step, all processes and micro-batches together."""
        return self.batch_size * self.world_size * self.accumulation

    @property
    def num_offsets(self) -> int:
        """Number of distinct window starts: len(tokens) - block_size + 1."""
        return len(self.tokens) - self.block_size + 1

    def offsets(self, index: int) -> np.ndarray:
        """(batch_size,) start offsets of this rank's micro-batch ``index``
        (= optimizer step * accumulation + micro-batch)."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        step, micro = divmod(index, self.accumulation)
        g = _generator(self.seed, step)
        all_offsets = g.integers(0, self.num_offsets, size=self.global_rows)
        first = (micro * self.world_size + self.rank) * self.batch_size
        return all_offsets[first : first + self.batch_size]

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """This rank's micro-batch ``index``: input_ids and labels, (batch_size, block_size)
        int64."""
        idx = self.offsets(index)[:, None] + np.arange(self.block_size)[None, :]
        x = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        return {"input_ids": x, "labels": x.clone()}

    def state_dict(self) -> dict:
        """What defines the batches (a resume checks it with ``load_state_dict``)."""
        return {
            "seed": self.seed,
            "block_size": self.block_size,
            "global_rows": self.global_rows,
            "num_tokens": len(self.tokens),
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "accumulation": self.accumulation,
        }

    def load_state_dict(self, state: dict) -> None:
        """Refuse a state written for a different stream, seed, window or global batch (the
        split over processes and micro-batches may differ)."""
        for k in ("seed", "block_size", "global_rows", "num_tokens"):
            mine = self.state_dict()[k]
            if k in state and state[k] != mine:
                fix = ("keep batch_size x processes x accumulation (or global_batch_size) as "
                       "written" if k == "global_rows" else "resume with the same data")
                raise DataError(
                    f"the checkpoint's batches had {k}={state[k]}, this run has {k}={mine}; "
                    f"{fix}"
                )


def fixed_validation_windows(
    tokens: np.ndarray, block_size: int, max_windows: int, seed: int = 0
) -> torch.Tensor:
    """Contiguous non-overlapping windows [i*T, (i+1)*T) of the stream, (N, T) int64.

    N = min(len(tokens) // T, max_windows); when there are more windows than ``max_windows``,
    a subset chosen with ``PCG64(seed)`` is kept, in stream order.
    """
    n = len(tokens) // block_size
    if n == 0:
        raise ValueError(
            f"the validation stream ({len(tokens)} tokens) is shorter than one window of "
            f"{block_size}; use more validation data or a smaller block_size"
        )
    idx = np.arange(n)
    if max_windows is not None and n > max_windows:
        idx = np.sort(np.random.Generator(np.random.PCG64(seed)).choice(n, max_windows, False))
    rows = idx[:, None] * block_size + np.arange(block_size)[None, :]
    return torch.from_numpy(np.asarray(tokens[rows], dtype=np.int64))
