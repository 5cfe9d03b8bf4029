"""How fast could the persistent memory's slot-bank attention be? Its compiled kernel and
PyTorch's fused form against the sum of its matrix products and softmax passes, each timed
alone, and against GPT-2's MLP.

The slot banks compute y = softmax(q K^T) V for N = batch T unit queries and P = 3.5 d slots
per head (forward + backward; q: (H, N, hs), K and V: (H, P, hs)). Rows:

- ``bank_attention``: what a training step runs (:func:`mosaics.ops.bank_attention`: the
  compiled kernel where it builds, else ``fused (PyTorch)``);
- ``fused (PyTorch)``: PyTorch's fused CPU forward and its backward in blocks of slots
  (:class:`mosaics.ops.banks._BankAttention`, which recomputes the probabilities);
- ``compiled, storing P``: the compiled kernel (:class:`mosaics.ops.banks._StoredBankAttention`:
  probabilities kept, oneDNN's batch-reduce GEMM), when it builds here;
- ``parts, recomputing``: the work of that fused backward, op by op on one head and one block
  of ``--rows`` queries at a time (operands in cache, outputs preallocated), times H N / rows:
  S = q K^T, softmax; o = P V; then S = q K^T and P = exp(S - lse) again, dV += P^T dO,
  dP = dO V^T, dS = P (dP - delta), dq = dS K, dK += dS^T q (7 products);
- ``parts, storing P``: the same without the second S and exp (6 products): a lower bound for
  any kernel built on these products that keeps the (H, N, P) probabilities instead;
- ``stored P, torch ops``: that scheme run for real (:func:`stored_attention`), the
  probabilities written out in the forward and read back in the backward;
- ``GPT-2 MLP``: the stock ``GPT2MLP`` of the same width (d -> 4d -> d, gelu_new), forward +
  backward, and ``MLP products``: its 6 matrix products alone.

Each row also shows its fp32 GFLOP/s (2 m n k per product) and its time over
``fused (PyTorch)``'s. Time: the fastest of ``--repeats`` runs, rows interleaved per round.

    OMP_NUM_THREADS=1 python bench/bank_bound.py --clock cpu                # head size 32
    OMP_NUM_THREADS=1 python bench/bank_bound.py --clock cpu --n-head 4     # head size 64
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import add_clock_option, best_of, get_clock
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

from mosaics import MosaicsConfig
from mosaics.baselines import gpt2_config_like
from mosaics.ops.banks import _BankAttention, _StoredBankAttention, bank_attention, bank_extension

Run = Callable[[], None]


def bank_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, form=None) -> Run:
    """Forward + backward of ``form`` ((H, N, hs) queries, (H, P, hs) banks; default
    :func:`bank_attention`)."""
    def run() -> None:
        q.grad = k.grad = v.grad = None
        if form is None:
            bank_attention(q, k, v).sum().backward()
        else:
            form(q, k, v).sum().backward()
    return run


def stored_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     rows: int) -> tuple[torch.Tensor, ...]:
    """softmax(q k^T) v and the gradients (dq, dk, dv) for the output gradient g, keeping the
    probabilities instead of recomputing them: PyTorch ops on one head and ``rows`` queries at
    a time, every buffer under 32 MB (a fresh (H, N, P) buffer would be mmap-ed and
    page-faulted on every call: 1.3x slower) and the dP buffer reused."""
    H, N, hs = q.shape
    probs = [q.new_empty(H, min(rows, N - s), k.shape[1]) for s in range(0, N, rows)]
    out, dq = torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for h in range(H):
        for i, s in enumerate(range(0, N, rows)):
            p = probs[i][h]
            torch.mm(q[h, s:s + rows], k[h].T, out=p)
            torch.ops.aten._softmax.out(p, -1, False, out=p)
            torch.mm(p, v[h], out=out[h, s:s + rows])
    delta = (g * out).sum(-1, keepdim=True)
    dp = q.new_empty(min(rows, N), k.shape[1])
    for h in range(H):
        for i, s in enumerate(range(0, N, rows)):
            p, gb = probs[i][h], g[h, s:s + rows]
            ds = dp[:p.shape[0]]
            dv[h].addmm_(p.T, gb)
            torch.mm(gb, v[h].T, out=ds)
            ds.sub_(delta[h, s:s + rows]).mul_(p)
            torch.mm(ds, k[h], out=dq[h, s:s + rows])
            dk[h].addmm_(ds.T, q[h, s:s + rows])
    return out, dq, dk, dv


def part_runs(hs: int, P: int, rows: int) -> dict[str, Run]:
    """Each operation of the bank's forward and backward on one head and ``rows`` queries."""
    q, g = F.normalize(torch.randn(rows, hs), dim=-1), torch.randn(rows, hs)
    k, v = torch.randn(P, hs) * 0.3, torch.randn(P, hs)
    s, p, dp = torch.empty(rows, P), torch.softmax(torch.randn(rows, P), -1), torch.empty(rows, P)
    o, dq = torch.empty(rows, hs), torch.empty(rows, hs)
    dk, dv = torch.zeros(P, hs), torch.zeros(P, hs)
    lse, delta = torch.randn(rows, 1), torch.randn(rows, 1)
    return {
        "S = q K^T": lambda: torch.mm(q, k.T, out=s),
        "softmax": lambda: torch.ops.aten._softmax.out(s, -1, False, out=s),
        "o = P V": lambda: torch.mm(p, v, out=o),
        "P = exp(S - lse)": lambda: torch.sub(s, lse, out=dp).exp_(),
        "dV += P^T dO": lambda: dv.addmm_(p.T, g),
        "dP = dO V^T": lambda: torch.mm(g, v.T, out=dp),
        "dS = P (dP - delta)": lambda: dp.sub_(delta).mul_(p),
        "dq = dS K": lambda: torch.mm(dp, k, out=dq),
        "dK += dS^T q": lambda: dk.addmm_(dp.T, q),
    }


