"""Work model of the fused kernels: QK^T sweeps, products and tiles visited per causal tile.

A replica, in PyTorch (fp32 scores), of each fused Triton kernel's loop bounds and stopping
rules (``mosaics/ops/triton_kernels/``), run on given keys; it counts what the kernels would
do, without running them:

- power kernels (``power_attention.py``): per block of BLOCK_M query rows, a row-max sweep
  over its key blocks (anchor at the row max; it also sums the subset bounds that start
  Newton), the Newton passes of the entmax threshold (from the best lower bound until no row
  of the block moves by more than the dtype's tolerance, at most ``NEWTON_STEPS``), each
  reading only the tiles a previous pass left live, the output sweep over the tiles still
  live; a tile is *live* when some u > 0 in it. Backward: ``_power_bwd_dq`` (entmax: a first
  sweep for c) and ``_power_bwd_dkv``, each on the forward's live tiles only;
- kNN (``knn_attention.py``): pass 1 (running top-k; a key block none of whose scores beats
  its row's current k-th is skipped, one adding at most ``MERGE_INSERTS`` entries to every
  row is inserted step by step, any other runs the bitonic network), pass 2 (weights, the tie
  cumsum only on a tile where a row's ties at its k-th value cross the count it takes);
  backward dK/dV and (Gaussian) dQ over every causal tile;
- FSKA (``linear_attention.py``): the chunked scan, by its products (no score tiles off the
  diagonal).

Products count tile products of BLOCK_M x BLOCK_N x head size (QK^T, P V, dP = dO V^T,
dV, dK, dQ); a "sweep" is one QK^T over every causal tile of a row block, averaged over the
row blocks weighted by their tile counts. Reference: FlashAttention-2, 1 sweep and 2 products
forward, 5 products backward.

    OMP_NUM_THREADS=1 python bench/work_model.py                           # T 1024 4096 bf16
    OMP_NUM_THREADS=1 python bench/work_model.py --dtype fp32
    OMP_NUM_THREADS=1 python bench/work_model.py --lengths 16384 --heads 1
    OMP_NUM_THREADS=1 python bench/work_model.py --model runs/x/final --tokens val.npy
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mosaics.ops.knn_attention import MERGE_INSERTS  # noqa: E402
from mosaics.ops.power_attention import (  # noqa: E402
    NEWTON_STEPS,
    NEWTON_TOL,
    newton_pred,
    newton_tol,
)

BETA = 7.39  # the check's bandwidth (e^2, the reference initialization)
POWER = ("epanechnikov", "biweight", "triweight", "entmax", "relumax", "epanechnikov_fixed")
KNN = ("gaussian_knn", "uniform_knn")
FA2 = {"fwd_sweeps": 1.0, "fwd_products": 2.0, "bwd_products": 5.0}


def check_keys(T: int, H: int, hs: int, seed: int = 0) -> torch.Tensor:
    """gpu_check's inputs: unit random keys (1, H, T, hs) from the seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(1, H, T, hs, generator=g), dim=-1)


