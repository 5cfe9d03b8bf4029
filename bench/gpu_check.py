"""One command to check a GPU machine, answering within about 10 minutes whatever happens.

    python bench/gpu_check.py                          # on a CUDA machine, ~10 minutes
    python bench/gpu_check.py --dry-run                # every kernel section, tiny, on CPU
    python bench/gpu_check.py --device cpu --quick     # smoke run of every section on CPU

Each section runs in its own process with a time limit (``BUDGETS``, changed with
``--budget kernels_bf16=200``), capped by what is left of ``--total-budget`` (600 s): a
section past its limit is stopped with its process group and recorded (``timed_out``), and
the next one starts. In order:

1. ``tests``: ``pytest -m cuda`` (kernels on CUDA against the CPU reference, the bf16 fused
   tests, bf16 training steps, cached generation, ...), one line per test in
   ``<out>/cuda_tests.log``.
2. ``warm``: every fused Triton variant (kernel x dtype, FSKA's op) run once at a small T in
   parallel processes, so that Triton's on-disk cache holds each compile before any timing.
   It starts with the run, compiling on the CPU cores while the CUDA tests run, and is
   waited for (at most its own limit) once they are done.
3. ``kernels_bf16``: contextual-memory forward + backward of every kernel at T 4096 and
   16384 in bf16 (B 1, H 12, head size 64), against the Gaussian kernel, whose bf16 rows run
   PyTorch's SDPA (its default choice, and flash and cuDNN forced): the baseline. Per row the
   path taken (``fused``, ``chunked: <why>``, ``sdpa``), the first call's cost apart and the
   peak memory above the inputs. epanechnikov_fixed gets clustered keys (non-empty
   supports at beta e^2; random unit keys never reach its cosine 0.865); FSKA is timed in
   eval mode (fixed frequencies), in training mode (the flow's sampling included) and as its
   fused op alone on fixed features.
4. ``adasplash``: the ``adasplash`` package's alpha-entmax kernels (where installed), with
   its autotuning cut to a few configurations, and their largest difference to ours.
5. ``golden``: 50 training steps of a tiny model per kernel (bf16 autocast, fused kernels)
   against the stored CPU float32 curve of the same seed (``bench/golden_losses.py``,
   ``bench/golden/``) within its stated tolerance.
6. ``tiles``: each fused op's named tile sets (``mosaics.ops.triton_backend.TILES``: power
   with epanechnikov, knn with gaussian_knn, linear with FSKA's op) timed against each other
   in bf16 at T 4096; a ``winner`` row per op names the tiles to pin on this GPU
   (``MOSAICS_TILES=power=<name>,...``).
7. ``kernels_fp32``: the kernels in fp32 at T 1024 and 4096 (ratios against the bf16
   baseline in the final table).
8. ``throughput``: training tokens/s of Memory Mosaics against a GPT-2 of the same size with
   SDPA at the 124M shape, bf16 autocast, eager and ``torch.compile``d, with MFU.
9. ``deepspeed``: ``train.py`` under DeepSpeed ZeRO-2 bf16 on one GPU (a tiny model;
   ``--ds-full``: the 124M recipe), checkpointed half way and resumed; the resumed losses
   must equal the uninterrupted ones.

Every row is appended to ``<out>/rows.jsonl`` (flushed) as soon as it is measured, so a
stopped section keeps its rows; ``<out>/gpu_check.json`` is written after every section. The
run ends with one table (``<out>/table.md``): kernel x T x dtype, time, ratio to the
Gaussian bf16 baseline, path taken, first-call cost; the tile sets with the fastest marked;
and the golden-loss verdicts.
(``--sections kernels`` is the single section of every length and dtype in one process.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
ROWS_FILE = "rows.jsonl"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peak_mb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None


def autocast(device: str, dtype: torch.dtype | None):  # noqa: ANN201
    if dtype is None:
        return torch.autocast("cpu", enabled=False)
    return torch.autocast(device.split(":")[0], dtype=dtype)


def emit(args: argparse.Namespace, section: str, row: dict[str, Any]) -> None:
    """Append one measured row to ``<out>/rows.jsonl``, flushed to disk at once."""
    out = getattr(args, "out", None)
    if out is None:
        return
    path = Path(out) / ROWS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(json.dumps({"section": section, **row}, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def error_text(err: BaseException, width: int = 160) -> str:
    text = str(err).splitlines()[0][:width] if str(err) else ""
    return f"{type(err).__name__}: {text}"


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- 1. CUDA tests -----------------------------------------------------------------------

def run_tests(args: argparse.Namespace) -> dict[str, Any]:
    """``pytest -m cuda``, one line per test written to ``<out>/cuda_tests.log`` as it runs, so
    a run stopped at its limit still shows which tests passed and which one it was in."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", "cuda", "tests", "-p", "no:cacheprovider",
           "--durations=10"]
    log = Path(args.out) / "cuda_tests.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
        try:
            returncode = proc.wait(timeout=args.tests_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncode = None
    lines = log.read_text(errors="replace").strip().splitlines()
    print("\n".join(lines[-15:]))
    if returncode is None:
        started = [x for x in lines if "::" in x]
        running = started[-1].split()[0] if started and not started[-1].rstrip().endswith(
            ("PASSED", "FAILED", "SKIPPED", "ERROR")) else "?"
        print(f"stopped after {args.tests_timeout} s; in {running}")
        return {"returncode": None, "timed_out": True, "running": running,
                "passed": sum("PASSED" in x for x in started),
                "failed": sum("FAILED" in x for x in started), "log": str(log)}
    return {"returncode": returncode, "summary": lines[-1] if lines else "", "log": str(log)}


# --- 2. training throughput ----------------------------------------------------------------

def build_pair(n_layer: int, n_embd: int, n_head: int, vocab: int, T: int):  # noqa: ANN201
    from transformers import GPT2LMHeadModel

    from mosaics import MosaicsConfig, MosaicsForCausalLM
    from mosaics.baselines import gpt2_config_like

    cfg = MosaicsConfig(vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                        block_size=T, dropout=0.0)
    gcfg = gpt2_config_like(cfg, n_positions=T)
    gcfg._attn_implementation = "sdpa"
    return {"mosaics": MosaicsForCausalLM(cfg), "gpt2": GPT2LMHeadModel(gcfg)}


def throughput_plan(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(T, mode) in the order measured: every length eager first, then compiled, the middle
    length first each time (a section stopped at its limit keeps the likeliest-used rows)."""
    middle = sorted(args.lengths, key=lambda T: (T != 2048, T))
    return [(T, mode) for mode in args.modes for T in middle]


def measure_pair(T: int, mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Training steps of Memory Mosaics and GPT-2 (SDPA) at length T, alternating step by
    step, eager or both ``torch.compile``d: median step time, tokens/s, MFU, peak memory."""
    from mosaics.training.flops import device_peak, flops_per_token

    dtype = torch.bfloat16 if args.precision == "bf16" else None
    batch = max(1, args.tokens_per_step // T)
    torch.manual_seed(0)
    models = {k: m.to(args.device).train()
              for k, m in build_pair(args.n_layer, args.n_embd, args.n_head, args.vocab,
                                     T).items()}
    flops = {k: flops_per_token(m.config, T) for k, m in models.items()}
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=args.device != "cpu")
            for k, m in models.items()}
    calls = {k: torch.compile(m, backend=args.compile_backend) if mode == "compiled" else m
             for k, m in models.items()}
    peak_flops = device_peak(torch.device(args.device), args.precision)[0]
    ids = torch.randint(0, args.vocab, (batch, T), device=args.device)
    times: dict[str, list[float]] = {k: [] for k in models}
    first: dict[str, float] = {}
    peaks: dict[str, float | None] = {}
    for i in range(args.warmup + args.steps):
        for name, call in calls.items():
            reset_peak(args.device)
            sync(args.device)
            t0 = time.perf_counter()
            with autocast(args.device, dtype):
                loss = call(input_ids=ids, labels=ids).loss
            loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            sync(args.device)
            if i == 0:
                first[name] = time.perf_counter() - t0  # a compiled step compiles here
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            peaks[name] = peak_mb(args.device)
    step = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for name in models:
        tok_s = batch * T / step[name]
        rows.append({"T": T, "mode": mode, "batch": batch, "model": name,
                     "params": params[name], "step_ms": 1e3 * step[name], "tok_s": tok_s,
                     "first_step_s": first[name], "flops_per_token": flops[name],
                     "mfu": tok_s * flops[name] / peak_flops if peak_flops else None,
                     "peak_mb": peaks[name], "ratio_vs_gpt2": step["gpt2"] / step[name]})
    del models, opts, calls
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (T, mode) of :func:`throughput_plan`; the rows so far are written to
    ``<out>/throughput_rows.json`` after each pair, so a section stopped at its limit keeps
    them. A pair that fails (out of memory, a compile error) is recorded and the rest go on."""
    from mosaics.evaluation.jobs import write_json

    rows: list[dict[str, Any]] = []
    print(f"{'T':>6} {'mode':>8} {'batch':>5} {'model':>8} {'step ms':>9} {'tok/s':>10} "
          f"{'MFU':>6} {'peak MB':>9} {'vs GPT-2':>9} {'1st step s':>10}", flush=True)
    for T, mode in throughput_plan(args):
        try:
            pair = measure_pair(T, mode, args)
        except Exception as err:  # noqa: BLE001 - recorded, the next pair still runs
            pair = [{"T": T, "mode": mode, "error": error_text(err, 200)}]
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        rows.extend(pair)
        for r in pair:
            emit(args, "throughput", r)
            print_throughput_row(r)
        write_json(Path(args.out) / "throughput_rows.json", rows)
    return rows


def print_throughput_row(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"{r['T']:>6} {r['mode']:>8}  {r['error']}", flush=True)
        return
    peak = f"{r['peak_mb']:.0f}" if r["peak_mb"] is not None else "-"
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
    print(f"{r['T']:>6} {r['mode']:>8} {r['batch']:>5} {r['model']:>8} {r['step_ms']:>9.1f} "
          f"{r['tok_s']:>10.0f} {mfu:>6} {peak:>9} {r['ratio_vs_gpt2']:>9.2f} "
          f"{r['first_step_s']:>10.1f}", flush=True)


# --- 3. kernels ----------------------------------------------------------------------------

BETA = 7.39  # e^2: the memory's initial bandwidth
KERNEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ENTMAX_KERNELS = ("epanechnikov", "biweight", "triweight", "entmax")


def check_keys(T: int, H: int, hs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The check's inputs: unit random keys and random values (1, H, T, hs), CPU fp32."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    keys = torch.nn.functional.normalize(torch.randn(1, H, T, hs, generator=g), dim=-1)
    return keys, torch.randn(1, H, T, hs, generator=g)


def clustered_keys(T: int, H: int, hs: int, clusters: int = 64, spread: float = 0.3,
                   seed: int = 0) -> torch.Tensor:
    """Unit keys (1, H, T, hs) around ``clusters`` random centres, each position in a random
    one: cosines ~0.9 within a cluster, so that epanechnikov_fixed's support
    (cos > 1 - 1 / beta = 0.865 at beta e^2) holds about T / clusters entries per row."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(1, H, clusters, hs, generator=g), dim=-1)
    which = torch.randint(0, clusters, (1, H, T), generator=g)
    noise = torch.randn(1, H, T, hs, generator=g) * (spread / math.sqrt(hs))
    picked = torch.gather(centres, 2, which.unsqueeze(-1).expand(-1, -1, -1, hs))
    return torch.nn.functional.normalize(picked + noise, dim=-1)


class SdpaBaseline(torch.nn.Module):
    """The Gaussian kernel's retrieval as one ``scaled_dot_product_attention`` call on one
    forced backend (``flash`` or ``cudnn``): queries k_1.. times beta against keys k_0..,
    causal (the strict past), scale 1."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.backend = backend

    def forward(self, keys: torch.Tensor, values: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        choice = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
        q = keys[:, :, 1:] * beta.view(1, -1, 1, 1).to(keys.dtype)
        with sdpa_kernel([choice[self.backend]]):
            return torch.nn.functional.scaled_dot_product_attention(
                q, keys[:, :, :-1], values[:, :, :-1], is_causal=True, scale=1.0)


class FeatureOp(torch.nn.Module):
    """FSKA's fused op alone: :func:`mosaics.ops.causal_linear_attention` on fixed random
    features (B, H, T, ``features``) in the keys' dtype (no frequencies, no feature map)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = features
        self.feats: torch.Tensor | None = None
        self.path = "?"

    def forward(self, keys: torch.Tensor, values: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
        from mosaics.ops import causal_linear_attention
        from mosaics.ops.linear_attention import linear_attention_unsupported
        from mosaics.ops.triton_backend import fused_reason

        B, H, T, _ = keys.shape
        if self.feats is None or self.feats.shape[2] != T:
            g = torch.Generator().manual_seed(1)
            self.feats = torch.rand(B, H, T, self.features, generator=g).to(keys.device,
                                                                            keys.dtype)
        f = self.feats.detach().requires_grad_(keys.requires_grad)
        why = fused_reason(f, values) or linear_attention_unsupported(f, None, values)
        self.path = "fused" if why is None else f"chunked: {why}"
        return causal_linear_attention(f, None, values)


def time_kernel(kernel: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor,
                beta: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Forward + backward of one kernel on (keys, values, beta): median ms over the repeats,
    the first call's seconds apart (Triton compiles or cache loads, autotuning), and the peak
    memory above the inputs (MB, CUDA only)."""
    times = []
    base = torch.cuda.memory_allocated() if args.device.startswith("cuda") else 0
    for _ in range(args.kernel_warmup + args.kernel_repeats):
        k = keys.detach().requires_grad_()
        v = values.detach().requires_grad_()
        reset_peak(args.device)
        sync(args.device)
        t0 = time.perf_counter()
        out = kernel(k, v, beta)
        out.float().square().sum().backward()
        sync(args.device)
        times.append(time.perf_counter() - t0)
        del out, k, v
    peak = peak_mb(args.device)
    return {"ms": 1e3 * statistics.median(times[args.kernel_warmup:]),
            "first_call_s": times[0],
            "peak_mb": None if peak is None else peak - base / 2**20}


def kernel_path(name: str) -> str:
    """The path a kernel's last retrieval took: ``fused``, ``chunked: <why>``, or (kernels
    outside the fused ops) ``sdpa`` for the Gaussian kernel, ``own`` otherwise."""
    from mosaics.ops.triton_backend import PATHS

    return PATHS.pop(name, "sdpa" if name == "gaussian" else "own")


def adasplash_row(kernel: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor,
                  beta: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """For an alpha-entmax kernel where the ``adasplash`` package serves the call: its time
    (``MOSAICS_ADASPLASH=1`` puts it first) and the largest output difference to the
    project's path; else why it does not apply."""
    from mosaics.kernels import adasplash_backend

    reason = adasplash_backend.skip_reason(kernel, keys, values)
    if reason:
        return {"adasplash": reason}
    with torch.no_grad():
        ours = kernel(keys, values, beta).float()
    old = os.environ.get(adasplash_backend.ENV_SWITCH)
    os.environ[adasplash_backend.ENV_SWITCH] = "1"
    try:
        timed = time_kernel(kernel, keys, values, beta, args)
        with torch.no_grad():
            diff = (kernel(keys, values, beta).float() - ours).abs().max().item()
    finally:
        if old is None:
            os.environ.pop(adasplash_backend.ENV_SWITCH)
        else:
            os.environ[adasplash_backend.ENV_SWITCH] = old
    return {"adasplash_ms": timed["ms"], "adasplash_first_call_s": timed["first_call_s"],
            "adasplash_max_abs_diff": diff}


def kernel_plan(args: argparse.Namespace, dname: str) -> list[tuple[str, str | None]]:
    """(kernel, variant) rows of one length and dtype, the Gaussian baselines first: the
    kernel (SDPA's own backend choice) and, on CUDA in bf16, flash and cuDNN forced; FSKA in
    eval mode, then ``train`` (the flow's sampling included) and ``op`` (its fused op)."""
    from mosaics import available_kernels

    wanted = getattr(args, "kernels", None) or available_kernels()
    plan: list[tuple[str, str | None]] = [("gaussian", None)]
    if args.device.startswith("cuda") and dname != "fp32":
        plan += [("gaussian", "sdpa-flash"), ("gaussian", "sdpa-cudnn")]
    for name in [k for k in available_kernels() if k != "gaussian" and k in wanted]:
        plan.append((name, None))
        if name == "fska":
            plan += [("fska", "train"), ("fska", "op")]
    return plan


def build_kernel(name: str, variant: str | None, H: int, hs: int,
                 device: str) -> torch.nn.Module:
    from mosaics import get_kernel

    if variant is not None and variant.startswith("sdpa-"):
        return SdpaBaseline(variant.removeprefix("sdpa-"))
    if variant == "op":
        return FeatureOp(2 * get_kernel("fska").num_features)
    kernel = get_kernel(name)
    kernel.build(H, hs)
    kernel = kernel.to(device)
    return kernel.train(variant == "train") if name == "fska" else kernel


def kernel_speed(args: argparse.Namespace, lengths: list[int] | None = None,
                 dtypes: list[str] | None = None, section: str = "kernels"
                 ) -> list[dict[str, Any]]:
    """Every kernel's forward + backward against ``gaussian`` (B 1, H heads of ``hs``), per
    length and dtype (lengths outermost), with the path it took, its first-call cost and its
    peak memory; rows print and go to ``rows.jsonl`` as they are measured. The alpha-entmax
    rows say why ``adasplash`` does not apply, or (unless ``args.adasplash_inline`` is
    False: the ``adasplash`` section times it) time it too."""
    from mosaics.kernels import EntmaxKernel

    H, hs = args.kernel_heads, args.kernel_head_size
    inline = getattr(args, "adasplash_inline", True)
    rows = []
    print(f"{'dtype':>5} {'T':>6} {'kernel':>24} {'fwd+bwd ms':>11} {'vs gaussian':>12} "
          f"{'peak MB':>9} {'1st call s':>10}  path", flush=True)
    for T in lengths or args.kernel_lengths:
        for dname in dtypes or args.kernel_dtypes:
            dtype = KERNEL_DTYPES[dname]
            keys, values = check_keys(T, H, hs)
            keys, values = keys.to(args.device, dtype), values.to(args.device, dtype)
            clustered = clustered_keys(T, H, hs).to(args.device, dtype)
            beta = torch.full((H,), BETA, device=args.device)
            base = None
            for name, variant in kernel_plan(args, dname):
                row: dict[str, Any] = {"dtype": dname, "T": T, "kernel": name}
                if variant:
                    row["variant"] = variant
                k_in = clustered if name == "epanechnikov_fixed" else keys
                if name == "epanechnikov_fixed":
                    row["keys"] = "clustered"
                try:
                    kernel = build_kernel(name, variant, H, hs, args.device)
                    row.update(time_kernel(kernel, k_in, values, beta, args))
                    row["path"] = (kernel.path if isinstance(kernel, FeatureOp) else
                                   variant if isinstance(kernel, SdpaBaseline) else
                                   kernel_path(name))
                    if name == "gaussian" and base is None:
                        base = row["ms"]
                    row["vs_gaussian"] = row["ms"] / base if base else None
                    if isinstance(kernel, EntmaxKernel):
                        if inline:
                            row.update(adasplash_row(kernel, keys, values, beta, args))
                        else:
                            from mosaics.kernels import adasplash_backend

                            reason = adasplash_backend.skip_reason(kernel, keys, values)
                            row["adasplash"] = reason or "timed in the adasplash section"
                except Exception as err:  # out of memory at 16k, a kernel without a path...
                    row["error"] = error_text(err, 120)
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()
                rows.append(row)
                emit(args, section, row)
                print_kernel_row(row)
    return rows


def print_kernel_row(r: dict[str, Any]) -> None:
    name = r["kernel"] + (f" ({r['variant']})" if r.get("variant") else "")
    head = f"{r['dtype']:>5} {r['T']:>6} {name:>24}"
    if "error" in r:
        print(f"{head}  {r['error']}", flush=True)
        return
    peak = f"{r['peak_mb']:.0f}" if r["peak_mb"] is not None else "-"
    ratio = f"{r['vs_gaussian']:.2f}" if r["vs_gaussian"] is not None else "-"
    extra = ""
    if "adasplash_ms" in r:
        extra = (f"; adasplash {r['adasplash_ms']:.2f} ms (first call "
                 f"{r['adasplash_first_call_s']:.1f} s), max |diff| "
                 f"{r['adasplash_max_abs_diff']:.1e}")
    print(f"{head} {r['ms']:>11.2f} {ratio:>12} {peak:>9} {r['first_call_s']:>10.2f}  "
          f"{r['path']}{extra}", flush=True)


def kernels_bf16(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The kernels in bf16 (fp32 without CUDA) at ``--bf16-lengths``, AdaSplash apart."""
    args.adasplash_inline = False
    dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    return kernel_speed(args, args.bf16_lengths, [dtype], "kernels_bf16")


def kernels_fp32(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The kernels in fp32 at ``--fp32-lengths``, AdaSplash apart."""
    args.adasplash_inline = False
    return kernel_speed(args, args.fp32_lengths, ["fp32"], "kernels_fp32")


# --- tiles: each fused op's named tile sets timed against each other ----------------------

TILE_KERNELS = {"power": ("epanechnikov", None), "knn": ("gaussian_knn", None),
                "linear": ("fska", "op")}


def tiles(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Forward + backward of one kernel per fused op (``TILE_KERNELS``) under each of the op's
    named tile sets (:data:`mosaics.ops.triton_backend.TILES`) at the first bf16 length, then
    one ``winner`` row per op: the tiles to pin (``MOSAICS_TILES=op=name``) on this GPU."""
    from mosaics.ops.triton_backend import TILES, use_tiles

    H, hs, T = args.kernel_heads, args.kernel_head_size, args.bf16_lengths[0]
    dname = "bf16" if args.device.startswith("cuda") else "fp32"
    keys, values = check_keys(T, H, hs)
    keys, values = keys.to(args.device, KERNEL_DTYPES[dname]), values.to(args.device,
                                                                          KERNEL_DTYPES[dname])
    beta = torch.full((H,), BETA, device=args.device)
    rows = []
    for op, (name, variant) in TILE_KERNELS.items():
        names = list(TILES[op])[: args.tile_limit or None]
        best: dict[str, Any] | None = None
        for tile in names:
            row: dict[str, Any] = {"op": op, "tile": tile, "kernel": name, "T": T,
                                   "dtype": dname}
            try:
                with use_tiles(op, tile):
                    kernel = build_kernel(name, variant, H, hs, args.device)
                    row.update(time_kernel(kernel, keys, values, beta, args))
                    row["path"] = (kernel.path if isinstance(kernel, FeatureOp)
                                   else kernel_path(name))
                if row["path"] == "fused" and (best is None or row["ms"] < best["ms"]):
                    best = row
            except Exception as err:  # a tile set this GPU cannot launch (shared memory...)
                row["error"] = error_text(err, 120)
            rows.append(row)
            emit(args, "tiles", row)
            print(f"tiles {op:>6} {tile:>10} {name:>13} T {T}: "
                  + (row["error"] if "error" in row else
                     f"{row['ms']:.2f} ms ({row['path']})"), flush=True)
        winner = {"op": op, "winner": best["tile"] if best else None, "T": T, "dtype": dname,
                  "ms": best["ms"] if best else None}
        rows.append(winner)
        emit(args, "tiles", winner)
    return rows


# --- warm: every Triton variant compiled once, in parallel ---------------------------------

def warm_jobs(args: argparse.Namespace) -> list[str]:
    """``kernel:dtype`` of every variant the timed sections run (FSKA's op as ``fska-op``);
    the Gaussian kernel has nothing to compile."""
    from mosaics import available_kernels

    wanted = getattr(args, "kernels", None) or available_kernels()
    names = [k for k in available_kernels() if k != "gaussian" and k in wanted]
    if "fska" in names:
        names.append("fska-op")
    jobs = [f"{n}:{d}" for d in args.warm_dtypes for n in names]
    return jobs[:args.warm_limit] if args.warm_limit else jobs


def warm_one(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant's forward + backward at ``--warm-length`` (run in a child process); FSKA
    in training mode, then in eval mode."""
    name, _, dname = spec.partition(":")
    dtype = KERNEL_DTYPES[dname]
    keys, values = check_keys(args.warm_length, 2, args.kernel_head_size)
    keys, values = keys.to(args.device, dtype), values.to(args.device, dtype)
    beta = torch.full((2,), BETA, device=args.device)
    t0 = time.perf_counter()
    variants = {"fska-op": [("fska", "op")], "fska": [("fska", "train"), ("fska", None)]}
    paths = []
    for kname, variant in variants.get(name, [(name, None)]):
        kernel = build_kernel(kname, variant, 2, args.kernel_head_size, args.device)
        k, v = keys.detach().requires_grad_(), values.detach().requires_grad_()
        kernel(k, v, beta).float().square().sum().backward()
        sync(args.device)
        paths.append(kernel.path if isinstance(kernel, FeatureOp) else kernel_path(kname))
    return {"kernel": name, "dtype": dname, "warm_s": time.perf_counter() - t0,
            "path": paths[-1]}


def warm(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every variant of :func:`warm_jobs` in its own process, ``--warm-workers`` at a time,
    all stopped at ``args.warm_timeout`` seconds: Triton's cache is on disk and shared, so
    the timed sections find every kernel compiled."""
    jobs = warm_jobs(args)
    if getattr(args, "warm_in_process", False):  # the dry run: no process start-ups
        rows = []
        for spec in jobs:
            row = warm_one(spec, args)
            rows.append(row)
            emit(args, "warm", row)
        return rows
    folder = Path(args.out) / "warm"
    folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.warm_timeout
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    rows = []
    print(f"{len(jobs)} variants, {args.warm_workers} at a time, T {args.warm_length}",
          flush=True)
    while jobs or running:
        while jobs and len(running) < args.warm_workers and time.monotonic() < deadline:
            spec = jobs.pop(0)
            name = spec.replace(":", "-")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--device", args.device,
                   "--warm-one", spec, "--warm-length", str(args.warm_length),
                   "--out", str(folder / f"{name}.json")]
            with open(folder / f"{name}.log", "w") as log:
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            running[spec] = (proc, time.monotonic())
        if jobs and time.monotonic() >= deadline:
            for spec in jobs:
                row = {"kernel": spec.split(":")[0], "dtype": spec.split(":")[1],
                       "error": "not started: the section's time is up"}
                rows.append(row)
                emit(args, "warm", row)
            jobs = []
        for spec, (proc, t0) in list(running.items()):
            kernel, _, dname = spec.partition(":")
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                row = {"kernel": kernel, "dtype": dname, "error": "stopped at the limit",
                       "warm_s": time.monotonic() - t0}
            else:
                result = folder / f"{spec.replace(':', '-')}.json"
                row = (json.loads(result.read_text()) if result.exists() else
                       {"kernel": kernel, "dtype": dname,
                        "error": f"status {proc.returncode}; see {result.with_suffix('.log')}"})
            del running[spec]
            rows.append(row)
            emit(args, "warm", row)
            print(f"{row['kernel']:>20} {row['dtype']:>5} "
                  + (f"{row['warm_s']:6.1f} s  {row['path']}" if "error" not in row
                     else row["error"]), flush=True)
        time.sleep(0.05)
    return rows


# --- adasplash: timed apart, with a short autotune ------------------------------------------

def trim_autotune(max_configs: int) -> int:
    """Cut every Triton autotuner of the imported ``adasplash`` modules to its first
    ``max_configs`` configurations and shorter benchmarks; returns how many it changed."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return 0
    changed = 0
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("adasplash") or module is None:
            continue
        for value in list(vars(module).values()):
            for _ in range(4):  # an autotuner may sit under other decorators (heuristics)
                if isinstance(value, Autotuner):
                    value.configs = value.configs[:max_configs]
                    for attr, short in (("num_warmups", 5), ("num_reps", 20)):
                        if getattr(value, attr, None) is not None:
                            setattr(value, attr, short)
                    changed += 1
                    break
                value = getattr(value, "fn", None)
    return changed


def adasplash_section(args: argparse.Namespace) -> list[dict[str, Any]]:
    """AdaSplash's kernels for the alpha-entmax kernels at ``--adasplash-lengths`` (bf16
    inputs: AdaSplash computes in fp32 here), against the project's own path."""
    from mosaics.kernels import adasplash_backend

    if adasplash_backend.disabled_reason() is None:
        with contextlib.suppress(ImportError):
            import adasplash  # noqa: F401
    trimmed = trim_autotune(args.adasplash_configs)
    print(f"autotuners cut to {args.adasplash_configs} configurations: {trimmed}", flush=True)
    H, hs = args.kernel_heads, args.kernel_head_size
    dname = "bf16" if args.device.startswith("cuda") else "fp32"
    rows = []
    for T in args.adasplash_lengths:
        keys, values = check_keys(T, H, hs)
        keys, values = (x.to(args.device, KERNEL_DTYPES[dname]) for x in (keys, values))
        beta = torch.full((H,), BETA, device=args.device)
        for name in ENTMAX_KERNELS:
            row: dict[str, Any] = {"dtype": dname, "T": T, "kernel": name,
                                   "variant": "adasplash"}
            try:
                kernel = build_kernel(name, None, H, hs, args.device)
                found = adasplash_row(kernel, keys, values, beta, args)
                if "adasplash" in found:
                    row["skipped"] = found["adasplash"]
                else:
                    row.update(ms=found["adasplash_ms"],
                               first_call_s=found["adasplash_first_call_s"],
                               max_abs_diff=found["adasplash_max_abs_diff"], path="adasplash",
                               peak_mb=None)
            except Exception as err:
                row["error"] = error_text(err)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
            rows.append(row)
            emit(args, "adasplash", row)
            print(f"{dname:>5} {T:>6} {name:>12}  " + (
                f"{row['ms']:.2f} ms, first call {row['first_call_s']:.1f} s, max |diff| "
                f"{row['max_abs_diff']:.1e}" if "ms" in row else
                row.get("skipped", row.get("error", ""))), flush=True)
    return rows


# --- golden losses ---------------------------------------------------------------------------

def golden(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per kernel with a stored curve: ``--golden-steps`` training steps of the tiny model of
    ``bench/golden_losses.py`` on this device (bf16 autocast on CUDA, the fused kernels),
    compared with the CPU float32 curve within the stored tolerance."""
    from mosaics import available_kernels
    from mosaics.ops.triton_backend import PATHS

    gl = bench_module("golden_losses")
    dname = "bf16" if args.device.startswith("cuda") else "fp32"
    wanted = getattr(args, "kernels", None) or available_kernels()
    rows = []
    for name in [k for k in available_kernels() if k in wanted]:
        row: dict[str, Any] = {"kernel": name, "dtype": dname}
        stored = gl.load_golden(name)
        try:
            if stored is None:
                raise FileNotFoundError(f"no stored curve in {gl.GOLDEN_DIR}")
            PATHS.pop(name, None)
            t0 = time.perf_counter()
            losses = gl.train_curve(name, args.device, dname, steps=args.golden_steps)
            row.update(gl.compare(losses, stored["losses"], stored["tolerance"]),
                       seconds=time.perf_counter() - t0, tolerance=stored["tolerance"],
                       path=PATHS.get(name, "sdpa" if name == "gaussian" else "own"))
        except Exception as err:
            row.update(ok=False, error=error_text(err))
        rows.append(row)
        emit(args, "golden", row)
        print(f"{name:>20} {dname}: " + (
            f"final {row['final']:.4f} vs {row['golden_final']:.4f}, max |diff| "
            f"{row['max_abs_diff']:.4f}, mean {row['mean_abs_diff']:.4f}  "
            f"{'ok' if row['ok'] else 'MISMATCH'}  ({row['seconds']:.1f} s, {row['path']})"
            if "error" not in row else row["error"]), flush=True)
    return rows


# --- 4. DeepSpeed on one GPU -----------------------------------------------------------------

def deepspeed_settings(args: argparse.Namespace) -> list[str]:
    """The run of the DeepSpeed section: the 124M recipe (``configs/babistories_124m.yaml``:
    12 layers, d 768, 12 heads, T 512, 32 windows a step, dropout 0.05) on the bundled story
    corpus with its own BPE, one optimizer step per batch, bf16, with ``--ds-full``; else a tiny
    model (2 layers, d 64: the check is the exact resume, within the section's minute)."""
    if args.quick or not args.ds_full:
        size = ["n_layer=2", "n_head=4", "n_embd=64", "block_size=64", "batch_size=4",
                "num_train_stories=400", "vocab_size=512", "eval_windows=8",
                "eval_batch_size=4"]
    else:
        size = ["--config", str(ROOT / "configs/babistories_124m.yaml"), "data_source=null",
                "tokenizer=null", f"vocab_size={args.ds_vocab}", "num_train_stories=20000",
                "global_batch_size=null", "gradient_accumulation_steps=1", "data_num_proc=8",
                "eval_windows=64", "eval_batch_size=32"]
    half = args.ds_steps // 2
    return [*size, f"max_steps={args.ds_steps}", f"warmup_steps={max(1, args.ds_steps // 10)}",
            f"eval_interval={half}", "log_interval=1", "progress_bar=false",
            "sample_tokens=0", "save_final=false", "log_with=none", "keep_checkpoints=2",
            f"compile={str(args.ds_compile).lower()}",
            "mixed_precision=bf16" if args.device.startswith("cuda") else "mixed_precision=no"]


def deepspeed_resume(args: argparse.Namespace) -> dict[str, Any]:
    """``train.py`` under DeepSpeed ZeRO-2 on one process for ``--ds-steps`` steps with a
    checkpoint half way, then a second run resumed from that checkpoint: its losses must
    equal the uninterrupted run's (max |diff| < 1e-2: bf16 kernels with atomics, e.g. the
    embedding backward, may differ in the last bits)."""
    settings = deepspeed_settings(args)
    half = args.ds_steps // 2
    work = Path(tempfile.mkdtemp(prefix="gpu-check-ds-"))
    settings.append(f"data_cache_dir={work / 'cache'}")

    def launch(run_dir: Path, *extra: str) -> float:
        port = 29500 + os.getpid() % 1000
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs/accelerate/deepspeed_zero2.yaml"), "--num_processes", "1",
               "--main_process_port", str(port), str(ROOT / "train.py"), *settings,
               f"run_dir={run_dir}", *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=args.deepspeed_timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[-3:])} failed:\n{proc.stderr[-2000:]}")
        return time.perf_counter() - t0

    def losses(run_dir: Path) -> dict[int, float]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    def speed(run_dir: Path) -> dict[str, float]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "tokens_per_s" in r][len(rows) // 4:]  # past the warm-up
        keys = ("tokens_per_s", "mfu")
        return {k: statistics.median(r[k] for r in rows) for k in keys if rows and k in rows[0]}

    t0 = time.perf_counter()
    full_s = launch(work / "full", f"checkpoint_interval={half}")
    checkpoint = work / "full" / "checkpoints" / f"step_{half:07d}"
    resumed = work / "resumed" / "checkpoints"
    resumed.mkdir(parents=True)
    subprocess.run(["cp", "-r", str(checkpoint), str(resumed)], check=True)
    resumed_s = launch(work / "resumed", "resume=true", "checkpoint_interval=0")
    full, again = losses(work / "full"), losses(work / "resumed")
    diff = max(abs(full[s] - again[s]) for s in again)
    result = {"steps": args.ds_steps, "steps_compared": [min(again), max(again)],
              "max_abs_loss_diff": diff, "final_loss": full[max(full)],
              "full_run_s": full_s, "resumed_run_s": resumed_s, **speed(work / "full"),
              "seconds": time.perf_counter() - t0,
              "ok": sorted(again) == list(range(half + 1, args.ds_steps + 1)) and diff < 1e-2}
    mfu = f", MFU {100 * result['mfu']:.1f}%" if "mfu" in result else ""
    print(f"ZeRO-2 one process, {args.ds_steps} steps: resumed steps {min(again)}-{max(again)}, "
          f"max |loss diff| {diff:.2e} ({'ok' if result['ok'] else 'MISMATCH'}), final loss "
          f"{result['final_loss']:.3f}, {result.get('tokens_per_s', 0):,.0f} tokens/s{mfu}; "
          f"{full_s:.0f} s + {resumed_s:.0f} s")
    return result


# --- the final table ---------------------------------------------------------------------------

def read_rows(out: Path) -> list[dict[str, Any]]:
    """The rows of ``<out>/rows.jsonl`` (a torn last line, from a stopped section, skipped)."""
    path = out / ROWS_FILE
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return rows


def baselines(rows: list[dict[str, Any]]) -> dict[tuple[int, str], float]:
    """(T, dtype) -> the fastest Gaussian row (any SDPA backend) at that length, in bf16
    where measured, else in that dtype."""
    best: dict[tuple[int, str], float] = {}
    for r in rows:
        if r.get("kernel") == "gaussian" and "ms" in r and r.get("section", "").startswith(
                "kernels"):
            key = (r["T"], r["dtype"])
            best[key] = min(best.get(key, math.inf), r["ms"])
    return {(T, d): best.get((T, "bf16"), ms) for (T, d), ms in best.items()}


def final_table(out: Path) -> str:
    """One Markdown table of every kernel row (kernel x T x dtype, bf16 first): ms, ratio to
    the Gaussian bf16 baseline at that T, path, first-call cost, peak memory; then the
    golden-loss verdicts."""
    rows = read_rows(out)
    base = baselines(rows)
    timed = [r for r in rows if r.get("section", "").startswith("kernels")
             or r.get("section") == "adasplash"]
    order = {"bf16": 0, "fp32": 1}
    timed.sort(key=lambda r: (order.get(r["dtype"], 2), r["T"]))
    lines = ["| kernel | T | dtype | fwd+bwd ms | vs gaussian (bf16) | path | first call s | "
             "peak MB |", "|---|---|---|---|---|---|---|---|"]
    for r in timed:
        name = r["kernel"] + (f" ({r['variant']})" if r.get("variant") else "")
        name += f" ({r['keys']} keys)" if r.get("keys") else ""
        if "ms" not in r:
            why = r.get("error") or r.get("skipped") or "?"
            lines.append(f"| {name} | {r['T']} | {r['dtype']} | - | - | {why} | - | - |")
            continue
        ref = base.get((r["T"], r["dtype"]))
        ratio = f"{r['ms'] / ref:.2f}" if ref else "-"
        peak = f"{r['peak_mb']:.0f}" if r.get("peak_mb") is not None else "-"
        path = r.get("path", "?") + (f" (max diff {r['max_abs_diff']:.1e})"
                                     if "max_abs_diff" in r else "")
        lines.append(f"| {name} | {r['T']} | {r['dtype']} | {r['ms']:.2f} | {ratio} | {path} | "
                     f"{r['first_call_s']:.2f} | {peak} |")
    tiled = [r for r in rows if r.get("section") == "tiles" and "tile" in r]
    if tiled:
        wins = {r["op"]: r.get("winner") for r in rows
                if r.get("section") == "tiles" and "winner" in r}
        lines += ["", "| op | tiles | kernel | T | dtype | fwd+bwd ms | path |",
                  "|---|---|---|---|---|---|---|"]
        for r in tiled:
            mark = " (fastest)" if wins.get(r["op"]) == r["tile"] else ""
            ms = f"{r['ms']:.2f}" if "ms" in r else "-"
            lines.append(f"| {r['op']} | {r['tile']}{mark} | {r['kernel']} | {r['T']} | "
                         f"{r['dtype']} | {ms} | {r.get('path') or r.get('error', '?')} |")
    gold = [r for r in rows if r.get("section") == "golden"]
    if gold:
        lines += ["", "| golden loss | dtype | final (CPU fp32) | max / mean abs diff | verdict |",
                  "|---|---|---|---|---|"]
        for r in gold:
            if "error" in r:
                lines.append(f"| {r['kernel']} | {r['dtype']} | - | - | {r['error']} |")
                continue
            lines.append(f"| {r['kernel']} | {r['dtype']} | {r['final']:.4f} "
                         f"({r['golden_final']:.4f}) | {r['max_abs_diff']:.4f} / "
                         f"{r['mean_abs_diff']:.4f} | {'ok' if r['ok'] else 'MISMATCH'} |")
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    return text


# --- driver ------------------------------------------------------------------------------------

SECTIONS = {"tests": run_tests, "warm": warm, "kernels_bf16": kernels_bf16,
            "adasplash": adasplash_section, "golden": golden, "tiles": tiles,
            "kernels_fp32": kernels_fp32,
            "throughput": throughput, "deepspeed": deepspeed_resume, "kernels": kernel_speed}
DEFAULT_SECTIONS = ["tests", "warm", "kernels_bf16", "adasplash", "golden", "tiles",
                    "kernels_fp32", "throughput", "deepspeed"]
DRY_RUN_SECTIONS = ["warm", "kernels_bf16", "adasplash", "golden", "tiles", "kernels_fp32"]
# seconds each section may take on a GPU (600 in all); a section past its limit is stopped
# and recorded with what it left behind, and the next one starts
BUDGETS = {"tests": 150, "warm": 50, "kernels_bf16": 120, "adasplash": 60, "golden": 50,
           "tiles": 40, "kernels_fp32": 40, "throughput": 40, "deepspeed": 50, "kernels": 160}
TOTAL_BUDGET = 600
QUICK_BUDGET = 600


def parse_budgets(items: list[str] | None, quick: bool) -> dict[str, float]:
    budgets = {k: float(QUICK_BUDGET if quick else v) for k, v in BUDGETS.items()}
    for item in items or []:
        name, _, value = item.partition("=")
        if name not in SECTIONS or not value:
            raise SystemExit(f"--budget {item!r}: write SECTION=SECONDS, SECTION one of "
                             f"{', '.join(SECTIONS)}")
        budgets[name] = float(value)
    return budgets


def partial_result(name: str, out: Path) -> Any:
    """What a section stopped at its limit left behind (its rows so far, the tests' last log
    lines), or None."""
    if name == "tests" and (out / "cuda_tests.log").exists():
        return (out / "cuda_tests.log").read_text(errors="replace").splitlines()[-5:]
    rows = [r for r in read_rows(out) if r.get("section") == name]
    if rows:
        return rows
    if name == "throughput" and (out / "throughput_rows.json").exists():
        return json.loads((out / "throughput_rows.json").read_text())
    return None


def start_isolated(name: str, argv: list[str], limit: float, out: Path) -> subprocess.Popen:
    """Start section ``name`` in a child process (this script with ``--only``) in its own
    process group, told its limit."""
    (out / "sections" / f"{name}.json").unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--only", name,
           "--section-limit", f"{limit:.0f}"]
    return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)


def wait_isolated(name: str, proc: subprocess.Popen, budget: float, out: Path) -> Any:
    """The section's result, or, past ``budget`` seconds, its process group stopped and what
    it left behind: a hang or a crash costs that section only."""
    try:
        proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"{name}: stopped at its limit of {budget:.0f} s", flush=True)
        return {"timed_out": True, "limit_s": budget, "partial": partial_result(name, out)}
    result_file = out / "sections" / f"{name}.json"
    if not result_file.exists():
        return {"error": f"the section's process ended with status {proc.returncode} and no "
                         "result"}
    return json.loads(result_file.read_text())["result"]


def run_isolated(name: str, argv: list[str], budget: float, out: Path) -> Any:
    """Section ``name`` in a child process, stopped with its process group after ``budget``
    seconds."""
    return wait_isolated(name, start_isolated(name, argv, budget, out), budget, out)


def section_failed(name: str, result: Any) -> bool:
    """An error, a stop at the limit, failing CUDA tests, a golden curve off its tolerance, or
    a resume that differs."""
    if isinstance(result, dict) and ("error" in result or result.get("timed_out")):
        return True
    if name == "tests":
        return result.get("returncode", 0) not in (0, 5)  # 5: no test collected
    if name == "golden":
        return not all(r.get("ok") for r in result)
    return name == "deepspeed" and not result.get("ok", False)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    p.add_argument("--dry-run", action="store_true", help="the kernel sections, warm-up and "
                   "golden losses at tiny sizes on CPU, in this process: checks the script")
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), help="default: "
                   + " ".join(DEFAULT_SECTIONS))
    p.add_argument("--out", default="runs/gpu_check")
    p.add_argument("--kernels", nargs="+", help="kernel sections, warm-up and golden "
                   "losses: only these kernels (the Gaussian baseline always runs)")
    p.add_argument("--lengths", type=int, nargs="+", help="throughput: sequence lengths "
                   "(default 512 2048 8192)")
    p.add_argument("--modes", nargs="+", choices=["eager", "compiled"],
                   default=["eager", "compiled"], help="throughput: eager and/or both models "
                   "torch.compile'd")
    p.add_argument("--compile-backend", help="throughput: torch.compile backend (default "
                   "inductor; eager, dynamo alone, with --quick)")
    p.add_argument("--kernel-dtypes", nargs="+", choices=list(KERNEL_DTYPES),
                   help="kernels: input dtypes (default fp32 bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--kernel-lengths", type=int, nargs="+", help="kernels: sequence lengths "
                   "(default 1024 4096 16384)")
    p.add_argument("--bf16-lengths", type=int, nargs="+", help="kernels_bf16 (default 4096 "
                   "16384)")
    p.add_argument("--fp32-lengths", type=int, nargs="+", help="kernels_fp32 (default 1024 "
                   "4096)")
    p.add_argument("--adasplash-lengths", type=int, nargs="+", help="adasplash (default 4096 "
                   "16384)")
    p.add_argument("--adasplash-configs", type=int, default=2, help="adasplash: configurations "
                   "left to each autotuner")
    p.add_argument("--warm-workers", type=int, help="warm: processes at a time (default: "
                   "CPU count, at most 8)")
    p.add_argument("--warm-length", type=int, default=256, help="warm: T of each compile")
    p.add_argument("--golden-steps", type=int, help="golden: steps (default 50)")
    p.add_argument("--ds-steps", type=int, help="deepspeed: steps of the uninterrupted run, "
                   "checkpointed half way (default 12)")
    p.add_argument("--ds-compile", action="store_true", help="deepspeed: compile=true")
    p.add_argument("--ds-full", action="store_true", help="deepspeed: the 124M recipe (give "
                   "the section several minutes: --budget deepspeed=300)")
    p.add_argument("--budget", nargs="+", metavar="SECTION=SECONDS",
                   help=f"time limits of the sections (default {BUDGETS})")
    p.add_argument("--total-budget", type=float, help=f"seconds for the whole run (default "
                   f"{TOTAL_BUDGET}; each section's limit is capped by what is left)")
    p.add_argument("--in-process", action="store_true", help="run the sections in this process, "
                   "without time limits (debugging)")
    p.add_argument("--only", choices=list(SECTIONS), help=argparse.SUPPRESS)  # a section's child
    p.add_argument("--section-limit", type=float, help=argparse.SUPPRESS)
    p.add_argument("--warm-one", help=argparse.SUPPRESS)  # a warm-up child: kernel:dtype
    args = p.parse_args(argv)
    if args.dry_run:
        args.quick, args.in_process = True, True
        args.device = "cpu"
    cuda = args.device.startswith("cuda")
    big = not args.quick
    args.sections = args.sections or (DRY_RUN_SECTIONS if args.dry_run else DEFAULT_SECTIONS)
    args.precision = "bf16" if cuda else "fp32"
    args.n_layer, args.n_embd, args.n_head = (12, 768, 12) if big else (2, 64, 2)
    args.vocab = 50304 if big else 512
    args.lengths = args.lengths or ([512, 2048, 8192] if big else [64])
    args.compile_backend = args.compile_backend or ("inductor" if big else "eager")
    args.tokens_per_step = 16384 if big else 256
    args.steps, args.warmup = (10, 3) if big else (2, 1)
    args.kernel_lengths = args.kernel_lengths or ([1024, 4096, 16384] if big else [64, 128])
    args.kernel_dtypes = args.kernel_dtypes or (["fp32", "bf16"] if cuda else ["fp32"])
    args.bf16_lengths = args.bf16_lengths or ([4096, 16384] if big else [64])
    args.fp32_lengths = args.fp32_lengths or ([1024, 4096] if big else [64])
    args.adasplash_lengths = args.adasplash_lengths or ([4096, 16384] if big else [64])
    args.kernel_heads, args.kernel_head_size = (12, 64) if big else (2, 16)
    args.kernel_repeats, args.kernel_warmup = (3, 1) if big else (1, 1)
    args.warm_dtypes = ["bf16", "fp32"] if cuda else ["fp32"]
    args.warm_workers = args.warm_workers or max(1, min(8, os.cpu_count() or 1))
    args.warm_limit = 2 if args.dry_run else 0
    args.tile_limit = 1 if args.dry_run else 0  # tile sets per op (0: all)
    args.warm_in_process = args.dry_run
    args.golden_steps = args.golden_steps or (2 if args.quick else 50)
    args.ds_steps = args.ds_steps or (12 if big else 8)
    args.ds_vocab = 8192
    args.budgets = parse_budgets(args.budget, args.quick)
    limit = args.section_limit or args.budgets.get(args.only or "", 0.0)
    args.tests_timeout = (args.section_limit or args.budgets["tests"]) - 10
    args.deepspeed_timeout = args.section_limit or args.budgets["deepspeed"]
    args.warm_timeout = max(5.0, (limit or args.budgets["warm"]) - 10)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    out = Path(args.out)
    from mosaics.evaluation.jobs import write_json

    if args.warm_one:  # a warm-up child: compile one variant, write its result to --out
        try:
            result = warm_one(args.warm_one, args)
        except Exception as err:
            traceback.print_exc()
            name, _, dname = args.warm_one.partition(":")
            result = {"kernel": name, "dtype": dname, "error": error_text(err)}
        write_json(out, result)
        return 0
    if args.only:  # a section's child process: run it, write its result
        t0 = time.perf_counter()
        result = SECTIONS[args.only](args)
        write_json(out / "sections" / f"{args.only}.json",
                   {"result": result, "seconds": time.perf_counter() - t0})
        return 0
    if not args.device.startswith("cuda"):
        print(f"note: no CUDA device; running on {args.device} (nothing here measures a GPU)")
    out.mkdir(parents=True, exist_ok=True)
    (out / ROWS_FILE).write_text("")  # this run's rows only
    total = args.total_budget or (TOTAL_BUDGET if not args.quick else math.inf)
    deadline = time.monotonic() + total
    report: dict[str, Any] = {"device": args.device, "quick": args.quick,
                              "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                              else None, "budgets_s": args.budgets,
                              "total_budget_s": None if math.isinf(total) else total,
                              "sections": args.sections}
    failed = []
    child = [a for a in argv if a != "--in-process"]
    early: dict[str, subprocess.Popen] = {}
    if not args.in_process and "warm" in args.sections[1:]:
        # the warm-up compiles on the CPU cores while the sections before it run (the CUDA
        # tests), then gets its own limit once they are done
        ahead = sum(args.budgets[s] for s in args.sections[:args.sections.index("warm")])
        early["warm"] = start_isolated("warm", child, min(ahead + args.budgets["warm"], total),
                                       out)
    for name in args.sections:
        left = deadline - time.monotonic()
        limit = min(args.budgets[name], left - 2)
        if left < 7 and not args.in_process:  # no time left for a process to start
            if name in early:
                os.killpg(early[name].pid, signal.SIGKILL)
                early.pop(name).wait()
            report[name] = {"skipped": f"{left:.0f} s left of the total budget"}
            print(f"\n=== {name}: skipped, {left:.0f} s left ===", flush=True)
            failed.append(name)
            write_json(out / "gpu_check.json", report)
            continue
        print(f"\n=== {name} (limit {limit:.0f} s) ===", flush=True)
        t0 = time.perf_counter()
        try:
            if args.in_process:
                report[name] = SECTIONS[name](args)
            elif name in early:  # started with the run: what is left of its limit
                report[name] = wait_isolated(name, early.pop(name), limit, out)
            else:
                report[name] = run_isolated(name, child, limit, out)
        except Exception as err:
            traceback.print_exc()
            report[name] = {"error": f"{type(err).__name__}: {err}"}
        if section_failed(name, report[name]):
            failed.append(name)
        report[f"{name}_seconds"] = time.perf_counter() - t0
        write_json(out / "gpu_check.json", report)  # after every section, atomically
    print("\n=== kernels: forward + backward, B 1, H "
          f"{args.kernel_heads}, head size {args.kernel_head_size} ===\n"
          + final_table(out), flush=True)
    print(f"report: {out / 'gpu_check.json'}, rows: {out / ROWS_FILE}, table: "
          f"{out / 'table.md'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
