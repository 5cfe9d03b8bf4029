"""Language-model evaluation: validation loss, perplexity and loss by position in the window.

Windows are contiguous non-overlapping slices [i T, (i+1) T) of a token stream. Position t
of a window (1 <= t < T) is scored by -log p(x_t | x_0..x_{t-1}); ``loss_by_position[t-1]``
is its mean over windows, ``loss`` the mean over all scored tokens, perplexity = exp(loss).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn


def windows(tokens: np.ndarray, block_size: int, max_windows: int | None = None,
            seed: int = 0) -> Tensor:
    """(N, block_size) int64 windows; a seeded subset (in stream order) if over ``max_windows``."""
    n = len(tokens) // block_size
    if n == 0:
        raise ValueError(f"the token stream ({len(tokens)} tokens) is shorter than one window of "
                         f"{block_size}; use more data or a smaller --block-size")
    idx = np.arange(n)
    if max_windows is not None and n > max_windows:
        idx = np.sort(np.random.default_rng(seed).choice(n, size=max_windows, replace=False))
    arr = np.asarray(tokens[: n * block_size]).reshape(n, block_size)[idx]
    return torch.from_numpy(arr.astype(np.int64))


@torch.no_grad()
def evaluate_windows(model: nn.Module, wins: Tensor, batch_size: int = 4,
                     device: str | torch.device = "cpu", progress: bool = False) -> dict:
    """Loss, perplexity and per-position loss of a causal LM on (N, T) windows."""
    from tqdm.auto import tqdm

    model.eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    if int(wins.max()) >= vocab:
        raise ValueError(f"token id {int(wins.max())} is outside the model's vocabulary "
                         f"({vocab}); tokenize with the model's own tokenizer")
    t = wins.shape[1]
    sums = torch.zeros(t - 1, dtype=torch.float64)
    for i in tqdm(range(0, len(wins), batch_size), desc="eval windows", disable=not progress):
        ids = wins[i: i + batch_size].to(device)
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        sums += nll.double().sum(0).cpu()
    by_pos = sums / len(wins)
    loss = float(by_pos.mean())
    return {"loss": loss, "perplexity": float(np.exp(loss)), "windows": len(wins),
            "block_size": t, "tokens_scored": len(wins) * (t - 1),
            "loss_by_position": by_pos.tolist()}


def _read_plain(path: Path, text_column: str) -> list[str]:
    """Documents of a .txt (blank-line separated paragraphs) or .jsonl file."""
    if path.suffix == ".jsonl":
        docs = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                docs.append(row if isinstance(row, str) else row[text_column])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{lineno}: expected a JSON string or an object with "
                                 f"{text_column!r} ({err})") from None
        return docs
    return [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def load_tokens(source: str, tokenizer_dir: str | Path, split: str = "validation",
                text_column: str = "text") -> np.ndarray:
    """A 1-D token stream of ``split`` of ``source``, tokenized with the model dir's tokenizer.

    ``.npy`` files are taken as already-tokenized streams. Other sources go through
    :mod:`mosaics.data` (BabiStories files, datasets, .txt/.jsonl; a missing validation split
    is carved out of the training documents, seeded) when available; otherwise a .txt/.jsonl
    file is read here and tokenized with ``AutoTokenizer`` (documents joined by eos).
    """
    path = Path(source).expanduser()
    if path.suffix == ".npy":
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such token file")
        return np.load(path, allow_pickle=False)
    try:
        from mosaics import data as mdata
    except ImportError:
        mdata = None
    if mdata is not None:
        tok = mdata.load_tokenizer(tokenizer_dir)
        try:
            ds = mdata.load_texts(str(source), split, text_column=text_column)
        except mdata.MissingSplitError:
            return mdata.prepare_corpus(str(source), tokenizer=str(tokenizer_dir),
                                        text_column=text_column).val_tokens
        return mdata.tokenize_to_stream(ds, tok)
    from transformers import AutoTokenizer

    if not path.is_file() or path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"{source}: expected a .txt, .jsonl or .npy file")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has no eos token to join documents")
    ids: list[int] = []
    for doc in _read_plain(path, text_column):
        ids += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return np.asarray(ids, dtype=np.int64)


def context_length(model: nn.Module) -> int | None:
    """The longest window a model accepts (GPT-2's position table), or None (no limit)."""
    return getattr(model.config, "n_positions", None)


def position_tenths(loss_by_position: Sequence[float]) -> tuple[float, float, float]:
    """Mean loss over the first, middle and last 10% of window positions."""
    x = np.asarray(loss_by_position, dtype=float)
    k = max(1, len(x) // 10)
    mid = (len(x) - k) // 2
    return float(x[:k].mean()), float(x[mid:mid + k].mean()), float(x[-k:].mean())


def loss_table(results: dict[str, dict]) -> str:
    """Markdown: window, loss, perplexity and the position tenths of each labelled
    ``perplexity.json``."""
    lines = ["| model | window | loss | perplexity | first 10% | middle 10% | last 10% |",
             "|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        first, mid, last = position_tenths(r["loss_by_position"])
        lines.append(f"| {label} | {r['block_size']} | {r['loss']:.3f} | {r['perplexity']:.2f} "
                     f"| {first:.3f} | {mid:.3f} | {last:.3f} |")
    return "\n".join(lines)
