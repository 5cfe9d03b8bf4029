"""Blocked causal attention (``mosaics.ops.causal``) against one fused call.

Forward + backward of softmax(q k^T / sqrt(hs) + causal mask) v on random (B, H, T, hs)
inputs, fp32 CPU. Baseline, in the same process and alternating call by call:
``F.scaled_dot_product_attention(..., is_causal=True)``. Printed per length: the baseline's
best time and the blocked version's time as a ratio to it (< 1 is faster), for the default
block rule (max(ceil(T / 128), 4) even blocks of at least 64 rows, below T = 768) and
for fixed blocks.

    OMP_NUM_THREADS=1 python bench/causal_attention.py
    OMP_NUM_THREADS=2 python bench/causal_attention.py --lengths 511 1023 --blocks 64 128 256
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from timing import best_of

from mosaics.ops.causal import _BlockedCausal, causal_attention


def cases(q, k, v, g, scale: float, blocks: list[int]) -> dict:
    """Forward + backward closures: the stock call, the default rule, fixed blocks."""
    fns = {"stock": lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale).backward(g)}
    fns["default"] = lambda: causal_attention(q, k, v, scale).backward(g)
    for b in blocks:
        fns[f"b={b}"] = lambda b=b: _BlockedCausal.apply(q, k, v, scale, b).backward(g)
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[255, 320, 383, 511, 767, 1023])
    ap.add_argument("--blocks", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    B, H, hs = args.batch, args.heads, args.head_size
    print(f"threads={torch.get_num_threads()}, (B, H, hs) = ({B}, {H}, {hs}), fp32, "
          "forward + backward, time / stock causal call\n")
    cols = ["default"] + [f"b={b}" for b in args.blocks]
    print(f"{'T':>6} {'stock ms':>9} " + " ".join(f"{c:>8}" for c in cols))
    scale = hs**-0.5
    for T in args.lengths:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, hs, requires_grad=True) for _ in range(3))
        g = torch.randn(B, H, T, hs)
        fns = cases(q, k, v, g, scale, [b for b in args.blocks if 2 * b <= T])
        best = {name: float("inf") for name in fns}
        for _ in range(args.repeats):  # alternate so machine noise hits all alike
            for name, fn in fns.items():
                best[name] = min(best[name], best_of(fn, 1))
        base = best["stock"]
        cells = [f"{best[c] / base:8.2f}" if c in best else f"{'-':>8}" for c in cols]
        print(f"{T:>6} {1e3 * base:>9.1f} " + " ".join(cells))


if __name__ == "__main__":
    main()
