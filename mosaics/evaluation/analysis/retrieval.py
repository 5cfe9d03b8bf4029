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
- ``entry_mass`` (MQMTAR): w_s on the one entry whose value carries the token the row
  predicts. Values mix an entry's own token with the next one, v_s = unit((1 - c) v~_{s+1} +
  c v~_s), so a head with c <= 1/2 (look-ahead) finds token p in entry p - 1 and a head with
  c > 1/2 (own token) in entry p (:func:`carrier_entries`).

MQMTAR's recall can take three paths, and the profile measures each (``*_mass``, the entry
mass of that step):

- ``direct``: the row that predicts v1 (the answer's ``QSEP``) finds v1 in the block itself;
  its key must hold the query's k1 k2, 11-12 tokens back;
- ``lookup`` then ``copy``: the row right after the query's key (the next query's ``QSEP``, or
  ``SEP``) finds v1 in the block while k1 k2 are its last tokens, and the answer's row copies
  that row's token, a fixed 10 positions back;
- ``k1_lookup`` then ``k1_copy``: the row of the query's first key token k1 finds v1 in the
  block from k1 alone (before k2 is seen), and the answer's row copies that row's token, a
  fixed 12 positions back. k1 is one of 256 tokens, so another block shares it more often
  as the context grows;
- ``second``: the row that predicts v2 (the answer's v1) finds v2 in the block; its own token
  v1 is in the key of the entry it needs, but so is every other v1 of the context.

Rows: MQMTAR's 8 value tokens (the rows at the trg ``QSEP`` and ``v1`` of each answer); Sort's
sorted tokens. The head that retrieves is the one with the most block mass at the shortest
length; :func:`retrieval_table` follows it to the longer lengths, and :func:`paths_table`
the best head of each path.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from .. import tasks


def memory_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The contextual memories of a Memory Mosaics model in order (one per layer in v1)."""
    from ...memory import ContextualMemory

    found = [m for m in model.modules() if isinstance(m, ContextualMemory)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no contextual memory; retrieval weights "
                         "exist for Memory Mosaics models only")
    return found


def has_retrieval_weights(model: torch.nn.Module) -> bool:
    """Whether every contextual memory of ``model`` can give its retrieval weights (a v1
    memory with a score kernel); False for other models."""
    try:
        mems = memory_modules(model)
    except ValueError:
        return False
    return all(m.no_retrieval_weights() is None for m in mems)


@torch.no_grad()
def head_bandwidths(model: torch.nn.Module) -> list[list[float]]:
    """The bandwidth beta_h of each layer's heads ([layer][head]) as the scores use it (beta
    cos), after the kernel's :meth:`~mosaics.kernels.base.Kernel.bandwidth` map."""
    return [m.weights().beta.float().tolist() for m in memory_modules(model)]


@torch.no_grad()
def set_bandwidth(model: torch.nn.Module, layer: int, head: int, beta: float) -> None:
    """A test-time intervention: give head ``head`` of layer ``layer`` the bandwidth ``beta``
    (beta = exp(2 min(10 b, 5)), so 0 < beta <= e^10), the other weights unchanged. That is
    the memory's beta, before the kernel's ``bandwidth`` map (which only the published-code
    parametrizations change)."""
    from ...memory import BETA_LOG_CAP, EXP_SCALE

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


class MQMTARLayout(NamedTuple):
    """Where one MQMTAR sequence's recall happens. Per value row (v1 and v2 rows alternate):
    ``rows`` the position that predicts the value, ``blocks`` the answering block's six
    positions, ``targets`` the position in the block of the token the row predicts. Per
    query: ``lookups`` the row right after the query's key (the next query's QSEP, or SEP),
    ``key_rows`` the row of the query's first key token k1."""

    rows: list[int]
    blocks: list[list[int]]
    targets: list[int]
    lookups: list[int]
    key_rows: list[int]


