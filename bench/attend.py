"""Kernel.attend with a window against the kernel's full strict-past forward.

For each kernel and length T, on random unit keys (B, H, T, hs) with queries = keys, times

- ``forward``: ``kernel(keys, values, beta)``, the strict past s < t (the baseline);
- ``past``: ``kernel.attend`` with lo = 0, hi = t - 1 (the same weights; intervals 0..t+d
  with one bandwidth per head take the kernels' strict-past paths);
- ``window``: lo = t - h + 1, hi = t - 1 (the short-term memory of Memory Mosaics v2, h - 1
  visible entries): the chunked interval path;
- ``gap``: lo = 0, hi = t - m (the long-term memory, m = 64);
- ``window, beta_i`` and ``gap, beta_i``: the same with one bandwidth per query (the adaptive
  bandwidth of v2; all equal here), which takes the fused tiles of the power and kNN kernels;
- for ``fska``: ``window, dense`` and ``gap, dense``, its dense per-chunk path beside the
  linear-time one it takes by default at one bandwidth per head (``linear_intervals``); its
  per-query columns (frequencies per query, features per (query, key) pair) are left out;

forward alone and forward + backward (gradients of keys, values and beta), and prints each
time with its ratio to ``forward`` measured in the same process. Time: the fastest of
``--repeats`` runs, methods interleaved per round so that slow spells of a shared machine
hit all of them alike; ``--clock cpu`` counts the process's CPU time instead of the wall clock
(with one thread: the work done, not the waiting on a shared machine).

    OMP_NUM_THREADS=1 python bench/attend.py
    OMP_NUM_THREADS=1 python bench/attend.py --lengths 1024 4096 --window 256 --repeats 5
    OMP_NUM_THREADS=1 python bench/attend.py --kernels fska --lengths 1024 4096 8192 --clock cpu
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import add_clock_option, get_clock

from mosaics.kernels import Kernel, get_kernel


def unit_keys(B: int, H: int, T: int, hs: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, H, 1, hs, generator=g)
    return F.normalize(base + torch.randn(B, H, T, hs, generator=g), dim=-1)


def timed(kernel: Kernel, keys: torch.Tensor, values: torch.Tensor, beta: torch.Tensor,
          bounds: tuple[torch.Tensor, torch.Tensor] | None, backward: bool,
          clock: Callable[[], float], linear: bool | None = None) -> float:
    """Seconds of one forward (bounds None) or attend call (bounds (lo, hi)), and its backward;
    ``linear``: FSKA's ``linear_intervals`` for this call."""
    if hasattr(kernel, "linear_intervals"):
        kernel.linear_intervals = linear
    start = clock()
    if bounds is None:
        out = kernel(keys, values, beta)
    else:
        out = kernel.attend(keys, keys, values, beta, *bounds)
    if backward:
        out.sum().backward()
    return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="+", default=["gaussian", "epanechnikov"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--window", type=int, default=256, help="h: entries t-h+1 .. t-1")
    parser.add_argument("--gap", type=int, default=64, help="m: entries 0 .. t-m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    add_clock_option(parser)
    args = parser.parse_args()
    clock = get_clock(args.clock)
    print(f"threads {torch.get_num_threads()}, B {args.batch}, H {args.heads}, "
          f"hs {args.head_size}, window h {args.window}, gap m {args.gap}; "
          "seconds (ratio to forward)")
    for name in args.kernels:
        kernel = get_kernel(name)
        kernel.build(args.heads, args.head_size)
        names = ["forward", "past", "window", "gap", "window, beta_i", "gap, beta_i"]
        if name == "fska":
            names[-2:] = ["window, dense", "gap, dense"]
        print(f"{'kernel':<14}{'T':>6}  {'pass':<8}" + "".join(f"{n:>18}" for n in names))
        for T in args.lengths:
            keys = unit_keys(args.batch, args.heads, T, args.head_size).requires_grad_()
            values = torch.randn(keys.shape).requires_grad_()
            beta = torch.full((args.heads,), 7.39, requires_grad=True)
            t = torch.arange(T).view(1, T)
            zero = torch.zeros_like(t)
            per_query = beta.detach().view(1, -1, 1).expand(args.batch, -1, T).contiguous()
            per_query.requires_grad_()
            window, gap = (t - args.window + 1, t - 1), (zero, t - args.gap)
            methods = {"forward": (None, beta, None), "past": ((zero, t - 1), beta, None),
                       "window": (window, beta, None), "gap": (gap, beta, None),
                       "window, beta_i": (window, per_query, None),
                       "gap, beta_i": (gap, per_query, None),
                       "window, dense": (window, beta, False), "gap, dense": (gap, beta, False)}
            methods = {m: methods[m] for m in names}
            for backward in (False, True):
                best = dict.fromkeys(methods, float("inf"))
                for _ in range(args.repeats):
                    for method, (bounds, bandwidth, linear) in methods.items():
                        with torch.set_grad_enabled(backward):
                            seconds = timed(kernel, keys, values, bandwidth, bounds, backward,
                                            clock, linear)
                        best[method] = min(best[method], seconds)
                base = best["forward"]
                cells = "".join(f"{best[m]:>10.4f} ({best[m] / base:4.2f})" for m in methods)
                print(f"{name:<14}{T:>6}  {'fwd+bwd' if backward else 'fwd':<8}{cells}",
                      flush=True)


if __name__ == "__main__":
    main()
