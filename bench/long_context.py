"""Long contexts: training tokens/s and peak memory, and long-prompt decoding, against GPT-2.

Models (same width, depth, heads and vocabulary; fp32; CPU): the v1 block with the gaussian,
epanechnikov and FSKA kernels, the v2 block (gaussian; short-term window 256, long-term gap
64), the v2 block with FSKA at one bandwidth per head (``adaptive_bandwidth=False``: its
intervals in linear time; the adaptive bandwidth would give every query its own frequencies),
GPT-2 with PyTorch's fused attention (SDPA) and the rotary Llama baseline (SDPA).
Random tokens are drawn from 1 .. V - 1: token 0 separates v2's documents, so here every
sequence is one document as long as the context.

``--part train``: one step = forward + backward + AdamW update on ``--tokens`` tokens
(batch = tokens / T, so every length does the same number of tokens per step). All models
live in this process. Each first runs one step alone that measures its peak memory: freed heap
memory is handed back (``malloc_trim``), the peak resident set restarted
(``/proc/self/clear_refs``), and the peak above the resident set before the step is reported
(activations, gradients, AdamW's states, temporaries). Then the timed steps alternate between
the models; tokens/s and memory are given as ratios to GPT-2's.

``--part generate``: a prompt of P tokens at batch b is prefilled once (timed), then
``--new-tokens`` greedy tokens are decoded one forward call at a time with the cache; time per
new token excludes the prefill. Cache memory is the bytes of the distinct storages the cache
holds after the last new token (GPT-2/Llama: keys and values; Memory Mosaics: the memory
entries, the running key sums, the last keys and values), and apart from it, "+weights", the
parameters in step form that Memory Mosaics' decoding state keeps (fixed in prompt and batch).

    OMP_NUM_THREADS=1 python bench/long_context.py --part train --clock cpu
    OMP_NUM_THREADS=2 python bench/long_context.py --part train
    OMP_NUM_THREADS=1 python bench/long_context.py --part generate --clock cpu
    OMP_NUM_THREADS=1 python bench/long_context.py --part train --lengths 1024 2048 \\
        --models v1-gaussian gpt2 --steps 2

``--clock cpu`` keeps the fastest step by process CPU time (robust on a shared machine; use
one thread with it); the wall clock keeps the median.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import os
import time
from collections.abc import Callable, Iterable

import torch
from timing import (
    add_clock_option,
    add_denormal_option,
    apply_denormal_option,
    get_clock,
    summarize,
)
from transformers import GPT2LMHeadModel, LlamaForCausalLM, PreTrainedModel

from mosaics import MosaicsConfig, MosaicsForCausalLM
from mosaics.baselines import gpt2_config_like, llama_config_like

MODELS = ("v1-gaussian", "v1-epanechnikov", "v2-gaussian", "v2-fska", "fska", "gpt2", "llama")
BASELINE = "gpt2"


def build(name: str, args: argparse.Namespace, block_size: int) -> PreTrainedModel:
    """One of :data:`MODELS`, seeded, sized by ``args``, with ``block_size`` positions."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=args.vocab, n_layer=args.n_layer, n_head=args.n_head,
                 n_embd=args.n_embd, block_size=block_size, dropout=0.0, eos_token_id=None)
    if name in ("v1-gaussian", "v1-epanechnikov", "fska"):
        kernel = {"v1-gaussian": "gaussian", "v1-epanechnikov": "epanechnikov"}.get(name, name)
        return MosaicsForCausalLM(MosaicsConfig(**sizes, kernel=kernel))
    if name == "v2-gaussian":
        return MosaicsForCausalLM(MosaicsConfig.v2(**sizes, kernel="gaussian",
                                                   document_separator_id=0))
    if name == "v2-fska":  # one bandwidth per head: FSKA's linear-time intervals
        return MosaicsForCausalLM(MosaicsConfig.v2(**sizes, kernel="fska",
                                                   adaptive_bandwidth=False,
                                                   document_separator_id=0))
    cfg = MosaicsConfig(**sizes)
    if name == "gpt2":
        gcfg = gpt2_config_like(cfg, n_positions=block_size)
        gcfg._attn_implementation = "sdpa"
        return GPT2LMHeadModel(gcfg)
    if name == "llama":
        lcfg = llama_config_like(cfg, max_position_embeddings=block_size)
        lcfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(lcfg)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def random_tokens(vocab: int, shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    return torch.randint(1, vocab, shape, generator=torch.Generator().manual_seed(seed))


def train_step(model: PreTrainedModel, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def resident_bytes() -> int:
    """The current resident set of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    """The peak resident set of this process since the last :func:`reset_peak` (VmHWM)."""
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    return int(hwm.split()[1]) * 1024  # kB


def reset_peak() -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim``), then restart the
    peak resident set at the current one (``/proc/self/clear_refs``, Linux >= 4.0)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def train_length(names: Iterable[str], T: int, args: argparse.Namespace,
                 clock: Callable[[], float]) -> tuple[dict[str, float], dict[str, float | str]]:
    """(step seconds, peak bytes or why it failed) of each model at length T.

    Every model first runs one step alone with the peak resident set restarted before it:
    its peak above the resident set before the step is that step's activations, gradients,
    AdamW's states and temporaries. Then ``--steps`` timed steps alternate between the models
    that fit."""
    models = {n: build(n, args, T).train() for n in names}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
    ids = random_tokens(args.vocab, (args.tokens // T, T))
    memory: dict[str, float | str] = {}
    for n in list(models):
        reset_peak()
        base = resident_bytes()
        try:
            train_step(models[n], opts[n], ids)
        except (MemoryError, RuntimeError) as e:  # torch reports a failed allocation as either
            memory[n] = str(e).splitlines()[0][:120]
            del models[n], opts[n]
            continue
        memory[n] = peak_bytes() - base
    times: dict[str, list[float]] = {n: [] for n in models}
    for i in range(args.steps):
        for n in list(models) if i % 2 == 0 else list(models)[::-1]:
            t0 = clock()
            train_step(models[n], opts[n], ids)
            times[n].append(clock() - t0)
    return {n: summarize(t, clock) for n, t in times.items()}, memory


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def ratio(x: float, base: float | None) -> str:
    """x / base to two decimals, blank without a base (the baseline's own row)."""
    return "" if base is None else f"{x / base:.2f}"


def run_train(args: argparse.Namespace, clock: Callable[[], float]) -> None:
    print(f"training: {args.tokens} tokens per step (batch = tokens / T), AdamW, "
          f"{'fastest' if args.clock == 'cpu' else 'median'} of {args.steps} timed step(s) "
          f"after the memory step\n")
    header = (f"{'T':>6} {'batch':>5} {'model':<16}{'step s':>9}{'tok/s':>9}{'/GPT-2':>8}"
              f"{'peak GiB':>10}{'/GPT-2':>8}")
    print(header)
    print("-" * len(header))
    for T in args.lengths:
        step, mem = train_length(args.models, T, args, clock)
        base = mem.get(BASELINE)
        lead = f"{T:>6} {args.tokens // T:>5}"
        for n in args.models:
            if isinstance(mem[n], str):
                print(f"{lead} {n:<16}  does not fit: {mem[n]}", flush=True)
                continue
            own = n == BASELINE
            speed = ratio(step.get(BASELINE, 0.0), None if own or BASELINE not in step
                          else step[n])
            memory = ratio(mem[n], None if own or not isinstance(base, int) else base)
            print(f"{lead} {n:<16}{step[n]:>9.2f}{args.tokens / step[n]:>9.0f}{speed:>8}"
                  f"{gib(mem[n]):>10}{memory:>8}", flush=True)


def storage_bytes(obj: object, seen: set[int], weights: bool = False) -> tuple[int, int]:
    """(state bytes, weight bytes) of the distinct tensor storages reachable from ``obj``
    (attributes, containers); tensors inside NamedTuples (Memory Mosaics' parameters in step
    form) count as weights."""
    if isinstance(obj, torch.Tensor):
        s = obj.untyped_storage()
        if s.data_ptr() in seen:
            return 0, 0
        seen.add(s.data_ptr())
        return (0, s.nbytes()) if weights else (s.nbytes(), 0)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        weights = True
    if isinstance(obj, dict):
        parts: Iterable = obj.values()
    elif isinstance(obj, (list, tuple)):
        parts = obj
    elif hasattr(obj, "__dict__"):
        parts = vars(obj).values()
    else:
        return 0, 0
    sizes = [storage_bytes(v, seen, weights) for v in parts]
    return sum(a for a, _ in sizes), sum(b for _, b in sizes)


@torch.no_grad()
def decode(model: PreTrainedModel, prompt: torch.Tensor, new_tokens: int,
           clock: Callable[[], float]) -> tuple[float, float, tuple[int, int]]:
    """(prefill seconds, decoding seconds per new token, (state, weight) bytes of the cache
    after the last new token)."""
    # transformers renamed past_key_values to cache (5.x); older 5.x releases know only the old name
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    t0 = clock()
    out = model(input_ids=prompt, use_cache=True)
    prefill = clock() - t0
    cache, nxt = out[name], out.logits[:, -1:].argmax(-1)
    del out
    t0 = clock()
    for _ in range(new_tokens):
        out = model(input_ids=nxt, use_cache=True, **{name: cache})
        cache, nxt = out[name], out.logits[:, -1:].argmax(-1)
    per_token = (clock() - t0) / new_tokens
    return prefill, per_token, storage_bytes(cache, set())


def run_generate(args: argparse.Namespace, clock: Callable[[], float]) -> None:
    print(f"generation: greedy, {args.new_tokens} new tokens after the prefill, time per new "
          f"token excludes the prefill; {'fastest' if args.clock == 'cpu' else 'median'} of "
          f"{args.repeats}\n")
    header = (f"{'prompt':>6} {'batch':>5} {'model':<16}{'prefill s':>10}{'ms/token':>10}"
              f"{'GPT-2/MM':>9}{'cache MiB':>11}{'/GPT-2':>8}{'+weights':>9}")
    print(header)
    print("-" * len(header))
    for P in args.prompts:
        models = {n: build(n, args, P + args.new_tokens + 1).eval() for n in args.models}
        for b in args.batches:
            prompt = random_tokens(args.vocab, (b, P))
            res: dict[str, list[tuple[float, float, int]]] = {n: [] for n in models}
            for r in range(args.repeats):
                for n in list(models) if r % 2 == 0 else list(models)[::-1]:
                    res[n].append(decode(models[n], prompt, args.new_tokens, clock))
            row = {n: (summarize([x[0] for x in v], clock), summarize([x[1] for x in v], clock),
                       v[0][2]) for n, v in res.items()}
            base = row.get(BASELINE)
            for n, (prefill, per_token, (size, fixed)) in row.items():
                own = n == BASELINE or base is None
                speed = ratio(base[1] if base else 0.0, None if own else per_token)
                memory = ratio(size, None if own else base[2][0])
                print(f"{P:>6} {b:>5} {n:<16}{prefill:>10.2f}{1e3 * per_token:>10.2f}"
                      f"{speed:>9}{size / 2**20:>11.1f}{memory:>8}{fixed / 2**20:>9.1f}",
                      flush=True)
        del models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["train", "generate"], default="train")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per training step")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per model, after the "
                    "one that measures its memory")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    add_clock_option(ap)
    add_denormal_option(ap)
    args = ap.parse_args()
    bad = [T for T in args.lengths if args.tokens % T]
    if args.part == "train" and bad:
        ap.error(f"--tokens {args.tokens} is not a multiple of the lengths {bad}: every length "
                 f"must do the same tokens per step")
    clock = get_clock(args.clock)
    denormals = apply_denormal_option(args)
    print(f"threads={torch.get_num_threads()}, clock={args.clock}, {args.n_layer} layers, "
          f"d {args.n_embd}, {args.n_head} heads, vocab {args.vocab}, fp32, {denormals}, "
          f"{time.strftime('%Y-%m-%d')}")
    (run_train if args.part == "train" else run_generate)(args, clock)


if __name__ == "__main__":
    main()
