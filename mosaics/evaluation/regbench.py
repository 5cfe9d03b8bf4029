"""RegBench (Akyurek et al., ICML 2024): in-context learning of regular languages.

Each example is one random automaton (see :mod:`.automata`) shown through 10-19 random
walks from its start state joined by ``|``. Tokens: ``.`` (pad) 0, letters a..r 1..18,
``|`` 19; no BOS/EOS.

Scored positions: position t (0 <= t < T-1) predicts token t+1 and is scored iff that
target is a letter (the positions whose target is ``|`` or padding are not scored; the
loss ignores them too). The current state at t is the state reached by the letters since
the last ``|`` (the start state right after ``|``). With L the legal next letters of that
state and p the model's next-token distribution over the 20 tokens:

    accuracy = mean_t [argmax_v p_t(v) in L_t]
    TVD      = mean_t 1/2 sum_v |p_t(v) - q_t(v)|,  q_t uniform on L_t (0 on ``|`` and ``.``)

pooled over all scored positions of all test examples.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .automata import DFA, N_LETTERS, canonical_hash, minimize, random_dfa

PAD, SEP = 0, N_LETTERS + 1
VOCAB_SIZE = N_LETTERS + 2  # 20
LETTERS = "abcdefghijklmnopqr"


def decode(tokens: Iterable[int]) -> str:
    """Token ids to text (``.`` pad, a..r, ``|``)."""
    return "".join("." if t == PAD else "|" if t == SEP else LETTERS[t - 1] for t in tokens)


@dataclass
class Example:
    """One RegBench example: its minimal automaton, canonical hash and (T,) token ids."""

    dfa: DFA
    hash: str
    tokens: np.ndarray = field(repr=False)

    def legal_mask(self) -> np.ndarray:
        """(T-1, 20) bool: legal next tokens at each position (letters of the current state)."""
        return legal_masks(self.dfa, self.tokens)

    def scored(self) -> np.ndarray:
        """(T-1,) bool: positions whose target is a letter."""
        nxt = self.tokens[1:]
        return (nxt != PAD) & (nxt != SEP)


def sample_walks(dfa: DFA, rng: np.random.Generator, min_strings: int = 10,
                 max_strings: int = 19, min_len: int = 1, max_len: int = 49) -> np.ndarray:
    """(T,) token ids: n ~ U{min..max_strings} walks of length ~ U{min..max_len} joined by ``|``.

    Each walk starts at state 0 and picks the next symbol uniformly among the current
    state's outgoing symbols.
    """
    n_strings = int(rng.integers(min_strings, max_strings + 1))
    out: list[int] = []
    for i in range(n_strings):
        if i:
            out.append(SEP)
        q = 0
        for _ in range(int(rng.integers(min_len, max_len + 1))):
            syms = dfa.symbols(q)
            a = syms[int(rng.integers(len(syms)))]
            out.append(a + 1)
            q = dfa.delta[q][a]
    return np.asarray(out, dtype=np.int64)


def legal_masks(dfa: DFA, tokens: np.ndarray) -> np.ndarray:
    """(T-1, 20) bool; row t: letters legal after reading tokens[0..t] (``|`` resets to 0)."""
    rows = np.zeros((max(len(tokens) - 1, 0), VOCAB_SIZE), dtype=bool)
    q = 0
    for t in range(len(tokens) - 1):
        tok = int(tokens[t])
        if tok == SEP:
            q = 0
        elif tok != PAD:
            q = dfa.delta[q].get(tok - 1, -1)
            if q < 0:
                raise ValueError(f"token {decode([tok])!r} at position {t} is not legal")
        for a in dfa.delta[q]:
            rows[t, a + 1] = True
    return rows


def _stream(seed: int, split: int) -> np.random.Generator:
    return np.random.default_rng([seed, split])


def make_examples(n: int, seed: int, split: int, exclude: set[str] | None = None) -> list[Example]:
    """The first ``n`` examples of stream (seed, split) whose automaton hash is not excluded.

    Smaller ``n`` gives a prefix of a larger ``n`` (nested training sets).
    """
    rng = _stream(seed, split)
    out: list[Example] = []
    exclude = exclude or set()
    while len(out) < n:
        raw, _ = random_dfa(rng)
        dfa = minimize(raw)
        tokens = sample_walks(dfa, rng)
        h = canonical_hash(dfa)
        if h in exclude:
            continue
        out.append(Example(dfa, h, tokens))
    return out


@dataclass
class RegBenchData:
    """Train / validation / test splits, disjoint on the canonical minimal automaton."""

    train: list[Example]
    val: list[Example]
    test: list[Example]

    def fingerprint(self) -> str:
        """Short hash of every split's automata and tokens (to check determinism)."""
        h = hashlib.sha1()
        for split in (self.train, self.val, self.test):
            for ex in split:
                h.update(ex.hash.encode())
                h.update(ex.tokens.tobytes())
            h.update(b"/")
        return h.hexdigest()[:16]


def make_splits(n_train: int, n_val: int = 500, n_test: int = 500, seed: int = 0) -> RegBenchData:
    """Seeded splits: test (stream 2), then validation (stream 1, not in test), then train
    (stream 0, not in test or validation). Duplicates inside a split are allowed."""
    test = make_examples(n_test, seed, 2)
    test_hashes = {ex.hash for ex in test}
    val = make_examples(n_val, seed, 1, exclude=test_hashes)
    held_out = test_hashes | {ex.hash for ex in val}
    train = make_examples(n_train, seed, 0, exclude=held_out)
    return RegBenchData(train, val, test)


