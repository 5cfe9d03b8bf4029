"""Generation speed: Memory Mosaics vs a GPT-2 of the same size, through ``model.generate``.

Both models generate ``--new-tokens`` tokens after a random ``--prompt``-token prompt (prefill
included in the time), for each kernel, batch size and decoding mode (greedy, sampling with
the default top-k 50). The two models alternate run by run, in changing order, so machine
noise hits both alike; the median over ``--repeats`` runs (the fastest with ``--clock cpu``) is
reported as generated tokens per second and as the ratio Memory Mosaics / GPT-2 (above 1:
Memory Mosaics is faster).

A second table compares cached generation with recomputing the whole prefix for every token
(``use_cache=False``) at batch 1, greedy, and checks that both give the same tokens.

    OMP_NUM_THREADS=1 python bench/generate.py                    # 4 layers, d 256, vocab 4096
    OMP_NUM_THREADS=1 python bench/generate.py --clock cpu        # robust on a shared machine
    OMP_NUM_THREADS=1 python bench/generate.py --kernels gaussian --batches 1 --repeats 5

``--padding`` adds a table of Memory Mosaics alone, generating with an ``attention_mask``: of
ones with the padding check switched off (what a model without padding support runs), of
ones (the check finds no padding), and left-padded (row b of a batch loses its first
b P / (2 batch) prompt tokens to padding), runs alternating; ratios against the first.

    OMP_NUM_THREADS=1 python bench/generate.py --clock cpu --padding --batches 8

``--clock cpu`` times with process CPU time instead of wall time: on a machine shared with
other jobs it measures the work done rather than the waiting (use one thread with it), and the
fastest run is kept: other jobs only ever add CPU time (cache misses, memory bandwidth), so the
minimum is the least disturbed run, as in ``bench/throughput.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from unittest import mock

import torch
from timing import add_clock_option, get_clock, summarize
from transformers import GPT2LMHeadModel, PreTrainedModel

from mosaics import MosaicsConfig, MosaicsForCausalLM, modeling_mosaics, positions
from mosaics.baselines import gpt2_config_like


def build_pair(kernel: str, args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(Memory Mosaics, GPT-2) of the same width, depth, heads and vocabulary, in eval mode."""
    cfg = MosaicsConfig(vocab_size=args.vocab, n_layer=args.n_layer, n_head=args.n_head,
                        n_embd=args.n_embd, block_size=args.prompt + args.new_tokens,
                        kernel=kernel, dropout=0.0, eos_token_id=None)
    torch.manual_seed(0)
    mosaics = MosaicsForCausalLM(cfg).eval()
    gcfg = gpt2_config_like(cfg, n_positions=args.prompt + args.new_tokens)
    gcfg._attn_implementation = "sdpa"
    return mosaics, GPT2LMHeadModel(gcfg).eval()


def generate(model: PreTrainedModel, prompt: torch.Tensor, new_tokens: int, sample: bool,
             use_cache: bool = True, mask: torch.Tensor | None = None) -> torch.Tensor:
    torch.manual_seed(1)
    return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=sample, use_cache=use_cache, pad_token_id=0,
                          attention_mask=mask)