def mqmtar_rows(tokens: np.ndarray) -> MQMTARLayout:
    """The value rows of an MQMTAR sequence and where their answers sit: answer i ``[QSEP v1
    v2]`` sits after SEP, its rows are the positions that predict v1 and v2, its block is the
    one whose key is that of query i, and its targets are the block's v1 and v2."""
    spec = tasks.MQMTAR
    tokens = np.asarray(tokens)
    sep = int(np.flatnonzero(tokens == spec.sep)[0])
    out = MQMTARLayout([], [], [], [], [])
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
        out.rows.extend([answer, answer + 1])
        out.blocks.extend([block, block])
        out.targets.extend([block[3], block[4]])
        out.lookups.append(first_query + 3 * i + 3)
        out.key_rows.append(first_query + 3 * i + 1)
    return out


def own_token_heads(mem: torch.nn.Module) -> Tensor:
    """(H,) bool: the heads whose values carry mostly the entry's own token (c > 1/2)."""
    return mem.weights().mix.detach().float().view(-1) > 0.5


def carrier_entries(targets: Tensor, own: Tensor) -> Tensor:
    """The entry whose value carries each target position, per head: targets (n,), own (H,)
    -> (H, n): p - 1 for a look-ahead head, p for an own-token head."""
    return targets.view(1, -1) - 1 + own.view(-1, 1).long()


def row_statistics(w: Tensor) -> dict[str, Tensor]:
    """w (H, n, T) weights of n rows -> per head and row (H, n): support (entries with w > 0)
    and effective (exp entropy of w / sum w; 0 for a row with no weight)."""
    total = w.sum(-1, keepdim=True)
    p = torch.where(total > 0, w / total.clamp(min=1e-30), torch.zeros_like(w))
    entropy = -(p * torch.log(p.clamp(min=1e-30))).sum(-1)
    effective = torch.where(total[..., 0] > 0, torch.exp(entropy), torch.zeros_like(entropy))
    return {"support": (w > 0).sum(-1).float(), "effective": effective}


def carried_mass(w: Tensor, targets: list[int], own: Tensor) -> Tensor:
    """w (H, n, T) of n rows -> (H, n): each row's weight on the entry that carries its target
    position (:func:`carrier_entries`)."""
    entries = carrier_entries(torch.tensor(targets, device=w.device), own)
    return w.gather(-1, entries.unsqueeze(-1)).squeeze(-1)


def _path_masses(w: Tensor, layout: MQMTARLayout, own: Tensor) -> dict[str, Tensor]:
    """The MQMTAR masses (H, rows) of one layer's weights w (H, 8 + 4 + 4, T) over the value
    rows, the lookup rows, then the key rows of ``layout``."""
    n, q = len(layout.rows), len(layout.lookups)
    value_w, lookup_w, key_w = w[:, :n], w[:, n:n + q], w[:, n + q:]
    on_block = torch.zeros_like(value_w[0], dtype=torch.bool)
    for r, block in enumerate(layout.blocks):
        on_block[r, block] = True
    entry = carried_mass(value_w, layout.targets, own)
    return {
        "block_mass": (value_w * on_block).sum(-1),
        "entry_mass": entry,
        "direct_mass": entry[:, 0::2],  # the rows that predict v1
        "second_mass": entry[:, 1::2],  # the rows that predict v2
        "lookup_mass": carried_mass(lookup_w, layout.targets[0::2], own),  # finds v1
        "copy_mass": carried_mass(value_w[:, 0::2], layout.lookups, own),  # reads the lookup
        "k1_lookup_mass": carried_mass(key_w, layout.targets[0::2], own),  # finds v1 from k1
        "k1_copy_mass": carried_mass(value_w[:, 0::2], layout.key_rows, own),  # reads that row
    }


