"""Length-extrapolation tasks: Sort and MQMTAR (multi-query multi-token associative recall).

Every sequence is ``[BOS] src [SEP] trg [EOS]``. The loss covers the trg tokens and EOS
(``target_mask``); scoring is teacher-forced: the prediction for position p is the argmax
of the logits at p - 1, and a sequence is an exact match when every position in
``score_mask`` is predicted right.

Sort (vocab 36): src ~ U{0..31}^len, trg = sorted(src); BOS 32, SEP 33, EOS 34, PAD 35.
Exact match: the ``len`` sorted tokens.

MQMTAR (vocab 263): content tokens 0..255; BOS 256, SEP 257, EOS 258, PAD 259,
KVSEP 260, QSEP 261, FILL 262. The context part has exactly ``len`` tokens: num_kv =
floor(0.8 len / 6) blocks ``[k1 k2 KVSEP v1 v2 FILL]`` (keys are distinct 2-token pairs,
values are uniform 2-token pairs) placed in uniformly random order among
len - 6 num_kv FILL tokens. Then 4 queries ``[QSEP k1 k2]`` (keys drawn from the present
ones with replacement) complete src; trg = ``[QSEP v1 v2]`` x 4. Exact match: the 8 value
tokens of trg.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError


@dataclass(frozen=True)
class TaskSpec:
    name: str
    vocab_size: int
    bos: int
    sep: int
    eos: int
    pad: int
    n_layer: int
    shortest: int  # the shortest sample's context (MQMTAR: one key-value pair)


SORT = TaskSpec("sort", vocab_size=36, bos=32, sep=33, eos=34, pad=35, n_layer=2, shortest=2)
MQMTAR = TaskSpec("mqmtar", vocab_size=263, bos=256, sep=257, eos=258, pad=259, n_layer=4,
                  shortest=8)
KVSEP, QSEP, FILL = 260, 261, 262
N_QUERIES = 4
TASKS = {"sort": SORT, "mqmtar": MQMTAR}


@dataclass
class Sample:
    """tokens (L,), target_mask (L,) (loss positions: trg and EOS), score_mask (L,)."""

    tokens: np.ndarray
    target_mask: np.ndarray
    score_mask: np.ndarray


def _assemble(spec: TaskSpec, src: list[int], trg: list[int], scored: list[int]) -> Sample:
    tokens = np.asarray([spec.bos, *src, spec.sep, *trg, spec.eos], dtype=np.int64)
    start = len(src) + 2
    target = np.zeros(len(tokens), dtype=bool)
    target[start:] = True
    score = np.zeros(len(tokens), dtype=bool)
    score[[start + i for i in scored]] = True
    return Sample(tokens, target, score)


def sort_sample(rng: np.random.Generator, length: int) -> Sample:
    """Sort: src ~ U{0..31}^length, trg = sorted(src)."""
    src = rng.integers(0, 32, size=length).tolist()
    return _assemble(SORT, src, sorted(src), list(range(length)))


def mqmtar_sample(rng: np.random.Generator, length: int) -> Sample:
    """MQMTAR with a context of ``length`` tokens (see the module docstring)."""
    num_kv = int(0.8 * length // 6)
    if num_kv < 1:
        raise ValueError(f"MQMTAR needs length >= {MQMTAR.shortest} (one key-value pair), "
                         f"got {length}")
    codes = rng.choice(256 * 256, size=num_kv, replace=False)
    keys = [(int(c) // 256, int(c) % 256) for c in codes]
    values = [(int(a), int(b)) for a, b in rng.integers(0, 256, size=(num_kv, 2))]
    n_fill = length - 6 * num_kv
    is_block = np.zeros(num_kv + n_fill, dtype=bool)
    is_block[rng.choice(num_kv + n_fill, size=num_kv, replace=False)] = True
    src: list[int] = []
    j = 0
    for block in is_block:
        if block:
            src += [*keys[j], KVSEP, *values[j], FILL]
            j += 1
        else:
            src.append(FILL)
    trg: list[int] = []
    scored: list[int] = []
    for q in rng.integers(0, num_kv, size=N_QUERIES):
        src += [QSEP, *keys[q]]
        scored += [len(trg) + 1, len(trg) + 2]
        trg += [QSEP, *values[q]]
    return _assemble(MQMTAR, src, trg, scored)


SAMPLERS: dict[str, Callable[[np.random.Generator, int], Sample]] = {
    "sort": sort_sample, "mqmtar": mqmtar_sample}


def collate(samples: list[Sample], pad: int) -> dict[str, Tensor]:
    """Right-pad; labels = tokens on target positions, -100 elsewhere; score_mask (B, L)."""
    t_max = max(len(s.tokens) for s in samples)
    ids = torch.full((len(samples), t_max), pad, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    score = torch.zeros_like(ids, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        ids[i, :n] = torch.from_numpy(s.tokens)
        labels[i, :n][torch.from_numpy(s.target_mask)] = torch.from_numpy(s.tokens[s.target_mask])
        score[i, :n] = torch.from_numpy(s.score_mask)
    return {"input_ids": ids, "labels": labels, "score_mask": score}


def exact_match(logits: Tensor, input_ids: Tensor, score_mask: Tensor) -> Tensor:
    """(B,) bool: teacher-forced argmax logits[:, p-1] equals input_ids[:, p] at every scored p."""
    pred = logits[:, :-1].argmax(-1)
    ok = (pred == input_ids[:, 1:]) | ~score_mask[:, 1:]
    return ok.all(-1)


class RandomTaskBatches:
    """Endless training batches of a task; each sample's length ~ U{min_len..max_len}.

    ``curriculum_steps`` N > 0 grows the lengths over the first N batches: batch i < N draws
    from U{lo(i)..hi(i)} with lo(i) = s + (min_len - s) i / N and hi(i) = s + (max_len - s) i / N
    (rounded; s: the task's shortest sample, MQMTAR's one key-value pair), so MQMTAR training
    starts on one pair and reaches the full range at batch N.

    ``batch(i)`` is a pure function of (task, sizes, seed, i), so a resumed run is exact."""

    def __init__(self, task: str, batch_size: int, min_len: int, max_len: int,
                 seed: int, curriculum_steps: int = 0) -> None:
        if curriculum_steps < 0:
            raise ValueError(f"curriculum_steps must be >= 0 (0: no curriculum), "
                             f"got {curriculum_steps}")
        self.task, self.batch_size, self.min_len, self.max_len = task, batch_size, min_len, max_len
        self.seed, self.curriculum_steps = seed, curriculum_steps

    def lengths(self, index: int) -> tuple[int, int]:
        """(lo, hi): the range of sample lengths of batch ``index``."""
        if index >= self.curriculum_steps:
            return self.min_len, self.max_len
        start, frac = min(TASKS[self.task].shortest, self.min_len), index / self.curriculum_steps
        return (round(start + (self.min_len - start) * frac),
                round(start + (self.max_len - start) * frac))

    def batch(self, index: int) -> dict[str, Tensor]:
        rng = np.random.default_rng([self.seed, 7, index])
        lo, hi = self.lengths(index)
        lens = rng.integers(lo, hi + 1, size=self.batch_size)
        batch = collate([SAMPLERS[self.task](rng, int(n)) for n in lens], TASKS[self.task].pad)
        batch.pop("score_mask")
        return batch

    def state_dict(self) -> dict:
        state = {"task": self.task, "batch_size": self.batch_size, "min_len": self.min_len,
                 "max_len": self.max_len, "seed": self.seed}
        if self.curriculum_steps:  # absent when 0, as in checkpoints written before the option
            state["curriculum_steps"] = self.curriculum_steps
        return state

    def load_state_dict(self, state: dict) -> None:
        if state != self.state_dict():
            raise DataError(f"the checkpoint's batches ({state}) differ from this run's "
                             f"({self.state_dict()}); resume with the same task settings")


def fixed_set(task: str, n: int, length: int | tuple[int, int], seed: int) -> list[Sample]:
    """``n`` seeded samples at one length (or lengths ~ U{lo..hi})."""
    rng = np.random.default_rng([seed, 11, *(length if isinstance(length, tuple) else (length,))])
    sampler = SAMPLERS[task]
    if isinstance(length, tuple):
        return [sampler(rng, int(rng.integers(length[0], length[1] + 1))) for _ in range(n)]
    return [sampler(rng, length) for _ in range(n)]


@torch.no_grad()
def evaluate_exact_match(model: torch.nn.Module, task: str, samples: list[Sample],
                         batch_size: int, device: str | torch.device = "cpu") -> dict[str, float]:
    """Exact-match rate of ``samples`` (teacher-forced argmax) and the per-token accuracy on
    the scored positions."""
    model.eval()
    pad = TASKS[task].pad
    hits = right = scored = 0
    for i in range(0, len(samples), batch_size):
        batch = collate(samples[i: i + batch_size], pad)
        ids = batch["input_ids"].to(device)
        mask = batch["score_mask"].to(device)
        logits = model(input_ids=ids).logits
        hits += int(exact_match(logits, ids, mask).sum())
        ok = logits[:, :-1].argmax(-1) == ids[:, 1:]
        right += int((ok & mask[:, 1:]).sum())
        scored += int(mask[:, 1:].sum())
    return {"exact_match": hits / len(samples), "token_accuracy": right / max(scored, 1)}
