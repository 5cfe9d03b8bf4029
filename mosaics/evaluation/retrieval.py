"""Where the contextual memory looks: the retrieval weights of a trained task model, per layer
and head, at the rows that predict the scored tokens.

For each query row the kernel gives weights w_s over the entries s < t
(:meth:`ContextualMemory.retrieval_weights`); this module summarises them as

- ``support``: the number of entries with w_s > 0 (all of them for the Gaussian kernel, a few
  for the compact ones);
- ``effective``: exp(entropy) of the row, w / sum w (how many entries the weight is spread
  over, comparable across kernels);
- ``block_mass`` (MQMTAR): sum of w_s over the six entries of the key-value block that answers
  the row's query, ``[k1 k2 KVSEP v1 v2 FILL]``; the recall needs the weight there, and how
  much of it survives a longer context is what length extrapolation measures;
- ``entry_mass`` (MQMTAR): w_s on the one entry of that block whose value holds the answer.
  Values look one step ahead, v_s = unit((1 - c) v~_{s+1} + c v~_s), so the row that predicts
  v1 needs the entry at KVSEP and the row that predicts v2 the entry at v1. Block mass counts
  the weight on the right block, entry mass only the weight on the right entry of it.

Rows: MQMTAR's 8 value tokens (the rows at the trg ``QSEP`` and ``v1`` of each answer); Sort's
sorted tokens. The head that retrieves is the one with the most block mass at the shortest
length; :func:`retrieval_table` follows it to the longer lengths.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import tasks


def memory_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The contextual memories of a Memory Mosaics model in order (one per layer in v1)."""
    from ..memory import ContextualMemory

    found = [m for m in model.modules() if isinstance(m, ContextualMemory)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no contextual memory; retrieval weights "
                         "exist for Memory Mosaics models only")
    return found


@torch.no_grad()
def head_bandwidths(model: torch.nn.Module) -> list[list[float]]:
    """The bandwidth beta_h of each layer's heads ([layer][head]): the scores are beta cos."""
    return [m.weights().beta.float().tolist() for m in memory_modules(model)]


@torch.no_grad()
def set_bandwidth(model: torch.nn.Module, layer: int, head: int, beta: float) -> None:
    """A test-time intervention: give head ``head`` of layer ``layer`` the bandwidth ``beta``
    (beta = exp(2 min(10 b, 5)), so 0 < beta <= e^10), the other weights unchanged."""
    from ..memory import BETA_LOG_CAP, EXP_SCALE

    mems = memory_modules(model)
    if not 0 <= layer < len(mems):
        raise ValueError(f"layer {layer}: the model has layers 0..{len(mems) - 1}")
    mem = mems[layer]
    if mem.bandwidth_b is None:
        raise ValueError(f"layer {layer} has an adaptive bandwidth (a v2 option), not one per "
                         "head; there is no beta to set")
    if not 0 <= head < mem.n_head:
        raise ValueError(f"head {head}: the model has heads 0..{mem.n_head - 1}")
    if not 0 < beta <= math.exp(2 * BETA_LOG_CAP):
        raise ValueError(f"beta {beta} is out of range: 0 < beta <= e^10 = "
                         f"{math.exp(2 * BETA_LOG_CAP):.0f}")
    mem.bandwidth_b[head] = math.log(beta) / (2 * EXP_SCALE)


@torch.no_grad()
def memory_inputs(model: torch.nn.Module, input_ids: Tensor) -> tuple[list[Tensor], Tensor]:
    """One forward of ``input_ids`` (B, T): the input (B, T, d) of each contextual memory, and
    the logits (B, T, V)."""
    inputs: list[Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: inputs.append(args[0]))
             for m in memory_modules(model)]
    try:
        logits = model(input_ids=input_ids).logits
    finally:
        for h in hooks:
            h.remove()
    return inputs, logits


def mqmtar_rows(tokens: np.ndarray) -> tuple[list[int], list[list[int]], list[int]]:
    """The query rows of an MQMTAR sequence and, for each, the positions of the key-value block
    that answers it and the answering entry: answer i ``[QSEP v1 v2]`` sits after SEP, its rows
    are the positions that predict v1 and v2, its block is the one whose key is that of query
    i, and its entries are the block's KVSEP and v1 (their one-step-ahead values are v1, v2)."""
    spec = tasks.MQMTAR
    tokens = np.asarray(tokens)
    sep = int(np.flatnonzero(tokens == spec.sep)[0])
    rows: list[int] = []
    blocks: list[list[int]] = []
    entries: list[int] = []
    first_query = sep - 3 * tasks.N_QUERIES
    for i in range(tasks.N_QUERIES):
        k1, k2 = tokens[first_query + 3 * i + 1], tokens[first_query + 3 * i + 2]
        hits = np.flatnonzero((tokens[:first_query - 2] == k1) & (tokens[1:first_query - 1] == k2)
                              & (tokens[2:first_query] == tasks.KVSEP))
        if len(hits) != 1:
            raise ValueError(f"query {i} (key {k1} {k2}) matches {len(hits)} blocks; not an "
                             "MQMTAR sequence")
        block = list(range(int(hits[0]), int(hits[0]) + 6))
        answer = sep + 1 + 3 * i  # the trg QSEP: predicts v1; then v1 predicts v2
        rows += [answer, answer + 1]
        blocks += [block, block]
        entries += [block[2], block[3]]
    return rows, blocks, entries