@torch.no_grad()
def retrieval_profile(model: torch.nn.Module, task: str, samples: list[tasks.Sample],
                      device: str | torch.device = "cpu") -> dict[str, list[list[float]]]:
    """Means over the samples' rows, per layer and head ([layer][head]): ``support`` and
    ``effective`` of the value rows, and (MQMTAR) ``block_mass``, ``entry_mass`` and the masses
    of each path (``direct_mass``, ``lookup_mass``, ``copy_mass``, ``k1_lookup_mass``,
    ``k1_copy_mass``, ``second_mass``); scalars:
    ``exact_match`` over the samples and (MQMTAR) the token accuracy of the v1 and v2 rows
    (``v1_accuracy``, ``v2_accuracy``); the heads' bandwidths ``beta``."""
    model.eval()
    mems = memory_modules(model)
    own = [own_token_heads(m).to(device) for m in mems]
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = {}
    hits = 0
    right = np.zeros(2)
    for sample in samples:
        ids = torch.from_numpy(sample.tokens).view(1, -1).to(device)
        layout = mqmtar_rows(sample.tokens) if task == "mqmtar" else None
        # the rows that predict the scored tokens (MQMTAR: then the lookup and key rows)
        rows = layout.rows + layout.lookups + layout.key_rows if layout else (
            np.flatnonzero(sample.score_mask) - 1).tolist()
        n = len(layout.rows) if layout else len(rows)
        xs, logits = memory_inputs(model, ids)
        mask = torch.from_numpy(sample.score_mask).view(1, -1).to(device)
        hits += int(tasks.exact_match(logits, ids, mask).sum())
        if layout:
            predicted = logits[0, layout.rows].argmax(-1).cpu().numpy()
            correct = predicted == sample.tokens[np.asarray(layout.rows) + 1]
            right += [correct[0::2].sum(), correct[1::2].sum()]
        index = torch.tensor(rows, device=device)
        for layer, (mem, x) in enumerate(zip(mems, xs)):
            w = mem.retrieval_weights(x, index)[0]  # (H, rows, T)
            stats = row_statistics(w[:, :n])
            if layout:
                stats.update(_path_masses(w, layout, own[layer]))
            for key, value in stats.items():
                sums.setdefault(key, torch.zeros(len(mems), w.shape[0], dtype=torch.float64))
                sums[key][layer] += value.sum(-1).double().cpu()
                if layer == 0:
                    counts[key] = counts.get(key, 0) + value.shape[-1]
    out: dict[str, Any] = {k: (v / counts[k]).tolist() for k, v in sums.items()}
    out["exact_match"] = hits / len(samples)
    if task == "mqmtar":
        out["v1_accuracy"], out["v2_accuracy"] = (right / (len(samples) * tasks.N_QUERIES)).tolist()
    out["beta"] = head_bandwidths(model)
    return out


ROW_CHUNK = 256  # query rows per retrieval_weights call in empty_rows


@torch.no_grad()
def empty_rows(model: torch.nn.Module, input_ids: Tensor, first: int = 2) -> list[list[float]]:
    """Per layer and head ([layer][head]), the share of the rows t >= ``first`` of
    ``input_ids`` (B, T) whose kernel gives no past entry any weight: the row's output is 0 and
    it passes no gradient to the keys or the bandwidth (fixed-bandwidth kernels only; every
    other built-in kernel always weights some entry)."""
    if not 1 <= first < input_ids.shape[1]:
        raise ValueError(f"first={first}: rows t >= first must exist and have a past (1 <= "
                         f"first < {input_ids.shape[1]}, the sequence length)")
    model.eval()
    inputs, _ = memory_inputs(model, input_ids)
    rows = torch.arange(first, input_ids.shape[1], device=input_ids.device)
    out = []
    for mem, x in zip(memory_modules(model), inputs):
        # Rows in chunks, so a long sequence never holds the whole (B, H, T, T) weight map.
        counts = sum((mem.retrieval_weights(x, chunk).sum(-1) == 0).double().sum(dim=(0, 2))
                     for chunk in rows.split(ROW_CHUNK))
        out.append((counts / (x.shape[0] * len(rows))).tolist())
    return out


