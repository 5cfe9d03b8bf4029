"""Recall beyond the training length: a multi-key needle probe for any saved causal LM.

A prompt of exactly L tokens is a haystack of validation text with ``facts`` facts of one
template inserted at sentence boundaries, then a question about one of them (the gold fact):

    story mode (the built-in story corpus): the corpus's own gift episodes and question,
        "... Ben had a purple key. At the harbor, he gave it to Jonah as a present. ...
        Think back. What color was the key? The key was" -> " purple"
    passkey mode (any other corpus): the Landmark / LongLoRA filler and
        "The pass key is 68079. Remember it. 68079 is the pass key." -> " 68079"

The gold fact sits at a depth in [0, 1] of the haystack. The gold answer appears nowhere
else in the prompt (no haystack text holding it, other facts with other answers), so reading
the gold fact is the only way to answer. Two scores per prompt, from one cached pass over the
prompt: exact match of the greedy answer, and the gold answer's rank among the candidates (12
colours, or 12 numbers) by log-likelihood. Controls: ``no_gold`` (the gold fact left out; a
model scores at chance, 1/12) and ``recent`` (the gold fact inside the last training-length
window; a model scores as at 1x).

Prompts are a pure function of (seed, length, prompt index): every depth and control of one
(length, index) shares its haystack and facts, only the gold fact moves.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..data.storygen import COLOURS, gift_fact, question_lead

CONTROLS = ("no_gold", "recent")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MULTIPLIERS = (1, 2, 4, 8, 16, 32, 64)
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it "
                 "and memorize them. I will quiz you about the important information there.")
PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There "
                  "and back again.")
STORY_MARKER = re.compile(r"What color was the \w+\? The \w+ was")
_SENTENCE_END = re.compile(r"(?<=[.!?\"])\s+")
_WORD = re.compile(r"[A-Za-z0-9]+")


class NeedleError(ValueError):
    """A probe that cannot be built or run as asked (the message names the fix)."""


@dataclass
class NeedlePrompt:
    """One prompt: ``ids`` (exactly ``length`` tokens), the gold ``answer`` and the
    ``candidates`` it is ranked among (gold included); ``gold_at``: token index where the gold
    fact starts (None for the no-gold control), ``facts_at`` where the others start and
    ``others`` their answers; ``depth``: the depth asked for (None for a control),
    ``control``: None, "no_gold" or "recent"."""

    ids: list[int]
    answer: str
    candidates: list[str]
    length: int
    index: int
    depth: float | None
    control: str | None
    gold_at: int | None
    facts_at: list[int] = field(default_factory=list)
    others: list[str] = field(default_factory=list)  # the other facts' answers


def detect_mode(texts: Sequence[str]) -> str:
    """``story`` when the corpus asks the built-in colour question, else ``passkey``."""
    return "story" if any(STORY_MARKER.search(t) for t in texts[:2000]) else "passkey"


def _words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text)}


class NeedleBuilder:
    """Builds needle prompts from ``texts`` (validation documents) with ``tokenizer``.

    Args:
        tokenizer: the model's tokenizer (``__call__`` giving ``input_ids``).
        texts: haystack documents (story mode); unused in passkey mode beyond detection.
        mode: "story", "passkey" or "auto" (:func:`detect_mode`).
        facts: facts per prompt, the gold one included (story mode; passkey mode has one key
            and ``facts - 1`` distractor keys of other digits).
        block_size: the model's training length (for the ``recent`` control).
        seed: prompts are a pure function of (seed, length, index).
    """

    def __init__(self, tokenizer: Any, texts: Sequence[str], mode: str = "auto", facts: int = 3,
                 block_size: int = 256, seed: int = 0) -> None:
        if mode not in ("auto", "story", "passkey"):
            raise NeedleError(f"mode must be auto, story or passkey, got {mode!r}")
        if facts < 1:
            raise NeedleError(f"facts must be >= 1 (the gold fact counts), got {facts}")
        self.tok, self.facts, self.block_size, self.seed = tokenizer, facts, block_size, seed
        texts = [t for t in texts if t.strip()]
        self.mode = detect_mode(texts) if mode == "auto" else mode
        if self.mode == "story":
            if len(texts) < 20:
                raise NeedleError(f"the validation split holds {len(texts)} documents; the "
                                  "story haystack needs at least 20")
            self.docs = texts
            self.doc_words = [_words(t) for t in texts]
        self._units: dict[int, list[list[int]]] = {}

    # --- tokens ---------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _doc_units(self, i: int) -> list[list[int]]:
        """Document i as token lists, one per sentence ("\\n\\n" before the first)."""
        if i not in self._units:
            parts = _SENTENCE_END.split(self.docs[i].strip())
            self._units[i] = [self.encode(("\n\n" if j == 0 else " ") + p)
                              for j, p in enumerate(parts)]
        return self._units[i]

    # --- the facts of one (length, index) --------------------------------------------------

    def _facts(self, rng: random.Random
               ) -> tuple[list[list[int]], list[str], list[str], list[int], set[str]]:
        """(fact token lists with the gold first, their answers, candidates, question tokens,
        words no haystack document may hold: the answer and the facts' objects)."""
        if self.mode == "story":
            objects: list[str] = []
            colours: list[str] = []
            texts: list[str] = []
            question = ""
            for k in range(self.facts):
                text, obj, colour, q = gift_fact(rng, objects, colours)
                objects.append(obj)
                colours.append(colour)
                texts.append(text)
                if k == 0:
                    question = q
            ids = [self.encode(" " + t) for t in texts]
            q_ids = self.encode(" " + question_lead(rng) + question)
            return ids, colours, list(COLOURS), q_ids, {colours[0], *objects}
        names = [str(k) for k in rng.sample(range(10000, 100000), max(12, self.facts))]
        ids = [self.encode(f" The pass key is {names[0]}. Remember it. {names[0]} is the "
                           "pass key.")]
        ids += [self.encode(f" The spare key is {k}. {k} is the spare key.")
                for k in names[1: self.facts]]
        q_ids = self.encode(" What is the pass key? The pass key is")
        return ids, names[: self.facts], names[:12], q_ids, set()

    def _haystack(self, rng: random.Random, n: int, banned: set[str]) -> list[list[int]]:
        """Sentence units totalling exactly ``n`` tokens."""
        if self.mode == "passkey":  # the intro, then filler cut at the end
            intro, filler = self.encode(PASSKEY_INTRO), self.encode(" " + PASSKEY_FILLER)
            flat = (intro + filler * (n // max(1, len(filler)) + 1))[:n]
            cuts = [0, len(intro)] + list(range(len(intro) + len(filler), n, len(filler)))
            cuts = [c for c in cuts if c < n] + [n]
            return [flat[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
        units: list[list[int]] = []
        total = 0
        order = list(range(len(self.docs)))
        rng.shuffle(order)
        for i in order:
            if total >= n:
                break
            if self.doc_words[i] & banned:
                continue
            doc = self._doc_units(i)
            units += doc
            total += sum(map(len, doc))
        if total < n:
            raise NeedleError(f"the validation split is too small for a {n}-token haystack "
                              "without the answer; use a larger split or shorter lengths")
        return _trim_front(units, n)

    # --- one prompt ------------------------------------------------------------------------

    def build(self, length: int, index: int, depth: float | None = None,
              control: str | None = None) -> NeedlePrompt:
        """The prompt of (length, index) with the gold fact at ``depth`` of the haystack, or
        one of the :data:`CONTROLS`."""
        if (depth is None) == (control is None):
            raise NeedleError("give exactly one of depth and control")
        if control is not None and control not in CONTROLS:
            raise NeedleError(f"control must be one of {CONTROLS}, got {control!r}")
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise NeedleError(f"depth must be in [0, 1], got {depth}")
        rng = random.Random(f"needle-{self.seed}-{length}-{index}")
        facts, answers, candidates, question, banned = self._facts(rng)
        answer = answers[0]
        gold, others = facts[0], facts[1:]
        use_gold = control != "no_gold"
        fixed = len(question) + sum(map(len, others)) + (len(gold) if use_gold else 0)
        n = length - fixed
        if n < 1:
            raise NeedleError(f"length {length} holds no haystack beside the facts and the "
                              f"question ({fixed} tokens); use longer lengths or fewer facts")
        units = self._haystack(rng, n, banned)
        # boundaries: token offsets where a unit starts (0 .. n)
        starts = [0]
        for u in units:
            starts.append(starts[-1] + len(u))
        other_at = sorted(rng.randrange(len(starts)) for _ in others)
        gold_unit = -1
        if control == "recent":  # the gold fact, the haystack after it and the question in
            room = self.block_size - len(question) - len(gold)  # one training window
            target = n - rng.randint(0, max(0, room))
            gold_unit = min(range(len(starts)), key=lambda j: (abs(starts[j] - target), j))
            while gold_unit < len(units) and n - starts[gold_unit] > room:
                gold_unit += 1
            other_at = [min(a, gold_unit) for a in other_at]  # the others before it
        elif use_gold:
            target = round(depth * n)
            gold_unit = min(range(len(starts)), key=lambda j: (abs(starts[j] - target), j))
        pieces: list[list[int]] = []
        facts_at: list[int] = []
        gold_at = None
        pos = 0
        for j in range(len(starts)):
            for k, at in enumerate(other_at):
                if at == j:
                    facts_at.append(pos)
                    pieces.append(others[k])
                    pos += len(others[k])
            if j == gold_unit:
                gold_at = pos
                pieces.append(gold)
                pos += len(gold)
            if j < len(units):
                pieces.append(units[j])
                pos += len(units[j])
        ids = [t for p in pieces for t in p] + question
        assert len(ids) == length, (len(ids), length)
        return NeedlePrompt(ids, answer, candidates, length, index, depth, control, gold_at,
                            facts_at, answers[1:])


def _trim_front(units: list[list[int]], n: int) -> list[list[int]]:
    """Drop whole units, then tokens, from the front until the units total ``n`` tokens."""
    total = sum(map(len, units))
    while units and total - len(units[0]) >= n:
        total -= len(units.pop(0))
    if total > n:
        units[0] = units[0][total - n:]
    return [u for u in units if u]


# --- scoring ------------------------------------------------------------------------------

@torch.no_grad()
def score_prompts(model: nn.Module, prompts: Sequence[NeedlePrompt], tokenizer: Any,
                  device: str | torch.device = "cpu") -> list[dict[str, Any]]:
    """Greedy answer and gold rank of prompts of one length, batched: one cached forward
    over the prompts, then each candidate's remaining tokens (rarely more than one) and the
    greedy continuation from copies of the cache."""
    if len({len(p.ids) for p in prompts}) != 1:
        raise NeedleError("score_prompts takes prompts of one length")
    ids = torch.tensor([p.ids for p in prompts], dtype=torch.long, device=device)
    out = model(input_ids=ids, use_cache=True)
    last = torch.log_softmax(out.logits[:, -1].float(), -1)
    cache = out.past_key_values
    results = []
    for b, p in enumerate(prompts):
        cands = [tokenizer(" " + c, add_special_tokens=False)["input_ids"] for c in p.candidates]
        steps = max(map(len, cands))
        scores = []
        for c in cands:
            lp = float(last[b, c[0]])
            if len(c) > 1:
                lp += _continue(model, cache, b, len(prompts), c, device)
            scores.append(lp)
        greedy = _greedy(model, cache, b, len(prompts), last[b], steps, device)
        text = tokenizer.decode(greedy).strip()
        words = _WORD.findall(text)
        gold = p.candidates.index(p.answer)
        rank = 1 + sum(s >= scores[gold] for i, s in enumerate(scores) if i != gold)  # ties lose
        results.append({"index": p.index, "answer": p.answer,
                        "greedy": text, "exact_match": bool(words) and words[0] == p.answer,
                        "distractor": bool(words) and words[0] in p.others,
                        "rank": rank, "gold_at": p.gold_at})
    return results


def _row_cache(cache: Any, b: int, batch: int) -> Any:
    """A deep copy of ``cache`` cut to batch row b (the cache kept intact for the others)."""
    one = copy.deepcopy(cache)
    if batch > 1:
        if not hasattr(one, "batch_select_indices"):
            raise NeedleError(f"{type(one).__name__} cannot select a batch row; use batch 1")
        one.batch_select_indices(torch.tensor([b]))
    return one


def _continue(model: nn.Module, cache: Any, b: int, batch: int, cand: list[int],
              device: str | torch.device) -> float:
    """log p(cand[1:] | prompt, cand[0]) from a copy of row b of the cache."""
    x = torch.tensor([cand], dtype=torch.long, device=device)
    out = model(input_ids=x[:, :-1], past_key_values=_row_cache(cache, b, batch),
                use_cache=True)
    lp = torch.log_softmax(out.logits[0].float(), -1)
    return float(lp.gather(1, x[0, 1:, None]).sum())


def _greedy(model: nn.Module, cache: Any, b: int, batch: int, first: torch.Tensor, steps: int,
            device: str | torch.device) -> list[int]:
    tokens = [int(first.argmax())]
    if steps > 1:
        state = _row_cache(cache, b, batch)
        for _ in range(steps - 1):
            x = torch.tensor([[tokens[-1]]], dtype=torch.long, device=device)
            out = model(input_ids=x, past_key_values=state, use_cache=True)
            state = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


# --- a grid of cells ----------------------------------------------------------------------

@dataclass
class Cell:
    """One (length, depth or control) cell of the grid and its scores."""

    length: int
    multiplier: float
    depth: float | None
    control: str | None
    prompts: int
    exact_match: float | None = None
    top1: float | None = None
    mean_rank: float | None = None
    distractor: float | None = None  # share of greedy answers that name another fact's answer
    chance: float = 1 / 12
    status: str = "ok"
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def key(self) -> str:
        where = self.control if self.control else f"d{round(100 * self.depth):03d}"
        return f"L{self.length:06d}_{where}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_cell(model: nn.Module, builder: NeedleBuilder, tokenizer: Any, length: int,
             depth: float | None, control: str | None, prompts: int, batch_size: int = 8,
             device: str | torch.device = "cpu",
             on_batch: Callable[[int], None] | None = None) -> Cell:
    """Score ``prompts`` prompts of one cell, ``batch_size`` at a time."""
    cell = Cell(length, length / builder.block_size, depth, control, prompts,
                chance=1 / 12)
    built = [builder.build(length, i, depth, control) for i in range(prompts)]
    for i in range(0, prompts, batch_size):
        cell.rows += score_prompts(model, built[i: i + batch_size], tokenizer, device)
        if on_batch is not None:
            on_batch(len(built[i: i + batch_size]))
    n = len(cell.rows)
    cell.exact_match = sum(r["exact_match"] for r in cell.rows) / n
    cell.top1 = sum(r["rank"] == 1 for r in cell.rows) / n
    cell.mean_rank = sum(r["rank"] for r in cell.rows) / n
    cell.distractor = sum(r["distractor"] for r in cell.rows) / n
    cell.chance = 1 / len(built[0].candidates)
    return cell


def own_question_cell(model: nn.Module, tokenizer: Any, stories: Sequence[Any], prompts: int,
                      block_size: int, device: str | torch.device = "cpu") -> Cell:
    """The corpus's own colour question at the end of single validation stories, each cut to
    its last ``block_size`` tokens (a training window): the reference point the needle cells
    are read against."""
    chosen = [s for s in stories if s.kind == "colour"][:prompts]
    if not chosen:
        raise NeedleError("no validation story asks the colour question; the story corpus "
                          "is needed for this reference")
    rows = []
    for i, s in enumerate(chosen):
        ids = tokenizer(s.text[: s.answer_start].rstrip(),
                        add_special_tokens=False)["input_ids"][-block_size:]
        p = NeedlePrompt(list(ids), s.answer, list(COLOURS), len(ids), i, None, None, None)
        rows += score_prompts(model, [p], tokenizer, device)
    n = len(rows)
    return Cell(0, 0.0, None, "own_question", n,
                exact_match=sum(r["exact_match"] for r in rows) / n,
                top1=sum(r["rank"] == 1 for r in rows) / n,
                mean_rank=sum(r["rank"] for r in rows) / n, rows=rows)
