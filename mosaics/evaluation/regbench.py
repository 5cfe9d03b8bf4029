"""RegBench (Akyurek et al., ICML 2024): in-context learning of regular languages.

Each example is one random automaton (see :mod:`.automata`) shown through 10-19 random
walks from its start state joined by ``|``. Tokens: ``.`` (pad) 0, letters a..r 1..18,
``|`` 19; no BOS/EOS. The training loss ignores ``|`` targets and padding.

Scoring (the paper's): every one of the T-1 outputs of an example is scored, position t
predicting token t+1, including the positions whose target is ``|``. The current state at
t is the state reached by the letters since the last ``|`` (the start state right after
``|`` and at the start). With L_t the legal next letters of that state and p_t the model's
next-token distribution over its whole vocabulary:

    accuracy = mean_t [argmax_v p_t(v) in L_t]
    TVD      = mean_t 1/2 sum_v |p_t(v) - q_t(v)|,  q_t uniform on L_t (0 on ``|`` and ``.``)

pooled over all positions of all test examples (a micro-average). ``*_letters`` keys give
the same averages over the positions whose target is a letter only.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
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

    def letter_targets(self) -> np.ndarray:
        """(T-1,) bool: positions whose target is a letter (not ``|``)."""
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
    """Running accuracy and TVD over a set of positions.

    ``add(probs, legal)``: probs (N, V) next-token distributions, legal (N, V) bool legal sets.
    accuracy = mean [argmax p in legal] (ties go to the lowest token id);
    TVD = mean 1/2 sum_v |p(v) - q(v)|, q uniform on the legal set.
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


class RegBenchScore:
    """The paper's scores over all T-1 outputs, plus the letter-target-only variant.

    ``result()``: ``accuracy``, ``tvd``, ``positions`` (all outputs) and ``accuracy_letters``,
    ``tvd_letters``, ``positions_letters`` (positions whose target is a letter).
    """

    def __init__(self) -> None:
        self.all = Score()
        self.letters = Score()

    def add(self, probs: Tensor, legal: Tensor, letter_target: Tensor) -> None:
        """probs, legal (N, V) for the N = T-1 outputs of one example; letter_target (N,) bool."""
        self.all.add(probs, legal)
        self.letters.add(probs[letter_target], legal[letter_target])

    def result(self) -> dict[str, float]:
        out = self.all.result()
        out.update({f"{k}_letters": v for k, v in self.letters.result().items()})
        return out


def score_predictor(examples: Sequence[Example], predict) -> dict[str, float]:
    """Score ``predict(example) -> (T-1, V) probs`` on every output of ``examples``."""
    score = RegBenchScore()
    for ex in examples:
        probs = torch.as_tensor(predict(ex))
        score.add(probs, torch.from_numpy(ex.legal_mask()), torch.from_numpy(ex.letter_targets()))
    return score.result()


def oracle_probs(ex: Example) -> np.ndarray:
    """(T-1, V) the true next-symbol distributions: uniform on the legal letters."""
    legal = ex.legal_mask().astype(np.float64)
    return legal / np.maximum(legal.sum(-1, keepdims=True), 1.0)


STRING_PAD = -1  # ``_``: the left padding of every string in the n-gram counts