def collate(examples: Sequence[Example]) -> dict[str, Tensor]:
    """Right-pad with ``.``; labels are the inputs with -100 on padding and ``|`` targets."""
    t_max = max(len(ex.tokens) for ex in examples)
    ids = torch.full((len(examples), t_max), PAD, dtype=torch.long)
    for i, ex in enumerate(examples):
        ids[i, : len(ex.tokens)] = torch.from_numpy(ex.tokens)
    labels = ids.clone()
    labels[(ids == PAD) | (ids == SEP)] = -100
    for i, ex in enumerate(examples):
        labels[i, len(ex.tokens):] = -100
    return {"input_ids": ids, "labels": labels}


class Score:
    """Running accuracy and TVD over scored positions.

    ``add(probs, legal)``: probs (N, V) next-token distributions, legal (N, V) bool legal sets.
    Ties in the argmax go to the lowest token id.
    """

    def __init__(self) -> None:
        self.correct = 0.0
        self.tvd = 0.0
        self.n = 0

    def add(self, probs: Tensor, legal: Tensor) -> None:
        probs = probs.double()
        legal = legal.bool()
        if probs.shape != legal.shape:
            raise ValueError(f"probs {tuple(probs.shape)} and legal {tuple(legal.shape)} differ")
        if probs.numel() == 0:
            return
        if bool((legal.sum(-1) == 0).any()):
            raise ValueError("a scored position has no legal symbol")
        pred = probs.argmax(-1, keepdim=True)
        self.correct += float(legal.gather(-1, pred).sum())
        q = legal.double() / legal.sum(-1, keepdim=True)
        self.tvd += float(0.5 * (probs - q).abs().sum(-1).sum())
        self.n += probs.shape[0]

    def result(self) -> dict[str, float]:
        if self.n == 0:
            raise ValueError("no scored position")
        return {"accuracy": self.correct / self.n, "tvd": self.tvd / self.n, "positions": self.n}


def score_predictor(examples: Sequence[Example], predict) -> dict[str, float]:
    """Score ``predict(example) -> (T-1, V) probs`` on the scored positions of ``examples``."""
    score = Score()
    for ex in examples:
        keep = torch.from_numpy(ex.scored())
        probs = torch.as_tensor(predict(ex))
        score.add(probs[keep], torch.from_numpy(ex.legal_mask())[keep])
    return score.result()


def oracle_probs(ex: Example) -> np.ndarray:
    """(T-1, V) the true next-symbol distributions: uniform on the legal letters."""
    legal = ex.legal_mask().astype(np.float64)
    return legal / np.maximum(legal.sum(-1, keepdims=True), 1.0)


def ngram_probs(tokens: np.ndarray, order: int, vocab_size: int = VOCAB_SIZE) -> np.ndarray:
    """(T-1, V) in-context n-gram predictions with back-off.

    Row t is estimated from the example's own prefix tokens[0..t]: the counts of the tokens
    that followed earlier occurrences of the last ``order - 1`` tokens, normalised; if that
    context never occurred, back off to order - 1, down to the prefix's unigram counts.
    ``|`` is an ordinary token here (so ``|`` as context predicts the start state's letters).
    """
    if order < 1:
        raise ValueError(f"n-gram order must be >= 1, got {order}")
    toks = [int(x) for x in tokens]
    counts: list[dict[tuple[int, ...], np.ndarray]] = [{} for _ in range(order)]
    out = np.zeros((max(len(toks) - 1, 0), vocab_size))
    for t in range(len(toks) - 1):
        for k in range(order):  # k = context length; add the n-gram ending at t
            if t - k >= 0:
                ctx = tuple(toks[t - k: t])
                counts[k].setdefault(ctx, np.zeros(vocab_size))[toks[t]] += 1
        for k in range(order - 1, -1, -1):
            if t + 1 - k < 0:
                continue
            c = counts[k].get(tuple(toks[t + 1 - k: t + 1]))
            if c is not None:
                out[t] = c / c.sum()
                break
    return out


def baseline_scores(examples: Sequence[Example]) -> dict[str, dict[str, float]]:
    """Oracle, in-context 2-gram and 3-gram (with back-off), scored by :class:`Score`."""
    return {
        "oracle": score_predictor(examples, oracle_probs),
        "2-gram": score_predictor(examples, lambda ex: ngram_probs(ex.tokens, 2)),
        "3-gram": score_predictor(examples, lambda ex: ngram_probs(ex.tokens, 3)),
    }


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, examples: Sequence[Example], batch_size: int = 32,
                   device: str | torch.device = "cpu", progress: bool = False) -> dict[str, float]:
    """Accuracy and TVD of a causal LM (``model(input_ids).logits``, (B, T, V)) on ``examples``."""
    from tqdm.auto import tqdm

    model.eval()
    score = Score()
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].tokens))
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    for idx in tqdm(batches, desc="regbench eval", disable=not progress, leave=False):
        chunk = [examples[i] for i in idx]
        ids = collate(chunk)["input_ids"].to(device)
        logits = model(input_ids=ids).logits.float()
        if logits.shape[-1] < VOCAB_SIZE:
            raise ValueError(f"model vocabulary {logits.shape[-1]} < RegBench's {VOCAB_SIZE}")
        probs = torch.softmax(logits, dim=-1).cpu()  # mass on extra ids counts in the TVD
        extra = logits.shape[-1] - VOCAB_SIZE
        for b, ex in enumerate(chunk):
            t = len(ex.tokens)
            keep = torch.from_numpy(ex.scored())
            legal = torch.nn.functional.pad(torch.from_numpy(ex.legal_mask()), (0, extra))
            score.add(probs[b, : t - 1][keep], legal[keep])
    return score.result()
