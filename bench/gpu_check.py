"""One command to check a GPU machine: CUDA tests, throughput, kernel speed, DeepSpeed, memory.

    python bench/gpu_check.py                          # on a CUDA machine, under 8 minutes
    python bench/gpu_check.py --device cpu --quick     # smoke run of every section on CPU

Sections (each with its own time limit; a failing section is recorded and the rest go on):

1. ``tests``: ``pytest -m cuda`` (kernels on CUDA against the CPU reference, bf16 training
   steps, cached generation, the chunked loss under autocast, DeepSpeed on one GPU).
2. ``throughput``: training tokens/s of Memory Mosaics against a GPT-2 of the same size at the
   124M shape (12 layers, d 768, 12 heads, vocabulary 50304), bf16 autocast, T 512 and 2048,
   with peak memory; the two models alternate step by step.
3. ``kernels``: contextual-memory forward + backward time of every kernel against ``gaussian``
   at T 1k, 4k, 16k (B 1, H 12, head size 64), with peak memory. The alpha-entmax kernels
   also say which backend ran (``adasplash`` or ``chunked``, and why); with adasplash in use
   the chunked path is timed as well and the two outputs compared.
4. ``deepspeed``: ``train.py`` under DeepSpeed ZeRO-2 on one GPU for a few steps with a
   checkpoint, then resumed from it; the resumed losses must equal the uninterrupted ones.

Writes ``<out>/gpu_check.json`` and prints a table per section.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


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


def throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    rows = []
    for T in args.lengths:
        batch = max(1, args.tokens_per_step // T)
        torch.manual_seed(0)
        models = {k: m.to(args.device).train()
                  for k, m in build_pair(args.n_layer, args.n_embd, args.n_head, args.vocab,
                                         T).items()}
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=args.device != "cpu")
                for k, m in models.items()}
        ids = torch.randint(0, args.vocab, (batch, T), device=args.device)
        times: dict[str, list[float]] = {k: [] for k in models}
        peaks: dict[str, float | None] = {}
        for i in range(args.warmup + args.steps):
            for name, model in models.items():
                reset_peak(args.device)
                sync(args.device)
                t0 = time.perf_counter()
                with autocast(args.device, dtype):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opts[name].step()
                opts[name].zero_grad(set_to_none=True)
                sync(args.device)
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
                peaks[name] = peak_mb(args.device)
        step = {k: statistics.median(v) for k, v in times.items()}
        for name in models:
            rows.append({"T": T, "batch": batch, "model": name,
                         "params": sum(p.numel() for p in models[name].parameters()),
                         "step_ms": 1e3 * step[name], "tok_s": batch * T / step[name],
                         "peak_mb": peaks[name],
                         "ratio_vs_gpt2": step["gpt2"] / step[name]})
        del models, opts
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"{'T':>6} {'batch':>6} {'model':>8} {'params':>12} {'step ms':>9} {'tok/s':>10} "
          f"{'peak MB':>9} {'vs GPT-2':>9}")
    for r in rows:
        peak = f"{r['peak_mb']:.0f}" if r["peak_mb"] is not None else "-"
        print(f"{r['T']:>6} {r['batch']:>6} {r['model']:>8} {r['params']:>12,} "
              f"{r['step_ms']:>9.1f} {r['tok_s']:>10.0f} {peak:>9} {r['ratio_vs_gpt2']:>9.2f}")
    return rows


# --- 3. kernels ----------------------------------------------------------------------------

def time_kernel(kernel: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor,
                beta: torch.Tensor, args: argparse.Namespace) -> tuple[float, float | None]:
    """(median forward + backward ms, peak MB) of one kernel on (keys, values, beta)."""
    times = []
    for i in range(args.kernel_warmup + args.kernel_repeats):
        k = keys.detach().requires_grad_()
        v = values.detach().requires_grad_()
        reset_peak(args.device)
        sync(args.device)
        t0 = time.perf_counter()
        out = kernel(k, v, beta)
        out.float().square().sum().backward()
        sync(args.device)
        times.append(time.perf_counter() - t0)
        if i == 0 and args.device.startswith("cuda"):  # compiles and autotuning show here
            print(f"{'':>6} {kernel.name or type(kernel).__name__:>20}  first call "
                  f"{times[0]:.2f} s", flush=True)
    return 1e3 * statistics.median(times[args.kernel_warmup:]), peak_mb(args.device)


def entmax_backends(kernel: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor,
                    beta: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """For an alpha-entmax kernel: which backend its forward takes (adasplash or the chunked
    path, and why not adasplash); with adasplash in use, the chunked path's time and peak
    memory too, and the largest output difference between the two."""
    from mosaics.kernels import adasplash_backend

    reason = adasplash_backend.skip_reason(kernel, keys, values)
    row: dict[str, Any] = {"backend": "chunked" if reason else "adasplash"}
    if reason:
        row["backend_note"] = reason
        return row
    kernel.use_adasplash = False
    try:
        row["chunked_ms"], row["chunked_peak_mb"] = time_kernel(kernel, keys, values, beta, args)
        with torch.no_grad():
            chunked = kernel(keys, values, beta).float()
            kernel.use_adasplash = True
            row["max_abs_diff"] = (kernel(keys, values, beta).float() - chunked).abs().max().item()
    finally:
        kernel.use_adasplash = True
    return row


def kernel_speed(args: argparse.Namespace) -> list[dict[str, Any]]:
    from mosaics import available_kernels, get_kernel
    from mosaics.kernels import EntmaxKernel

    H, hs = args.kernel_heads, args.kernel_head_size
    rows = []
    print(f"{'T':>6} {'kernel':>20} {'fwd+bwd ms':>11} {'vs gaussian':>12} {'peak MB':>9}  backend",
          flush=True)
    for T in args.kernel_lengths:
        g = torch.Generator(device="cpu").manual_seed(0)
        keys = torch.nn.functional.normalize(torch.randn(1, H, T, hs, generator=g), dim=-1)
        values = torch.randn(1, H, T, hs, generator=g)
        keys, values = keys.to(args.device), values.to(args.device)
        beta = torch.full((H,), 7.39, device=args.device)
        base = None
        for name in ["gaussian"] + [k for k in available_kernels() if k != "gaussian"]:
            row: dict[str, Any] = {"T": T, "kernel": name}
            try:
                kernel = get_kernel(name)
                kernel.build(H, hs)
                kernel.to(args.device)
                if isinstance(kernel, EntmaxKernel):
                    row.update(entmax_backends(kernel, keys, values, beta, args))
                row["ms"], row["peak_mb"] = time_kernel(kernel, keys, values, beta, args)
                if name == "gaussian":
                    base = row["ms"]
                row["vs_gaussian"] = row["ms"] / base if base else None
                if "chunked_ms" in row:
                    row["adasplash_vs_chunked"] = row["ms"] / row["chunked_ms"]
            except Exception as err:  # out of memory at 16k, a kernel without a CUDA path...
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
            rows.append(row)
            print_kernel_row(row)  # as it is measured: a run stopped at its limit keeps them
    return rows


def print_kernel_row(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"{r['T']:>6} {r['kernel']:>20}  {r['error']}", flush=True)
        return
    peak = f"{r['peak_mb']:.0f}" if r["peak_mb"] is not None else "-"
    backend = r.get("backend", "")
    if "chunked_ms" in r:
        backend += (f" (chunked {r['chunked_ms']:.2f} ms, {r['adasplash_vs_chunked']:.2f}x;"
                    f" max |diff| {r['max_abs_diff']:.1e})")
    elif "backend_note" in r:
        backend += f" ({r['backend_note']})"
    print(f"{r['T']:>6} {r['kernel']:>20} {r['ms']:>11.2f} {r['vs_gaussian']:>12.2f} "
          f"{peak:>9}  {backend}", flush=True)


# --- 4. DeepSpeed on one GPU -----------------------------------------------------------------

def deepspeed_resume(args: argparse.Namespace) -> dict[str, Any]:
    settings = ["n_layer=2", "n_head=4", "n_embd=64", "block_size=64", "batch_size=4",
                "max_steps=12", "warmup_steps=2", "num_train_stories=400", "vocab_size=512",
                "eval_interval=6", "eval_windows=8", "eval_batch_size=4", "log_interval=1",
                "dropout=0.0", "progress_bar=false", "sample_tokens=0", "save_final=false",
                "mixed_precision=bf16" if args.device.startswith("cuda") else "mixed_precision=no"]
    work = Path(tempfile.mkdtemp(prefix="gpu-check-ds-"))
    settings.append(f"data_cache_dir={work / 'cache'}")

    def launch(run_dir: Path, *extra: str) -> None:
        port = 29500 + os.getpid() % 1000
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs/accelerate/deepspeed_zero2.yaml"), "--num_processes", "1",
               "--main_process_port", str(port), str(ROOT / "train.py"), *settings,
               f"run_dir={run_dir}", *extra]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=args.deepspeed_timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[-3:])} failed:\n{proc.stderr[-2000:]}")

    def losses(run_dir: Path) -> dict[int, float]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    t0 = time.perf_counter()
    launch(work / "full", "checkpoint_interval=6")
    checkpoint = work / "full" / "checkpoints" / "step_0000006"
    resumed = work / "resumed" / "checkpoints"
    resumed.mkdir(parents=True)
    subprocess.run(["cp", "-r", str(checkpoint), str(resumed)], check=True)
    launch(work / "resumed", "resume=true", "checkpoint_interval=0")
    full, again = losses(work / "full"), losses(work / "resumed")
    diff = max(abs(full[s] - again[s]) for s in again)
    result = {"steps_compared": sorted(again), "max_abs_loss_diff": diff,
              "seconds": time.perf_counter() - t0, "ok": diff < 1e-3}
    print(f"ZeRO-2 one process: resumed steps {min(again)}-{max(again)}, max |loss diff| "
          f"{diff:.2e} ({'ok' if result['ok'] else 'MISMATCH'}), {result['seconds']:.0f} s")
    return result


# --- driver ------------------------------------------------------------------------------------

SECTIONS = {"tests": run_tests, "throughput": throughput, "kernels": kernel_speed,
            "deepspeed": deepspeed_resume}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--out", default="runs/gpu_check")
    p.add_argument("--lengths", type=int, nargs="+", help="throughput: sequence lengths "
                   "(default 512 2048)")
    p.add_argument("--kernel-lengths", type=int, nargs="+", help="kernels: sequence lengths "
                   "(default 1024 4096 16384)")
    args = p.parse_args(argv)
    big = not args.quick
    args.precision = "bf16" if args.device.startswith("cuda") else "fp32"
    args.n_layer, args.n_embd, args.n_head = (12, 768, 12) if big else (2, 64, 2)
    args.vocab = 50304 if big else 512
    args.lengths = args.lengths or ([512, 2048] if big else [64])
    args.tokens_per_step = 16384 if big else 256
    args.steps, args.warmup = (10, 3) if big else (2, 1)
    args.kernel_lengths = args.kernel_lengths or ([1024, 4096, 16384] if big else [64, 128])
    args.kernel_heads, args.kernel_head_size = (12, 64) if big else (2, 16)
    args.kernel_repeats, args.kernel_warmup = (5, 2) if big else (1, 1)
    args.tests_timeout, args.deepspeed_timeout = 240, 300
    if not args.device.startswith("cuda"):
        print(f"note: no CUDA device; running on {args.device} (nothing here measures a GPU)")

    report: dict[str, Any] = {"device": args.device, "quick": args.quick,
                              "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                              else None}
    from mosaics.evaluation.experiments import write_json

    failed = []
    out = Path(args.out)
    for name in args.sections:
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        try:
            report[name] = SECTIONS[name](args)
        except Exception as err:
            traceback.print_exc()
            report[name] = {"error": f"{type(err).__name__}: {err}"}
            failed.append(name)
        report[f"{name}_seconds"] = time.perf_counter() - t0
        if name == "tests" and report[name].get("returncode", 0) not in (0, 5):  # None: timed out
            failed.append(name)
        write_json(out / "gpu_check.json", report)  # after every section, atomically
    print(f"\nreport: {out / 'gpu_check.json'}" + (f"; failed: {', '.join(failed)}"
                                                     if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