class InContextNgram:
    """The reference in-context n-gram estimator, counting one prefix incrementally.

    The prefix is split on ``|`` into strings (the current, possibly empty, one included);
    each string is left-padded with n-1 ``_`` and every k-gram, k = 1..n, is counted, pads
    included. The vocabulary is the letters seen so far. With h_k the last k-1 symbols of the
    padded current string (h_1 empty):

        p_1(v) = c(v) / (sum of all unigram counts, ``_`` included)
        p_k(v) = c(h_k v) / c(h_k)                                   if c(h_k v) > 0
               = (1 - sum_{u: c(h_k u) > 0} p_k(u)) p_{k-1}(v) / sum_{u in U} p_{k-1}(u)
                                                                     for v in U

    where U is the vocabulary letters with c(h_k v) = 0, and c(h_k) counts every occurrence of
    h_k, its trailing one in the current string included (so a row may sum below 1 when U is
    empty). No smoothing; ``|``, ``.`` and unseen letters get 0.
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"n-gram order must be >= 1, got {n}")
        self.n = n
        self.count: dict[tuple[int, ...], int] = defaultdict(int)  # c(g), len(g) < n
        self.follow: dict[tuple[int, ...], np.ndarray] = {}  # follow[h][v] = c(h v), v a letter
        self.vocab = np.zeros(VOCAB_SIZE, dtype=bool)
        self.current: list[int] = []
        self._new_string()

    def _new_string(self) -> None:
        self.current = []
        for _ in range(self.n - 1):
            self._push(STRING_PAD)

    def _push(self, sym: int) -> None:
        """Append ``sym`` to the current string and count the k-grams ending with it."""
        cur = self.current
        cur.append(sym)
        self.count[()] += 1
        for k in range(1, min(self.n, len(cur)) + 1):
            gram = tuple(cur[len(cur) - k:])
            if k < self.n:
                self.count[gram] += 1
            if sym != STRING_PAD:
                row = self.follow.get(gram[:-1])
                if row is None:
                    row = self.follow[gram[:-1]] = np.zeros(VOCAB_SIZE)
                row[sym] += 1

    def add(self, token: int) -> None:
        """Extend the prefix by one token (``|`` starts a new string)."""
        if token == SEP:
            self._new_string()
        elif 1 <= token <= N_LETTERS:
            self.vocab[token] = True
            self._push(token)
        else:
            raise ValueError(f"token {token} is not a letter or '|'")

    def context(self, k: int) -> tuple[int, ...]:
        """h_k: the last k-1 symbols of the padded current string."""
        return tuple(self.current[len(self.current) - (k - 1):]) if k > 1 else ()

    def orders(self) -> list[np.ndarray]:
        """[p_1, ..., p_n], each (V,), for the next token after the prefix."""
        total = self.count[()]
        p = self.follow.get((), np.zeros(VOCAB_SIZE)) / max(total, 1)
        out = [p]
        for k in range(2, self.n + 1):
            h = self.context(k)
            p = self._back_off(self.follow.get(h), self.count[h], p)
            out.append(p)
        return out

    def probs(self) -> np.ndarray:
        """(V,) p_n: the estimator's next-token distribution."""
        return self.orders()[-1]

    def _back_off(self, follow: np.ndarray | None, c_h: int, lower: np.ndarray) -> np.ndarray:
        """c(h v) / c(h) on seen letters; the rest of the mass on unseen ones as ``lower``."""
        p = np.zeros(VOCAB_SIZE) if follow is None else follow / c_h
        share = np.where(self.vocab & (p == 0), lower, 0.0)
        total = share.sum()
        if total > 0:
            p = p + (1.0 - p.sum()) * share / total
        return p


def ngram_probs(tokens: np.ndarray, n: int) -> np.ndarray:
    """(T-1, V): row t is :class:`InContextNgram` (order n) on the prefix tokens[0..t]."""
    model = InContextNgram(n)
    out = np.zeros((max(len(tokens) - 1, 0), VOCAB_SIZE))
    for t in range(len(tokens) - 1):
        model.add(int(tokens[t]))
        out[t] = model.probs()
    return out


NGRAM_ORDERS = (2, 3, 4)


def baseline_scores(examples: Sequence[Example]) -> dict[str, dict[str, float]]:
    """Oracle and the in-context 2-, 3- and 4-gram rows, scored like a model."""
    out = {"oracle": score_predictor(examples, oracle_probs)}
    for n in NGRAM_ORDERS:
        out[f"{n}-gram"] = score_predictor(examples, lambda ex, n=n: ngram_probs(ex.tokens, n))
    return out


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, examples: Sequence[Example], batch_size: int = 32,
                   device: str | torch.device = "cpu", progress: bool = False) -> dict[str, float]:
    """Accuracy and TVD of a causal LM (``model(input_ids).logits``, (B, T, V)) on ``examples``.

    Every one of the T-1 outputs of each example is scored (padding beyond it is not); see
    :class:`RegBenchScore` for the keys.
    """
    from tqdm.auto import tqdm

    model.eval()
    score = RegBenchScore()
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
            legal = torch.nn.functional.pad(torch.from_numpy(ex.legal_mask()), (0, extra))
            score.add(probs[b, : len(ex.tokens) - 1], legal,
                      torch.from_numpy(ex.letter_targets()))
    return score.result()
