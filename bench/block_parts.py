"""Where a training step goes: forward + backward of each part of one Memory Mosaics block
against the matching part of a GPT-2 block of the same size, in one process.

Parts (input (batch, T, d) with gradients, loss = sum of the output):

- ``contextual``: the contextual memory (projections, leaky keys, look-ahead values, kernel)
  against GPT-2's attention (c_attn, SDPA, c_proj);
- ``persistent``: the persistent memory (key projection, leaky keys, slot-bank attention,
  output projection) against GPT-2's MLP (d -> 4d -> d);
- ``banks``: the slot-bank attention alone (the persistent memory's softmax over P slots per
  head, forward + backward, the queries of all B T tokens at once);
- ``block``: a whole block against a whole GPT-2 block.

Each cell is the fastest of ``--repeats`` runs; the parts alternate so machine noise hits both
alike. Ratios > 1: the Memory Mosaics part is slower.

    OMP_NUM_THREADS=1 python bench/block_parts.py --clock cpu
    OMP_NUM_THREADS=1 python bench/block_parts.py --clock cpu --n-head 4   # head size 64
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from timing import add_clock_option, best_of, get_clock
from transformers import GPT2LMHeadModel

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.baselines import gpt2_config_like
from mosaics.ops import bank_attention


def forward_backward(module: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        x.grad = None
        module.zero_grad(set_to_none=True)
        out = module(x)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    return run


def bank_part(mm_model: MosaicsForCausalLM, batch: int, T: int) -> Callable[[], None]:
    """The slot-bank attention of the first block's persistent memory on unit-norm queries."""
    pmem = mm_model.model.blocks[0].pmem
    H = pmem.n_head
    hs = pmem.mem_keys.shape[-1]
    q = torch.nn.functional.normalize(torch.randn(1, H, batch * T, hs), dim=-1)
    q.requires_grad_(True)

    def run() -> None:
        q.grad = None
        pmem.zero_grad(set_to_none=True)
        w = pmem.weights()
        bank_attention(q[0], w.keys, w.values).sum().backward()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--kernel", default="gaussian")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    add_clock_option(ap)
    args = ap.parse_args()
    clock = get_clock(args.clock)

    torch.manual_seed(0)
    cfg = MosaicsConfig(vocab_size=512, n_layer=1, n_head=args.n_head, n_embd=args.n_embd,
                        block_size=args.T, dropout=0.0, kernel=args.kernel)
    mm = MosaicsForCausalLM(cfg).train()
    gcfg = gpt2_config_like(cfg, n_positions=args.T)
    gcfg._attn_implementation = "sdpa"
    gpt = GPT2LMHeadModel(gcfg).train()
    block, gblock = mm.model.blocks[0], gpt.transformer.h[0]
    x = torch.randn(args.batch, args.T, args.n_embd, requires_grad=True)
    parts = {
        "contextual": (forward_backward(block.cmem, x), forward_backward(gblock.attn, x),
                       "attention"),
        "persistent": (forward_backward(block.pmem, x), forward_backward(gblock.mlp, x), "MLP"),
        "banks": (bank_part(mm, args.batch, args.T), None, "-"),
        "block": (forward_backward(block, x), forward_backward(gblock, x), "block"),
    }
    best: dict[str, list[float]] = {name: [float("inf")] * 2 for name in parts}
    for _ in range(args.rounds):
        for name, (ours, theirs, _) in parts.items():
            for i, fn in enumerate((ours, theirs)):
                if fn is not None:
                    fn()  # warm-up
                    best[name][i] = min(best[name][i], best_of(fn, args.repeats, clock))

    print(f"threads={torch.get_num_threads()}, clock={args.clock}, batch {args.batch}, "
          f"T {args.T}, d {args.n_embd}, {args.n_head} heads (head size "
          f"{args.n_embd // args.n_head}), {cfg.pmem_size} slots, kernel {args.kernel}\n")
    print(f"{'part':>11} {'MM ms':>8} {'GPT-2 part':>11} {'GPT-2 ms':>9} {'MM/GPT-2':>9}")
    for name, (_, _, other) in parts.items():
        ours, theirs = best[name]
        ratio = f"{ours / theirs:9.2f}" if theirs < float("inf") else f"{'-':>9}"
        their_ms = f"{1e3 * theirs:9.1f}" if theirs < float("inf") else f"{'-':>9}"
        print(f"{name:>11} {1e3 * ours:8.1f} {other:>11} {their_ms} {ratio}")


if __name__ == "__main__":
    main()