def padding_cost(model: PreTrainedModel, prompt: torch.Tensor, args: argparse.Namespace,
                 clock: Callable[[], float]) -> dict[str, float]:
    """Greedy tokens/s of ``model`` with a mask of ones and the padding check off, a mask of
    ones, and a left-padded batch, runs alternating (module docstring)."""
    B, P = prompt.shape
    ones = torch.ones_like(prompt)
    left = (torch.arange(P).view(1, P) >= (torch.arange(B) * P // (2 * B)).view(-1, 1)).long()
    no_check = lambda *a, **k: None  # noqa: E731
    # the module whose padding_starts the model calls (older trees: modeling_mosaics)
    padding_home = positions if hasattr(positions, "padding_starts") else modeling_mosaics
    runs = {"no check": (ones, no_check), "ones": (ones, None), "left-padded": (left, None)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.repeats + 1):  # the first round warms up
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            mask, check = runs[name]
            with mock.patch.object(padding_home, "padding_starts",
                                   check or padding_home.padding_starts):
                dt, _ = timed(lambda m=mask: generate(model, prompt, args.new_tokens, False,
                                                      mask=m), clock)
            if r:
                times[name].append(dt)
    return {name: B * args.new_tokens / summarize(t, clock) for name, t in times.items()}


def timed(fn: Callable[[], torch.Tensor], clock: Callable[[], float]) -> tuple[float, torch.Tensor]:
    t0 = clock()
    out = fn()
    return clock() - t0, out


def compare(models: dict[str, PreTrainedModel], prompt: torch.Tensor, args: argparse.Namespace,
            sample: bool, clock: Callable[[], float]) -> dict[str, float]:
    """Generated tokens/s of each model (:func:`timing.summarize` of the runs), runs alternating
    between the models."""
    for model in models.values():  # warm-up: allocator, one-time checks
        generate(model, prompt[:, :16], 4, sample)
    times: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            dt, _ = timed(lambda m=models[name]: generate(m, prompt, args.new_tokens, sample),
                          clock)
            times[name].append(dt)
    n = prompt.shape[0] * args.new_tokens
    return {name: n / summarize(t, clock) for name, t in times.items()}


def recompute_speedup(model: PreTrainedModel, prompt: torch.Tensor, args: argparse.Namespace,
                      clock: Callable[[], float]) -> tuple[float, float, bool]:
    """(cached tokens/s, use_cache=False tokens/s, same tokens) at greedy decoding.

    The cached runs go first, then the recomputing ones: interleaved, each cached run follows
    a recomputing run (its large allocations) and measured up to 17% slower than the same
    setting in :func:`compare`.
    """
    cached, uncached = [], []
    for _ in range(args.recompute_repeats):
        dt, out = timed(lambda: generate(model, prompt, args.new_tokens, False), clock)
        cached.append(dt)
    for _ in range(args.recompute_repeats):
        dt, ref = timed(lambda: generate(model, prompt, args.new_tokens, False, False), clock)
        uncached.append(dt)
    n = prompt.shape[0] * args.new_tokens
    return n / summarize(cached, clock), n / summarize(uncached, clock), torch.equal(out, ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", nargs="+", default=["gaussian", "epanechnikov"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--modes", nargs="+", choices=["greedy", "sample"],
                    default=["greedy", "sample"])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--recompute-repeats", type=int, default=3,
                    help="runs of the use_cache=False comparison (0: skip it)")
    ap.add_argument("--padding", action="store_true",
                    help="also time generation with a mask of ones (check on, off) and "
                         "left-padded")
    add_clock_option(ap)
    args = ap.parse_args()
    clock = get_clock(args.clock)
    print(f"threads={torch.get_num_threads()}, clock={args.clock}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, {args.n_layer} layers, d {args.n_embd}, "
          f"{args.n_head} heads, vocab {args.vocab}, "
          f"{'fastest' if args.clock == 'cpu' else 'median'} of {args.repeats}")
    gen = torch.Generator().manual_seed(2)
    speedups, padding = [], []
    print(f"\n{'kernel':<14}{'batch':>6}  {'mode':<8}{'MM tok/s':>10}{'GPT-2 tok/s':>13}"
          f"{'MM/GPT-2':>10}")
    for kernel in args.kernels:
        mosaics, gpt2 = build_pair(kernel, args)
        for batch in args.batches:
            prompt = torch.randint(1, args.vocab, (batch, args.prompt), generator=gen)  # 0: padding
            for mode in args.modes:
                rate = compare({"mm": mosaics, "gpt2": gpt2}, prompt, args, mode == "sample",
                               clock)
                print(f"{kernel:<14}{batch:>6}  {mode:<8}{rate['mm']:>10.1f}"
                      f"{rate['gpt2']:>13.1f}{rate['mm'] / rate['gpt2']:>10.2f}", flush=True)
        if args.padding:
            for batch in args.batches:
                prompt = torch.randint(1, args.vocab, (batch, args.prompt), generator=gen)
                padding.append((kernel, batch, padding_cost(mosaics, prompt, args, clock)))
        if args.recompute_repeats > 0:
            prompt = torch.randint(1, args.vocab, (1, args.prompt), generator=gen)
            speedups.append((kernel, *recompute_speedup(mosaics, prompt, args, clock)))
    if padding:
        print(f"\n{'kernel':<14}{'batch':>6}{'no check':>10}{'ones':>10}{'left-padded':>13}"
              f"{'ones/no check':>15}{'padded/no check':>17}   (MM tok/s, greedy)")
        for kernel, batch, rate in padding:
            base = rate["no check"]
            print(f"{kernel:<14}{batch:>6}{base:>10.1f}{rate['ones']:>10.1f}"
                  f"{rate['left-padded']:>13.1f}{rate['ones'] / base:>15.3f}"
                  f"{rate['left-padded'] / base:>17.3f}")
    if speedups:
        print(f"\n{'kernel':<14}{'cached tok/s':>13}{'recompute tok/s':>17}{'speedup':>9}"
              f"  same tokens   (batch 1, greedy)")
        for kernel, cached, uncached, same in speedups:
            print(f"{kernel:<14}{cached:>13.1f}{uncached:>17.1f}{cached / uncached:>9.1f}"
                  f"  {same}")


if __name__ == "__main__":
    main()