def empty_rows_table(shares: dict[str, list[list[float]]]) -> str:
    """Markdown: per model, the mean share of empty rows over its heads, the heads with more
    than half their rows empty, and every head's share (one group per layer)."""
    lines = ["| model | empty rows (mean of heads) | heads over 1/2 | per layer: heads |",
             "|---|---|---|---|"]
    for label, by_layer in shares.items():
        flat = [v for layer in by_layer for v in layer]
        over = sum(v > 0.5 for v in flat)
        heads = " / ".join(" ".join(f"{v:.2f}" for v in layer) for layer in by_layer)
        lines.append(f"| {label} | {np.mean(flat):.2f} | {over} of {len(flat)} | {heads} |")
    return "\n".join(lines)


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
    length) with its block mass, entry mass, support and effective support, and the exact
    match."""
    lines = ["| model | length | exact match | head (layer.head) | beta | block mass | entry mass "
             "| support | effective support |", "|---|---|---|---|---|---|---|---|---|"]
    for label, by_length in profiles.items():
        layer, head = retrieval_head(by_length[min(by_length)])
        for length in sorted(by_length):
            p = by_length[length]
            mass = f"{p['block_mass'][layer][head]:.3f}" if "block_mass" in p else "-"
            entry = f"{p['entry_mass'][layer][head]:.3f}" if "entry_mass" in p else "-"
            beta = f"{p['beta'][layer][head]:.0f}" if "beta" in p else "-"
            lines.append(f"| {label} | {length} | {p['exact_match']:.2f} | {layer}.{head} | "
                         f"{beta} | {mass} | {entry} | {p['support'][layer][head]:.1f} | "
                         f"{p['effective'][layer][head]:.1f} |")
    return "\n".join(lines)


PATHS = ("direct_mass", "lookup_mass", "copy_mass", "k1_lookup_mass", "k1_copy_mass",
         "second_mass")


def path_summary(profile: dict[str, Any]) -> dict[str, float]:
    """One MQMTAR profile in a few scalars, for a training log: each path's entry mass at its
    best head (the max over layers and heads, e.g. ``direct_mass``) and the token accuracy
    of the v1 and v2 rows. Which path grows first shows the route a seed takes."""
    missing = [k for k in (*PATHS, "v1_accuracy", "v2_accuracy") if k not in profile]
    if missing:
        raise ValueError(f"not an MQMTAR profile: {', '.join(missing)} missing")
    out = {k: float(np.max(profile[k])) for k in PATHS}
    out.update(v1_accuracy=float(profile["v1_accuracy"]),
               v2_accuracy=float(profile["v2_accuracy"]))
    return out


def route_history(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The validations of a training history (a result file's ``train.history`` or the rows
    of ``metrics.jsonl``, which logs the loss and the routes as separate rows of one step)
    that carry the recall's routes (:func:`path_summary`, logged as ``val/direct_mass``, ...),
    one merged row per step in step order."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), {}).update(row)
    return [by_step[s] for s in sorted(by_step) if "val/direct_mass" in by_step[s]]


def routes_table(histories: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown: per run and validation (:func:`route_history` rows), the validation exact
    match, the token accuracy of the v1 and v2 rows and each path's best-head entry mass."""
    lines = ["| run | step | val exact match | v1 / v2 accuracy | direct | lookup | copy | "
             "k1 lookup | k1 copy | second |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, rows in histories.items():
        for r in rows:
            masses = " | ".join(f"{r[f'val/{k}']:.2f}" for k in PATHS)
            lines.append(f"| {label} | {r['step']} | {r.get('val/exact_match', float('nan')):.2f}"
                         f" | {r['val/v1_accuracy']:.2f} / {r['val/v2_accuracy']:.2f} | "
                         f"{masses} |")
    return "\n".join(lines)


def paths_table(profiles: dict[str, dict[int, dict[str, Any]]]) -> str:
    """Markdown (MQMTAR): per model and length, the token accuracy of the v1 and v2 rows and,
    for each path of the recall, the head with the most entry mass at the model's shortest
    length and its entry mass; empty when no profile has the paths."""
    rows = []
    for label, by_length in profiles.items():
        first = by_length[min(by_length)]
        if not all(k in first for k in PATHS):
            continue
        heads = [retrieval_head(first, k) for k in PATHS]
        for length in sorted(by_length):
            p = by_length[length]
            cells = [f"{lh[0]}.{lh[1]}: {p[k][lh[0]][lh[1]]:.2f}" for k, lh in zip(PATHS, heads)]
            rows.append(f"| {label} | {length} | {p['exact_match']:.2f} | "
                        f"{p['v1_accuracy']:.2f} / {p['v2_accuracy']:.2f} | "
                        + " | ".join(cells) + " |")
    if not rows:
        return ""
    return "\n".join(["| model | length | exact match | token accuracy v1 / v2 | direct | lookup "
                      "| copy | k1 lookup | k1 copy | second |",
                      "|---|---|---|---|---|---|---|---|---|---|", *rows])