def _gpu_check():  # noqa: ANN202
    """bench/gpu_check.py as a module: its inputs are the ones counted here."""
    spec = importlib.util.spec_from_file_location("bench_gpu_check",
                                                  Path(__file__).with_name("gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


clustered_keys = _gpu_check().clustered_keys


def kernel_form(name: str) -> dict[str, Any]:
    """(r, scale of beta, anchor, shift, entmax) of a power kernel, from the registry."""
    from mosaics import get_kernel

    k = get_kernel(name)
    anchor, shift, entmax = k.fused_form()
    return {"kernel": k, "r": float(k.power), "scale": float(k.score_scale), "anchor": anchor,
            "shift": shift, "entmax": entmax}


def _tile_any(u: torch.Tensor, r0: int, bm: int, bn: int) -> torch.Tensor:
    """(row blocks, key blocks) whether a tile of u (rows r0.., keys 0..) has u > 0."""
    m, w = u.shape
    pr, pc = -m % bm, -w % bn
    pos = torch.nn.functional.pad(u > 0, (0, pc, 0, pr))
    return pos.view((m + pr) // bm, bm, (w + pc) // bn, bn).any(3).any(1)


START_DELTAS = (0.5, 0.25)  # the forward's subset bounds (power_attention.py)
START_MARGIN = 1e-3


def subset_start(c: torch.Tensor, a: float, r: float, bn: int) -> torch.Tensor:
    """The fused forward's Newton start (rows, 1) from scores c (rows, keys; -inf where not
    visible), read in key tiles of bn as its row-max pass does: max(-1, the best subset bound
    tau_A - ``START_MARGIN``), A_k the entries within delta_k / a of the running row max."""
    rows, width = c.shape
    m = torch.full((rows, 1), float("-inf"))
    deltas = torch.tensor(START_DELTAS).view(1, 1, -1) / a
    sums = torch.zeros(rows, len(START_DELTAS))
    counts = torch.zeros(rows, len(START_DELTAS))
    for j0 in range(0, width, bn):
        tile = c[:, j0:j0 + bn]
        m = torch.maximum(m, tile.amax(1, keepdim=True))
        inside = tile.unsqueeze(2) > (m.unsqueeze(2) - deltas)
        sums += torch.where(inside, tile.unsqueeze(2), 0.0).sum(1)
        counts += inside.sum(1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    safe = counts.clamp_min(1)
    low = torch.where(counts > 0, (a * (sums - counts * m) - safe.pow(1 - 1 / r)) / safe, -1.0)
    return torch.maximum(low.amax(1, keepdim=True) - START_MARGIN, torch.tensor(-1.0))


def newton(x: torch.Tensor, r: float, blocks: torch.Tensor, n_blocks: int,
           tau0: torch.Tensor | None = None, tol: float = NEWTON_TOL, bn: int = 64,
           tiles: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The fused forward's threshold solve on scaled scores x (rows, keys; -inf where not
    visible): Newton on (sum_j [x_j - tau]_+^r)^(1/r) = 1 from ``tau0`` (default -1), every
    row of a block stepping until no row of that block moves by more than ``tol`` (at most
    ``NEWTON_STEPS``); a pass reads only the key tiles (of bn) still live in its block, and
    clears those where no row has weight. A pass after a step below ``newton_pred`` also
    makes the output; when it is the last, its tau is the shift and no output pass follows
    (the block is *fused*). ``tiles``: (n_blocks,) key tiles each block reads (default:
    all). Returns the shift (rows, 1), the passes of each block (n_blocks,), the tiles each
    block read over its passes (n_blocks,), the live flags (n_blocks, key tiles), whether
    each block is fused (n_blocks,) and the value products of passes that made an output and
    were not the last (n_blocks,)."""
    width = x.shape[1]
    n_kt = -(-width // bn)
    tiles = torch.full((n_blocks,), n_kt) if tiles is None else tiles
    live = torch.arange(n_kt).view(1, -1) < tiles.view(-1, 1)
    tau = torch.full((x.shape[0], 1), -1.0) if tau0 is None else tau0.clone()
    shift = tau.clone()
    its = torch.zeros(n_blocks)
    read = torch.zeros(n_blocks)
    done = torch.zeros(n_blocks, dtype=torch.bool)
    fused = torch.zeros(n_blocks, dtype=torch.bool)
    wasted = torch.zeros(n_blocks)
    last = torch.full((n_blocks,), float("inf"))
    pred = newton_pred(r, tol)
    for _ in range(NEWTON_STEPS):
        d = (x - tau).clamp_min(0)
        read += torch.where(done, 0.0, live.sum(1).float())
        pos = torch.nn.functional.pad(d > 0, (0, -width % bn)).view(x.shape[0], n_kt, bn).any(2)
        block_pos = torch.zeros(n_blocks, n_kt).index_add_(0, blocks, pos.float()) > 0
        live = torch.where(done.view(-1, 1), live, live & block_pos)
        spec_pv = torch.where(done | ~(last < pred), 0.0, live.sum(1).float())
        f = d.pow(r).sum(1, keepdim=True)
        s = ((d > 0).float() if r == 1 else d.pow(r - 1)).sum(1, keepdim=True)
        f_low = torch.where(f > 0, f.clamp_min(1e-38).pow(1 - 1 / r), 0.0)
        step = torch.where(s > 0, (f - f_low) / s.clamp_min(1e-38), 0.0)
        spec = last < pred
        active = ~done
        moving = torch.zeros(n_blocks).index_add_(
            0, blocks, (step.abs() > tol).float().view(-1)) > 0
        fused = torch.where(active, spec & ~moving, fused)
        wasted += torch.where(active & moving, spec_pv, 0.0)  # value products thrown away
        shift = torch.where(active[blocks].view(-1, 1), tau, shift)  # this pass's tau
        tau = torch.where(active[blocks].view(-1, 1), tau + step, tau)
        its = torch.where(active, its + 1, its)
        last = torch.where(active, _block_max(step.abs().view(-1), blocks, n_blocks), last)
        done = done | ~moving
        if bool(done.all()):
            break
    shift = torch.where(fused[blocks].view(-1, 1), shift, tau)
    return shift, its, read, live, fused, wasted


def power_head(q: torch.Tensor, k: torch.Tensor, a: float, form: dict[str, Any], bm: int,
               bn: int, fine: int, group: int = 8, tol: float = NEWTON_TOL) -> dict[str, float]:
    """Counts of one head (queries q (n, D), keys k (n, D), query i sees keys j <= i)."""
    n = q.shape[0]
    r, entmax = form["r"], form["entmax"]
    nb = -(-n // bm)
    out = {"tiles": 0.0, "sweep_tiles": 0.0, "newton_tiles": 0.0, "newton_read": 0.0,
           "output_read": 0.0, "fused_tiles": 0.0, "wasted": 0.0, "live": 0.0, "fine_tiles": 0.0,
           "fine_live": 0.0, "empty_rows": 0.0, "newton_max": 0.0}
    for b0 in range(0, nb, group):  # a group of row blocks at once
        r0, r1 = b0 * bm, min(n, (b0 + group) * bm)
        end = r1  # the last row of the group sees keys 0 .. r1 - 1
        c = q[r0:r1].float() @ k[:end].float().T  # (m, end)
        i = torch.arange(r0, r1).view(-1, 1)
        vis = torch.arange(end).view(1, -1) <= i
        cv = c.masked_fill(~vis, float("-inf"))
        if form["anchor"] is None:
            m = cv.amax(1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        else:
            m = torch.full_like(c[:, :1], form["anchor"])
        x = (a * (c - m)).masked_fill(~vis, float("-inf"))
        blocks = torch.arange(r0, r1) // bm - b0  # row block of each row, in the group
        n_blocks = int(blocks.max()) + 1
        last_rows = torch.clamp(torch.arange(n_blocks) * bm + bm, max=r1 - r0) - 1 + r0
        tiles_of = last_rows // bn + 1  # key tiles 0 .. last row's
        its = torch.zeros(n_blocks)
        read = torch.zeros(n_blocks)
        after = tiles_of.float()  # the tiles the output pass reads
        fused = torch.zeros(n_blocks, dtype=torch.bool)
        wasted = torch.zeros(n_blocks)
        if entmax:
            tau0 = subset_start(cv, a, r, bn) if form["anchor"] is None else None
            shift, its, read, flags, fused, wasted = newton(x, r, blocks, n_blocks, tau0, tol,
                                                            bn, tiles_of)
            after = torch.where(fused, 0.0, flags.sum(1).float())
        else:
            shift = torch.full_like(m, form["shift"])
        u = (x - shift).clamp_min(0).masked_fill(~vis, 0.0)
        for blk in range(n_blocks):
            rows = slice(blk * bm, min((blk + 1) * bm, r1 - r0))
            last = r0 + rows.stop - 1  # keys 0 .. last
            tiles = last // bn + 1
            live = _tile_any(u[rows, :last + 1], 0, bm, bn).sum().item()
            # row max (anchor), the Newton passes' live tiles, the output pass's live tiles
            sweep_tiles = (form["anchor"] is None) * tiles + float(read[blk] + after[blk])
            out["tiles"] += tiles
            out["sweep_tiles"] += sweep_tiles
            out["newton_tiles"] += float(its[blk]) * tiles
            out["newton_read"] += float(read[blk])
            out["output_read"] += float(after[blk])
            out["fused_tiles"] += float(fused[blk]) * tiles
            out["wasted"] += float(wasted[blk])
            out["newton_max"] = max(out["newton_max"], float(its[blk]))
            out["live"] += live
            fine_live = _tile_any(u[rows, :last + 1], 0, fine, fine)
            row_f = torch.arange(fine_live.shape[0]).view(-1, 1) * fine + r0 + blk * bm
            causal_f = torch.arange(fine_live.shape[1]).view(1, -1) * fine <= row_f + fine - 1
            out["fine_tiles"] += causal_f.sum().item()
            out["fine_live"] += (fine_live & causal_f).sum().item()
        out["empty_rows"] += ((u > 0).sum(1) == 0).sum().item()
    return out


def power_counts(name: str, keys: torch.Tensor, beta: torch.Tensor, bm: int = 64, bn: int = 64,
                 fine: int = 16, tol: float = NEWTON_TOL) -> dict[str, Any]:
    """The work model of a power kernel on keys (1, H, T, hs) at bandwidths beta (H,), the
    Newton passes stopping at steps below ``tol`` (``NEWTON_TOL_HALF`` for bf16 inputs)."""
    form = kernel_form(name)
    band = form["kernel"].bandwidth(beta.float())
    tot: dict[str, float] = {}
    for h in range(keys.shape[1]):
        kk = keys[0, h]
        part = power_head(kk[1:], kk[:-1], form["scale"] * float(band[h]), form, bm, bn, fine,
                          tol=tol)
        for key, value in part.items():
            tot[key] = max(tot.get(key, 0.0), value) if key == "newton_max" else (
                tot.get(key, 0.0) + value)
    tiles = tot["tiles"]
    live = tot["live"] / tiles
    sweeps = tot["sweep_tiles"] / tiles
    solve = form["entmax"]
    return {"kernel": name, "fwd_sweeps": sweeps, "newton_sweeps": tot["newton_tiles"] / tiles,
            "newton_read": tot["newton_read"] / tiles, "newton_max": tot["newton_max"],
            "output_read": tot["output_read"] / tiles, "fused": tot["fused_tiles"] / tiles,
            "live": live, "live_fine": tot["fine_live"] / tot["fine_tiles"],
            "empty_rows": tot["empty_rows"] / (keys.shape[1] * (keys.shape[2] - 1)),
            # QK^T per tile read, P V per live tile (and per live tile of a pass that made
            # an output it then threw away)
            "fwd_products": sweeps + live + tot["wasted"] / tiles,
            # live tiles only: dq (entmax: QK^T + dP for c) QK^T + dP + dQ; dkv QK^T + dV,
            # dP, dK
            "bwd_products": (9 if solve else 7) * live,
            "fwd_tiles": sweeps, "bwd_tiles": (3.0 if solve else 2.0) * live,
            "causal_tiles": tiles / keys.shape[1]}


def _per_block(flags: torch.Tensor, blocks: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """(n_blocks,) whether any row of each block has its flag set."""
    return torch.zeros(n_blocks).index_add_(0, blocks, flags.float()) > 0


def _block_max(values: torch.Tensor, blocks: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """(n_blocks,) the largest value of each block's rows (0 for a block with none)."""
    return torch.zeros(n_blocks, dtype=values.dtype).scatter_reduce_(0, blocks, values, "amax")


def knn_head(q: torch.Tensor, k: torch.Tensor, k_top: int, bm: int, bn: int,
             inserts: int = MERGE_INSERTS) -> dict[str, float]:
    """Pass-1 work, tiles holding the k-th value, true ties, cumsum tiles and tiles with a
    selected entry of one head (query i sees keys j <= i), summed over causal tiles.

    Pass 1 of a tile: each row's count of scores above its current k-th; the tile's most
    (over its rows) picks skip (0), insertion (at most ``inserts``: that many steps) or the
    bitonic network; "any" is the tile-wide test alone (some row's count > 0), the network's
    rate before insertion. Pass 2 runs the tie cumsum on a tile where a row's entries equal to
    its k-th value cross the number it takes."""
    n = q.shape[0]
    nb = -(-n // bn)
    nbq = -(-n // bm)
    pad = max(2, 1 << (k_top - 1).bit_length())
    run = torch.full((n, pad), float("-inf"))
    rows = torch.arange(n)
    row_block = rows // bm
    most = torch.zeros(nbq, nb, dtype=torch.long)
    qf, kf = q.float(), k.float()
    for kb in range(nb):
        j = torch.arange(kb * bn, min(n, (kb + 1) * bn))
        r0 = kb * bn  # rows that see this key block: i >= kb bn
        s = qf[r0:] @ kf[j].T
        s = s.masked_fill(j.view(1, -1) > rows[r0:].view(-1, 1), float("-inf"))
        kth = run[r0:, k_top - 1:k_top]
        most[:, kb] = _block_max((s > kth).sum(1), row_block[r0:], nbq)
        run[r0:] = torch.cat([run[r0:], s], 1).topk(pad, 1).values
    tau = run[:, k_top - 1:k_top]
    need = (run[:, :k_top] == tau).sum(1)
    selected = torch.zeros(nbq, nb, dtype=torch.bool)
    cumsum = torch.zeros(nbq, nb, dtype=torch.bool)
    at_tau = torch.zeros(n, nb, dtype=torch.bool)  # row i has an entry equal to tau_i there
    eq_count = torch.zeros(n, dtype=torch.long)
    for kb in range(nb):
        j = torch.arange(kb * bn, min(n, (kb + 1) * bn))
        r0 = kb * bn
        s = qf[r0:] @ kf[j].T
        vis = j.view(1, -1) <= rows[r0:].view(-1, 1)
        eq = vis & (s == tau[r0:])
        after = eq_count[r0:] + eq.sum(1)
        cumsum[:, kb] = _per_block((eq_count[r0:] < need[r0:]) & (after > need[r0:]),
                                   row_block[r0:], nbq)
        at_tau[r0:, kb] = (eq & torch.isfinite(tau[r0:])).any(1)
        eq_count[r0:] = after
        selected[:, kb] = _per_block((vis & (s >= tau[r0:])).any(1), row_block[r0:], nbq)
    tied = eq_count > 1  # rows whose k-th value is shared: the only ones the cumsum serves
    tie_tiles = torch.stack([_per_block(at_tau[:, kb] & tied, row_block, nbq)
                             for kb in range(nb)], 1)
    causal = torch.arange(nb).view(1, -1) * bn <= (torch.arange(nbq).view(-1, 1) + 1) * bm - 1
    insert = causal & (most > 0) & (most <= inserts)
    return {"tiles": float(causal.sum()), "merges": float((causal & (most > inserts)).sum()),
            "merges_any": float((causal & (most > 0)).sum()),
            "inserts": float(insert.sum()), "insert_steps": float(most[insert].sum()),
            "cumsum": float((cumsum & causal).sum()),
            "tie_tiles": float((tie_tiles & causal).sum()),
            "selected": float((selected & causal).sum()), "tie_rows": float(tied.sum())}


def knn_counts(name: str, keys: torch.Tensor, k_top: int = 16, bm: int = 64,
               bn: int = 64, inserts: int = MERGE_INSERTS) -> dict[str, Any]:
    """The work model of a kNN kernel on keys (1, H, T, hs)."""
    tot: dict[str, float] = {}
    for h in range(keys.shape[1]):
        kk = keys[0, h]
        for key, value in knn_head(kk[1:], kk[:-1], k_top, bm, bn, inserts).items():
            tot[key] = tot.get(key, 0.0) + value
    tiles = tot["tiles"]
    uniform = name == "uniform_knn"
    return {"kernel": name, "fwd_sweeps": 2.0, "merge": tot["merges"] / tiles,
            "merge_any": tot["merges_any"] / tiles, "insert": tot["inserts"] / tiles,
            "insert_steps": tot["insert_steps"] / tiles,
            "tie_tiles": tot["tie_tiles"] / tiles, "live": tot["selected"] / tiles,
            "tie_rows": tot["tie_rows"], "cumsum": tot["cumsum"] / tiles,
            "fwd_products": 3.0, "bwd_products": 2.0 if uniform else 7.0,
            "fwd_tiles": 2.0, "bwd_tiles": 1.0 if uniform else 2.0,
            "causal_tiles": tiles / keys.shape[1]}


def fska_counts(T: int, hs: int, features: int = 192, chunk: int = 64) -> dict[str, Any]:
    """The chunked scan's products in units of a 64 x 64 x 64 tile product, per causal tile
    (T / C chunks; a causal attention at this T has nc (nc + 1) / 2 tiles)."""
    nc = -(-(T - 1) // chunk)
    f, d, c = features / 64, hs / 64, chunk / 64
    # forward: states k^T v (F D), then per chunk A = q k^T (F), q P (F D), A v (D)
    fwd = c * (f * d + c * f + f * d + c * d)
    # backward: P and R states, A, dA = dn v^T, dv = A^T dn, dq (dA k, dn P^T), dk (dA^T q,
    # v R^T), dv += k R
    bwd = c * (2 * f * d + c * f + 2 * c * d + c * f + f * d + c * f + f * d + f * d)
    per_tile = nc / (nc * (nc + 1) / 2)
    return {"kernel": "fska", "fwd_sweeps": per_tile, "fwd_products": fwd * per_tile,
            "bwd_products": bwd * per_tile, "fwd_tiles": per_tile, "bwd_tiles": per_tile,
            "live": 1.0, "causal_tiles": nc * (nc + 1) / 2}


def model_keys(model_dir: Path, tokens: Path | None, T: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                      str]:
    """Unit keys (1, L H, T, hs) of every layer of a saved model on T tokens (a .npy token
    file, else random tokens) and their bandwidths (L H,)."""
    import numpy as np

    from mosaics import MosaicsForCausalLM

    model = MosaicsForCausalLM.from_pretrained(model_dir).eval()
    if tokens is not None:
        ids = torch.from_numpy(np.load(tokens, mmap_mode="r")[:T].astype("int64"))
        source = tokens.name
    else:
        ids = torch.randint(0, model.config.vocab_size, (T,), generator=torch.Generator()
                            .manual_seed(0))
        source = "random tokens"
    captured: list[torch.Tensor] = []
    betas: list[torch.Tensor] = []
    for module in model.modules():
        if hasattr(module, "unit_keys") and hasattr(module, "kernel"):
            original = module.unit_keys

            def hook(*args: Any, _f: Any = original, **kwargs: Any) -> Any:
                keys, last = _f(*args, **kwargs)
                captured.append(keys.detach())
                return keys, last

            module.unit_keys = hook
            betas.append(module.weights().beta.detach().float().view(-1))
    with torch.no_grad():
        model(input_ids=ids.view(1, -1))
    keys = torch.cat([k[0] for k in captured], 0).unsqueeze(0)  # (1, L H, T, hs)
    name = f"{model_dir.resolve().parent.name}/{model_dir.name}"
    return keys, torch.cat(betas), f"{name} on {T} tokens of {source}"


def table(rows: list[dict[str, Any]], title: str) -> str:
    """The rows as a Markdown table (one row per kernel), FlashAttention-2's first."""
    head = ["kernel", "QK^T sweeps fwd",
            "Newton passes (mean / max) / tiles read / output in the last",
            "live tiles (16x16)",
            "kNN network (before) / insertion (steps) / cumsum / tie tiles / tied rows",
            "products fwd / bwd",
            "tile visits fwd / bwd"]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head),
             "| FlashAttention-2 | 1 | - | - | - | 2 / 5 | 1 / 2 |"]

    def num(x: Any, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    for r in rows:
        newton = (f"{r['newton_sweeps']:.2f} / {r['newton_max']:.0f} / {r['newton_read']:.2f} / "
                  f"{r['fused']:.2f}" if r.get("newton_sweeps") else "-")
        live = num(r.get("live"), "{:.3f}") + (f" ({r['live_fine']:.3f})"
                                               if "live_fine" in r else "")
        knn = (f"{r['merge']:.3f} ({r['merge_any']:.3f}) / {r['insert']:.3f} "
               f"({r['insert_steps']:.2f}) / {r['cumsum']:.3f} / {r['tie_tiles']:.3f} / "
               f"{r['tie_rows']:.0f}" if "merge" in r else "-")
        lines.append(f"| {r['kernel']} | {num(r['fwd_sweeps'])} | {newton} | {live} | "
                     f"{knn} | {num(r['fwd_products'])} / "
                     f"{num(r['bwd_products'])} | {num(r['fwd_tiles'])} / "
                     f"{num(r['bwd_tiles'])} |")
    return "\n".join(lines)


def measure(keys: torch.Tensor, beta: torch.Tensor, kernels: list[str], k_top: int,
            clustered: torch.Tensor | None = None, tol: float = NEWTON_TOL,
            power_tiles: tuple[int, int] = (64, 64)) -> list[dict[str, Any]]:
    """Every asked kernel's counts on keys (epanechnikov_fixed also on ``clustered``), the
    power kernels' at ``power_tiles`` (rows, keys; sm_90 launches 128 x 64)."""
    bm, bn = power_tiles
    rows = []
    T, hs = keys.shape[2], keys.shape[3]
    for name in kernels:
        if name in POWER:
            rows.append(power_counts(name, keys, beta, bm, bn, tol=tol))
            if name == "epanechnikov_fixed" and clustered is not None:
                row = power_counts(name, clustered, beta, bm, bn, tol=tol)
                row["kernel"] = "epanechnikov_fixed (clustered keys)"
                rows.append(row)
        elif name in KNN:
            rows.append(knn_counts(name, keys, k_top))
        elif name == "fska":
            rows.append(fska_counts(T, hs))
    return rows


@torch.no_grad()  # not set_grad_enabled(False): the caller's grad mode stays
def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--kernels", nargs="+", default=[*POWER, *KNN, "fska"])
    p.add_argument("--k-top", type=int, default=16)
    p.add_argument("--power-tiles", type=int, nargs=2, default=[64, 64], metavar=("ROWS", "KEYS"),
                   help="the power kernels' tile (default 64 64; sm_90 launches 128 64)")
    p.add_argument("--model", type=Path, help="a saved model: also count on its keys")
    p.add_argument("--tokens", type=Path, help="with --model: a .npy of token ids")
    p.add_argument("--model-length", type=int, default=1024)
    p.add_argument("--json", type=Path, help="write every row here")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="the inputs' dtype: the Newton passes' stopping step (default bf16)")
    args = p.parse_args(argv)
    tol = newton_tol(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    results = []
    for T in args.lengths:
        keys = check_keys(T, args.heads, args.head_size)
        clustered = clustered_keys(T, args.heads, args.head_size)
        beta = torch.full((args.heads,), BETA)
        rows = measure(keys, beta, args.kernels, args.k_top, clustered, tol,
                       tuple(args.power_tiles))
        title = (f"gpu_check's inputs: T {T}, {args.heads} heads of {args.head_size}, beta "
                 f"{BETA}, {args.dtype}, power tiles {args.power_tiles[0]} x "
                 f"{args.power_tiles[1]}")
        print(table(rows, title) + "\n", flush=True)
        results += [dict(r, T=T, source="check", dtype=args.dtype) for r in rows]
    if args.model is not None:
        keys, beta, source = model_keys(args.model, args.tokens, args.model_length)
        rows = measure(keys, beta, args.kernels, args.k_top, tol=tol,
                       power_tiles=tuple(args.power_tiles))
        print(table(rows, f"{source}: {keys.shape[1]} layer-heads of {keys.shape[3]}, "
                          f"beta {beta.min():.2f}-{beta.max():.2f}, {args.dtype}") + "\n",
              flush=True)
        results += [dict(r, T=args.model_length, source=source, dtype=args.dtype)
                    for r in rows]
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