STORED = ("S = q K^T", "softmax", "o = P V", "dV += P^T dO", "dP = dO V^T",
          "dS = P (dP - delta)", "dq = dS K", "dK += dS^T q")
RECOMPUTED = (*STORED, "S = q K^T", "P = exp(S - lse)")


def mlp_runs(d: int, N: int) -> tuple[Run, Run]:
    """(stock GPT2MLP forward + backward, its 6 matrix products alone) on N tokens."""
    mlp = GPT2MLP(4 * d, gpt2_config_like(MosaicsConfig(n_embd=d, n_head=1, n_layer=1)))
    x = torch.randn(N, d, requires_grad=True)

    def module() -> None:
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        mlp(x).sum().backward()

    a, h, gh, go = (torch.randn(N, n) for n in (d, 4 * d, 4 * d, d))
    w1, w2 = torch.randn(d, 4 * d), torch.randn(4 * d, d)

    def products() -> None:
        torch.mm(a, w1)      # forward: x W1, h W2
        torch.mm(h, w2)
        torch.mm(go, w2.T)   # backward of W2: dh, dW2
        torch.mm(h.T, go)
        torch.mm(gh, w1.T)   # backward of W1: dx, dW1
        torch.mm(a.T, gh)
    return module, products


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    """Print the table; return {row: (seconds, FLOPs)}."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--rows", type=int, default=256, help="queries per block in the parts")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    add_clock_option(ap)
    args = ap.parse_args(argv)
    clock = get_clock(args.clock)

    torch.manual_seed(0)
    d, H = args.n_embd, args.n_head
    hs, P, N = d // H, MosaicsConfig(n_embd=d, n_head=H).pmem_size, args.batch * args.T
    q = F.normalize(torch.randn(H, N, hs), dim=-1).requires_grad_()
    k = (torch.randn(H, P, hs) * 0.3).requires_grad_()
    v = torch.randn(H, P, hs).requires_grad_()
    parts = part_runs(hs, P, args.rows)
    mlp, mlp_products = mlp_runs(d, N)
    g = torch.randn(H, N, hs)
    compiled = bank_extension() is not None
    runs: dict[str, Run] = {"bank_attention": bank_run(q, k, v),
                            "fused": bank_run(q, k, v, lambda *t: _BankAttention.apply(
                                *(x[None] for x in t))[0]),
                            "stored": lambda: stored_attention(q.detach(), k.detach(),
                                                               v.detach(), g, args.rows),
                            **parts,
                            **({"compiled": bank_run(q, k, v, _StoredBankAttention.apply)}
                               if compiled else {}),
                            "GPT-2 MLP": mlp, "MLP products": mlp_products}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.rounds):
        for name, fn in runs.items():
            fn()  # warm-up
            best[name] = min(best[name], best_of(fn, args.repeats, clock))

    blocks = H * N / args.rows  # one head and one block of rows per part call
    product = 2 * N * P * hs * H  # FLOPs of one of the bank's matrix products, all heads
    rows = {
        "bank_attention": (best["bank_attention"], (6 if compiled else 7) * product),
        "fused (PyTorch)": (best["fused"], 7 * product),
        "parts, recomputing": (blocks * sum(best[n] for n in RECOMPUTED), 7 * product),
        "parts, storing P": (blocks * sum(best[n] for n in STORED), 6 * product),
        "stored P, torch ops": (best["stored"], 6 * product),
        **({"compiled, storing P": (best["compiled"], 6 * product)} if compiled else {}),
        "GPT-2 MLP": (best["GPT-2 MLP"], 6 * 2 * N * d * 4 * d),
        "MLP products": (best["MLP products"], 6 * 2 * N * d * 4 * d),
    }
    print(f"threads={torch.get_num_threads()}, clock={args.clock}, {N} queries (batch "
          f"{args.batch} x T {args.T}), d {d}, {H} heads (head size {hs}), {P} slots, "
          f"parts on blocks of {args.rows} rows\n")
    print(f"{'':>20} {'ms':>8} {'GFLOP/s':>8} {'/ fused':>8}")
    base = rows["fused (PyTorch)"][0]
    for name, (sec, flops) in rows.items():
        print(f"{name:>20} {1e3 * sec:8.1f} {flops / sec / 1e9:8.1f} {sec / base:8.2f}")
    print("\nper operation, all heads and rows (ms):")
    for name in parts:
        print(f"{name:>20} {1e3 * blocks * best[name]:8.1f}")
    return rows


if __name__ == "__main__":
    main()
