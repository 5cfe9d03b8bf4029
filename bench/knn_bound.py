"""The kNN kernels' two training forms, forward + backward of one layer's strict-past retrieval.

- ``tiled``: :func:`mosaics.ops.topk_retrieval.top_k_retrieval`, the form for long memories
  (the k best entries of each row found per tile of query rows; everything after works on the
  k selected rows: bag-sums, gathers and scatter-adds);
- ``dense``: :func:`mosaics.ops.topk_retrieval.dense_top_k_retrieval`, the form for short
  memories (the whole score matrix, one top-k per row, the weights scattered into a dense
  matrix and every product a batched GEMM), which ``retrieval`` takes when there are at most
  ``chunk_elements`` scores.

Shapes: batch x heads query rows of T - 1 positions over T - 1 keys (the model's retrieval
at sequence length T), head size ``--head-size``. Time: the fastest of ``--repeats`` runs,
forms interleaved; the last column is tiled / dense (above 1: dense is faster).

    OMP_NUM_THREADS=1 python bench/knn_bound.py --clock cpu
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from timing import add_clock_option, best_of, get_clock

from mosaics.kernels import get_kernel
from mosaics.ops import dense_top_k_retrieval


def run(kernel, q: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, dense: bool):  # noqa: ANN001, ANN201
    """Forward + backward of one form over keys = queries (the model's case)."""
    def step() -> None:
        q.grad = v.grad = beta.grad = None
        qs, ks, vs = q[:, :, 1:], q[:, :, :-1], v[:, :, :-1]
        if dense:
            y = dense_top_k_retrieval(qs, ks, vs, beta, kernel, 0)
        else:
            y = kernel.tiled(qs, ks, vs, beta.view(1, -1, 1, 1), kernel.past_tiles(0))
        y.square().sum().backward()
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=32)
    p.add_argument("--lengths", type=int, nargs="+", default=[65, 90, 129, 257, 513])
    p.add_argument("--k", type=int, nargs="+", default=[16, 32])
    p.add_argument("--repeats", type=int, default=5)
    add_clock_option(p)
    args = p.parse_args()
    clock = get_clock(args.clock)
    print(f"threads {torch.get_num_threads()}, batch {args.batch}, {args.heads} heads of "
          f"{args.head_size}, fp32, clock {args.clock}, ms per forward + backward")
    print("| kernel | T | k | scores (M) | tiled | dense | tiled / dense |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name in ("gaussian_knn", "uniform_knn"):
        for k in args.k:
            kernel = get_kernel(name, k=k)
            for T in args.lengths:
                shape = (args.batch, args.heads, T, args.head_size)
                q = F.normalize(torch.randn(shape, generator=gen), dim=-1).requires_grad_()
                v = torch.randn(shape, generator=gen).requires_grad_()
                beta = torch.full((args.heads,), 3.0, requires_grad=True)
                forms = {"tiled": run(kernel, q, v, beta, False),
                         "dense": run(kernel, q, v, beta, True)}
                for form in forms.values():
                    form()  # warm-up
                best = dict.fromkeys(forms, float("inf"))
                for _ in range(args.repeats):
                    for label, form in forms.items():
                        best[label] = min(best[label], best_of(form, 1, clock))
                scores = args.batch * args.heads * (T - 1) ** 2 / 1e6
                print(f"| {name} | {T} | {k} | {scores:.2f} | {best['tiled'] * 1e3:.1f} | "
                      f"{best['dense'] * 1e3:.1f} | {best['tiled'] / best['dense']:.2f} |")


if __name__ == "__main__":
    main()