def row_statistics(w: Tensor) -> dict[str, Tensor]:
    """w (H, n, T) weights of n rows -> per head and row (H, n): support (entries with w > 0)
    and effective (exp entropy of w / sum w; 0 for a row with no weight)."""
    total = w.sum(-1, keepdim=True)
    p = torch.where(total > 0, w / total.clamp(min=1e-30), torch.zeros_like(w))
    entropy = -(p * torch.log(p.clamp(min=1e-30))).sum(-1)
    effective = torch.where(total[..., 0] > 0, torch.exp(entropy), torch.zeros_like(entropy))
    return {"support": (w > 0).sum(-1).float(), "effective": effective}


@torch.no_grad()
def retrieval_profile(model: torch.nn.Module, task: str, samples: list[tasks.Sample],
                      device: str | torch.device = "cpu") -> dict[str, list[list[float]]]:
    """Means over the samples' query rows, per layer and head ([layer][head]): ``support``,
    ``effective`` and (MQMTAR) ``block_mass`` and ``entry_mass``, the latter also over the
    rows that predict v1 (``v1_entry_mass``: the recall proper, the query's key k1 k2 sits
    11-12 tokens back) and v2 (``v2_entry_mass``: the row's own token, v1, is in the entry's
    key); ``exact_match`` over the samples and the heads' bandwidths ``beta`` as well."""
    model.eval()
    mems = memory_modules(model)
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = {}
    hits = 0
    for sample in samples:
        ids = torch.from_numpy(sample.tokens).view(1, -1).to(device)
        if task == "mqmtar":
            rows, blocks, entries = mqmtar_rows(sample.tokens)
        else:  # the rows that predict the scored tokens
            rows, blocks, entries = (np.flatnonzero(sample.score_mask) - 1).tolist(), None, None
        xs, logits = memory_inputs(model, ids)
        mask = torch.from_numpy(sample.score_mask).view(1, -1).to(device)
        hits += int(tasks.exact_match(logits, ids, mask).sum())
        index = torch.tensor(rows, device=device)
        for layer, (mem, x) in enumerate(zip(mems, xs)):
            w = mem.retrieval_weights(x, index)[0]  # (H, n, T)
            stats = row_statistics(w)
            if blocks is not None:
                on_block = torch.zeros_like(w[0], dtype=torch.bool)
                for r, block in enumerate(blocks):
                    on_block[r, block] = True
                stats["block_mass"] = (w * on_block).sum(-1)
                stats["entry_mass"] = w[:, torch.arange(len(rows)), torch.tensor(entries)]
                stats["v1_entry_mass"] = stats["entry_mass"][:, 0::2]  # rows alternate v1, v2
                stats["v2_entry_mass"] = stats["entry_mass"][:, 1::2]
            for key, value in stats.items():
                sums.setdefault(key, torch.zeros(len(mems), w.shape[0], dtype=torch.float64))
                sums[key][layer] += value.sum(-1).double().cpu()
                if layer == 0:
                    counts[key] = counts.get(key, 0) + value.shape[-1]
    out: dict[str, Any] = {k: (v / counts[k]).tolist() for k, v in sums.items()}
    out["exact_match"] = hits / len(samples)
    out["beta"] = head_bandwidths(model)
    return out


def retrieval_head(profile: dict[str, Any], metric: str = "block_mass") -> tuple[int, int]:
    """(layer, head) with the most ``metric`` (MQMTAR: ``block_mass`` or an entry mass), or
    else (Sort) the smallest effective support."""
    if metric in profile:
        values = np.asarray(profile[metric])
        flat = int(values.argmax())
    else:
        values = np.asarray(profile["effective"])
        flat = int(np.where(values > 0, values, np.inf).argmin())
    return divmod(flat, values.shape[1])


def retrieval_table(profiles: dict[str, dict[int, dict[str, Any]]]) -> str:
    """Markdown: per model and length, the retrieval head (found at the model's shortest
    length) with its block mass, entry mass, support and effective support, the exact match,
    and (MQMTAR) the heads with the most entry mass on the v1 rows and on the v2 rows."""
    lines = ["| model | length | exact match | head (layer.head) | beta | block mass | entry mass "
             "| support | effective support | v1 rows: head, entry mass | v2 rows: head, "
             "entry mass |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, by_length in profiles.items():
        first = by_length[min(by_length)]
        layer, head = retrieval_head(first)
        by_kind = {k: retrieval_head(first, k) for k in ("v1_entry_mass", "v2_entry_mass")
                   if k in first}
        for length in sorted(by_length):
            p = by_length[length]
            mass = f"{p['block_mass'][layer][head]:.3f}" if "block_mass" in p else "-"
            entry = f"{p['entry_mass'][layer][head]:.3f}" if "entry_mass" in p else "-"
            beta = f"{p['beta'][layer][head]:.0f}" if "beta" in p else "-"
            kinds = [f"{lh[0]}.{lh[1]}, {p[k][lh[0]][lh[1]]:.3f}" if k in p else "-"
                     for k, lh in by_kind.items()] or ["-", "-"]
            lines.append(f"| {label} | {length} | {p['exact_match']:.2f} | {layer}.{head} | "
                         f"{beta} | {mass} | {entry} | {p['support'][layer][head]:.1f} | "
                         f"{p['effective'][layer][head]:.1f} | {kinds[0]} | {kinds[1]} |")
    return "\n".join(lines)
