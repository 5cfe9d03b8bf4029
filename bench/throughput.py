"""Training-step throughput: Memory Mosaics vs a GPT-2 of the same size, in one process.

One step = forward + backward + AdamW update on a (batch, T) batch of random tokens. The two
models alternate step by step (so machine noise hits both alike) and the median step time is
reported, with tokens/s, their ratio, and achieved FLOP/s against this machine's measured fp32
matmul peak. FLOPs per token = 6 N (non-embedding weights incl. the tied head and the
persistent banks) + 6 L T d (causal attention scores and weighted sums, forward + backward).

    OMP_NUM_THREADS=2 python bench/throughput.py               # d 256, 4 layers, T 512
    OMP_NUM_THREADS=2 python bench/throughput.py --lengths 256 512 1024 --kernel gaussian
    OMP_NUM_THREADS=1 python bench/throughput.py --clock cpu   # robust on a shared machine
    OMP_NUM_THREADS=1 python bench/throughput.py --clock cpu --v2   # the v2 block too

Memory Mosaics trains with its chunked loss (no (B, T, V) logits; ``--loss-chunk-size 0``
materialises them like GPT-2 does, for a like-for-like head). Every model runs its training
forward with ``use_cache=False``, as the trainer does (no decoding state is built).

``--v2`` adds the Memory Mosaics v2 block (``MosaicsConfig.v2``: gated keys, adaptive
bandwidth, short- and long-term memories through per-query intervals, SwiGLU persistent
memory, document masking) with the same width, depth, heads and kernel; token 0 separates
documents, so the random batches hold documents of about ``--vocab`` tokens.

``--padding`` adds the v1 model's step with an ``attention_mask`` of ones (the padding check,
no padding: the ``mosaics+mask`` row) and with a left-padded batch (row b padded by
b T / (2 batch) tokens, labels -100 there: ``mosaics+leftpad``), to read against ``mosaics``
(no mask) in the same run.

``--clock cpu`` times with process CPU time instead of wall time: on a machine shared with
other jobs it measures the work done rather than the waiting (use one thread with it).
"""

from __future__ import annotations

import argparse
import time

import torch
from timing import (
    add_clock_option,
    add_denormal_option,
    apply_denormal_option,
    best_of,
    get_clock,
    summarize,
)
from transformers import GPT2LMHeadModel

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.baselines import gpt2_config_like


def matmul_peak(n: int = 1024, repeats: int = 10, clock=time.perf_counter) -> float:
    """Measured fp32 matmul FLOP/s on this machine with the current thread count (best of)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n**3 / best_of(lambda: a @ b, repeats, clock)


def flops_per_token(model: torch.nn.Module, n_layer: int, d: int, T: int) -> float:
    wte = model.get_input_embeddings().weight
    n = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and p is not wte)
    n += wte.numel()  # tied output head still costs a matmul
    if hasattr(model, "transformer"):
        n -= model.transformer.wpe.weight.numel()
    return 6 * n + 6 * n_layer * T * d


def build(arch: str, cfg: MosaicsConfig) -> torch.nn.Module:
    if arch.startswith("mosaics"):
        return MosaicsForCausalLM(cfg)
    gcfg = gpt2_config_like(cfg, n_positions=cfg.block_size)
    gcfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(gcfg)


def bench(configs: dict[str, MosaicsConfig], batch: int, T: int, steps: int, warmup: int,
          clock=time.perf_counter) -> dict:
    """Median (wall clock) or fastest (CPU time) training step of each Memory Mosaics config
    in ``configs`` and of a GPT-2 shaped like the first, steps alternating between models."""
    torch.manual_seed(0)
    first = next(iter(configs.values()))
    models = {a: build(a, cfg).train() for a, cfg in (*configs.items(), ("gpt2", first))}
    opts = {a: torch.optim.AdamW(m.parameters(), lr=1e-4) for a, m in models.items()}
    ids = torch.randint(0, first.vocab_size, (batch, T))
    ones = torch.ones_like(ids)
    left = (torch.arange(T).view(1, T) >= (torch.arange(batch) * T // (2 * batch)).view(-1, 1))
    masks = {"mosaics+mask": ones, "mosaics+leftpad": left.long()}
    labels = {"mosaics+leftpad": ids.masked_fill(~left, -100)}
    times: dict[str, list[float]] = {a: [] for a in models}
    for i in range(warmup + steps):
        for arch, model in models.items():
            t0 = clock()
            loss = model(input_ids=ids, labels=labels.get(arch, ids), use_cache=False,
                         **({"attention_mask": masks[arch]} if arch in masks else {})).loss
            loss.backward()
            opts[arch].step()
            opts[arch].zero_grad(set_to_none=True)
            if i >= warmup:
                times[arch].append(clock() - t0)
    out = {}
    for arch, model in models.items():
        step = summarize(times[arch], clock)
        out[arch] = dict(
            params=sum(p.numel() for p in model.parameters()),
            step_s=step,
            tok_s=batch * T / step,
            flops=flops_per_token(model, first.n_layer, first.n_embd, T) * batch * T / step,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)  # head size 64, as GPT-2 and the reference
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--kernel", default="gaussian")
    ap.add_argument("--loss-chunk-size", type=int, default=1024,
                    help="Memory Mosaics' chunked-loss rows (0: materialise the logits)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    add_clock_option(ap)
    add_denormal_option(ap)
    ap.add_argument("--v2", action="store_true",
                    help="also measure the Memory Mosaics v2 block (MosaicsConfig.v2)")
    ap.add_argument("--padding", action="store_true",
                    help="also measure the v1 step with a mask of ones and left-padded")
    args = ap.parse_args()
    clock = get_clock(args.clock)
    denormals = apply_denormal_option(args)

    peak = matmul_peak(clock=clock)
    print(f"threads={torch.get_num_threads()}, clock={args.clock}, measured fp32 matmul peak: "
          f"{peak / 1e9:.1f} GFLOP/s")
    print(f"model: {args.n_layer} layers, d {args.n_embd}, {args.n_head} heads, vocab "
          f"{args.vocab}, batch {args.batch}, kernel {args.kernel}, fp32, "
          f"loss_chunk_size {args.loss_chunk_size}, {denormals}\n")
    header = (f"{'T':>6} {'arch':>15} {'params':>11} {'step ms':>9} {'tok/s':>9} "
              f"{'GFLOP/s':>8} {'% peak':>7} {'MM/GPT2':>8}")
    print(header)
    print("-" * len(header))
    for T in args.lengths:
        sizes = dict(vocab_size=args.vocab, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, block_size=T, dropout=0.0, kernel=args.kernel,
                     loss_chunk_size=args.loss_chunk_size)
        configs = {"mosaics": MosaicsConfig(**sizes)}
        if args.padding:
            configs["mosaics+mask"] = configs["mosaics+leftpad"] = configs["mosaics"]
        if args.v2:
            configs["mosaics-v2"] = MosaicsConfig.v2(**sizes, document_separator_id=0)
        res = bench(configs, args.batch, T, args.steps, args.warmup, clock)
        for arch, r in res.items():
            ratio = r["tok_s"] / res["gpt2"]["tok_s"]
            print(f"{T:>6} {arch:>15} {r['params']:>11,} {1e3 * r['step_s']:>9.1f} "
                  f"{r['tok_s']:>9.0f} {r['flops'] / 1e9:>8.1f} {100 * r['flops'] / peak:>6.1f}% "
                  f"{(f'{ratio:.2f}' if arch != 'gpt2' else ''):>8}")


if __name__ == "__main__":
    main()
