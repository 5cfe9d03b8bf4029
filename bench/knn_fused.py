"""The kNN kernels' fused (Triton) retrieval against their chunked path and ``gaussian``.

Forward + backward of ``kernel(keys, values, beta)`` (gradients to keys and values) on random
unit keys (B, H, T, hs), median of ``--repeats`` after ``--warmup`` calls, with peak memory
on CUDA, for ``gaussian`` (the baseline: fused softmax attention), ``gaussian_knn`` and
``uniform_knn`` fused and (up to ``--max-chunked``) chunked (``MOSAICS_FUSED=0``). Per kNN
kernel the path it took and the largest differences of the fused and chunked outputs and key
/ value gradients, relative to the chunked path's largest entry (exact top-k ties aside, the
two select the same entries).

    python bench/knn_fused.py                                    # CUDA, T 1024 4096, fp32 bf16
    python bench/knn_fused.py --k 32 --dtypes bf16
    MOSAICS_FUSED=1 python bench/knn_fused.py --device cpu --lengths 64 --repeats 1 --warmup 0
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mosaics import get_kernel  # noqa: E402
from mosaics.ops.triton_backend import PATHS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import timed_on  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def step(kernel: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor,
         beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Output and (keys, values) gradients of sum(y^2)."""
    k, v = keys.detach().requires_grad_(), values.detach().requires_grad_()
    y = kernel(k, v, beta)
    gk, gv = torch.autograd.grad(y.float().square().sum(), (k, v))
    return y.detach(), gk, gv


class fused_switch:  # noqa: N801 - a small context manager
    """MOSAICS_FUSED set to ``value`` inside, restored after."""

    def __init__(self, value: str) -> None:
        self.value, self.old = value, None

    def __enter__(self) -> None:
        self.old = os.environ.get("MOSAICS_FUSED")
        os.environ["MOSAICS_FUSED"] = self.value

    def __exit__(self, *exc: object) -> None:
        if self.old is None:
            os.environ.pop("MOSAICS_FUSED")
        else:
            os.environ["MOSAICS_FUSED"] = self.old


def measure(T: int, dname: str, args: argparse.Namespace) -> None:
    """Print the rows of one length and dtype."""
    H, hs, B, dev = args.heads, args.head_size, args.batch, args.device
    g = torch.Generator().manual_seed(0)
    keys = torch.nn.functional.normalize(torch.randn(B, H, T, hs, generator=g), dim=-1)
    values = torch.randn(B, H, T, hs, generator=g)
    keys, values = keys.to(dev, DTYPES[dname]), values.to(dev, DTYPES[dname])
    beta = torch.full((H,), 7.39, device=dev)
    io = (keys, values, beta)
    base, _ = timed_on(partial(step, get_kernel("gaussian").to(dev), *io), dev, args.warmup,
                    args.repeats)
    print(f"{dname:>5} {T:>6} {'gaussian':>20} {base:>9.2f} {1.0:>12.2f} {'-':>9}")
    for name in ("gaussian_knn", "uniform_knn"):
        kernel = get_kernel(name, k=args.k).to(dev)
        ms, peak = timed_on(partial(step, kernel, *io), dev, args.warmup, args.repeats)
        path = PATHS.get(name, "?")
        mem = f"{peak:.0f}" if peak is not None else "-"
        print(f"{dname:>5} {T:>6} {name:>20} {ms:>9.2f} {ms / base:>12.2f} {mem:>9}  {path}")
        if args.max_chunked < T:
            continue
        fused = step(kernel, *io)
        with fused_switch("0"):
            ms, _ = timed_on(partial(step, kernel, *io), dev, args.warmup, args.repeats)
            chunked = step(kernel, *io)
        diffs = ", ".join(
            f"{label} {((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item():.1e}"
            for label, a, b in zip(("y", "dk", "dv"), (x.float() for x in fused),
                                   (x.float() for x in chunked)))
        print(f"{dname:>5} {T:>6} {name + ' chunked':>20} {ms:>9.2f} {ms / base:>12.2f} "
              f"{'-':>9}  max |fused - chunked| / max |chunked|: {diffs}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--k", type=int, default=16, help="entries per row (kernel_kwargs k)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-chunked", type=int, default=4096,
                   help="longest T at which the chunked path is timed and compared")
    args = p.parse_args()
    print(f"B {args.batch}, H {args.heads}, hs {args.head_size}, k {args.k}, "
          f"device {args.device}")
    print(f"{'dtype':>5} {'T':>6} {'kernel':>20} {'ms':>9} {'vs gaussian':>12} {'peak MB':>9}"
          "  path")
    for dname in args.dtypes:
        for T in args.lengths:
            measure(T, dname, args)


if __name__ == "__main__":
    main()
