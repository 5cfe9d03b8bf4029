"""FSKA's fused (Triton) retrieval against its chunked path and the ``gaussian`` kernel.

Forward + backward of ``kernel(keys, values, beta)`` in training mode (fresh frequencies and
the flow's KL each call) on random unit keys (B, H, T, hs), median of ``--repeats`` after
``--warmup`` calls, with peak memory on CUDA; and the fused op alone
(:func:`mosaics.ops.causal_linear_attention` on fixed features (B, H, T, 2M) and values), so
the attention's share of the kernel's time shows. The chunked path runs under
``MOSAICS_FUSED=0``; the largest output difference of the two paths is printed.

    python bench/fska_fused.py                                 # CUDA, T 1024 4096 16384
    python bench/fska_fused.py --tf32                          # fp32 products as TF32
    MOSAICS_FUSED=1 python bench/fska_fused.py --device cpu --lengths 64 --repeats 1
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
from mosaics.ops import causal_linear_attention  # noqa: E402
from mosaics.ops.triton_backend import PATHS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import timed_on  # noqa: E402


def kernel_step(kernel: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor,
                beta: torch.Tensor) -> None:
    k, v = keys.detach().requires_grad_(), values.detach().requires_grad_()
    kernel(k, v, beta).square().sum().backward()


def op_step(feats: torch.Tensor, values: torch.Tensor) -> None:
    f, v = feats.detach().requires_grad_(), values.detach().requires_grad_()
    causal_linear_attention(f, None, v).square().sum().backward()


def measure(T: int, args: argparse.Namespace) -> None:
    """Print the rows of one length."""
    H, hs, B, dev = args.heads, args.head_size, args.batch, args.device
    g = torch.Generator().manual_seed(0)
    keys = torch.nn.functional.normalize(torch.randn(B, H, T, hs, generator=g), dim=-1).to(dev)
    values = torch.randn(B, H, T, hs, generator=g).to(dev)
    beta = torch.full((H,), 7.39, device=dev)
    feats = torch.rand(B, H, T, 2 * args.num_features, generator=g).to(dev)
    gaussian = get_kernel("gaussian").to(dev)
    fska = get_kernel("fska", num_features=args.num_features)
    fska.build(H, hs)
    fska = fska.to(dev).train()
    io = (keys, values, beta)
    reps = (dev, args.warmup, args.repeats)
    rows = {"gaussian": timed_on(partial(kernel_step, gaussian, *io), *reps),
            "fska": timed_on(partial(kernel_step, fska, *io), *reps)}
    path = PATHS.get("fska", "?")
    rows["fused op"] = timed_on(partial(op_step, feats, values), dev, args.warmup, args.repeats)
    switch = os.environ.get("MOSAICS_FUSED")
    os.environ["MOSAICS_FUSED"] = "0"
    try:
        if args.max_chunked >= T:
            rows["fska chunked"] = timed_on(partial(kernel_step, fska, *io), dev, args.warmup,
                                         args.repeats)
        with torch.no_grad():
            chunked = fska.eval()(*io)
    finally:
        if switch is None:
            os.environ.pop("MOSAICS_FUSED")
        else:
            os.environ["MOSAICS_FUSED"] = switch
    with torch.no_grad():
        diff = (fska(*io) - chunked).abs().max().item()
    base = rows["gaussian"][0]
    for name, (ms, peak) in rows.items():
        mem = f"{peak:.0f}" if peak is not None else "-"
        print(f"{T:>6} {name:>14} {ms:>9.2f} {ms / base:>12.2f} {mem:>9}")
    print(f"{'':>6} fska path: {path}; fused - chunked max |dy| (eval) {diff:.2e}")


def run(args: argparse.Namespace) -> None:
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    print(f"B {args.batch}, H {args.heads}, hs {args.head_size}, M {args.num_features}, "
          f"device {args.device}, tf32 {args.tf32}")
    print(f"{'T':>6} {'method':>14} {'ms':>9} {'vs gaussian':>12} {'peak MB':>9}")
    for T in args.lengths:
        measure(T, args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--num-features", type=int, default=96)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-chunked", type=int, default=4096,
                   help="longest T at which the (slow) chunked path is timed")
    p.add_argument("--tf32", action="store_true",
                   help="allow TF32 for fp32 products (torch.backends.cuda.matmul.allow_tf32)")
    run(p.parse_args())


if __name__ == "__main__":
    main()
