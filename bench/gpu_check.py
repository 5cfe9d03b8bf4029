"""One command to check a GPU machine: CUDA tests, throughput, kernel speed, DeepSpeed, memory.

    python bench/gpu_check.py                          # on a CUDA machine, under 10 minutes
    python bench/gpu_check.py --device cpu --quick     # smoke run of every section on CPU

Each section runs in its own process with a time limit (``BUDGETS``, 600 s in all; change
them with ``--budget throughput=300``): a section past its limit is stopped with its process
group, recorded with what it left (``timed_out``, the rows so far) and the next one starts.

1. ``tests``: ``pytest -m cuda`` (kernels on CUDA against the CPU reference, bf16 training
   steps, cached generation, the compiled step, the chunked loss under autocast, DeepSpeed on
   one GPU), one line per test in ``<out>/cuda_tests.log``.
2. ``throughput``: training tokens/s of Memory Mosaics against a GPT-2 of the same size with
   SDPA at the 124M shape (12 layers, d 768, 12 heads, vocabulary 50304), bf16 autocast, 16384
   tokens a step, T 512, 2048 and 8192, both models eager and both ``torch.compile``d (like
   against like), with MFU (model FLOPs per token of :mod:`mosaics.training.flops` against the
   device's peak), peak memory and the first step's time (the compile); the two models
   alternate step by step. Rows go to ``<out>/throughput_rows.json`` as they are measured.
3. ``kernels``: contextual-memory forward + backward time of every kernel against ``gaussian``
   at T 1k, 4k, 16k (B 1, H 12, head size 64), fp32 and bf16, with the peak memory above the
   inputs, the first call's cost apart (Triton compiles) and the path each kernel took
   (``fused``, or ``chunked: <why>``; ``MOSAICS_FUSED=1 ... --device cpu --quick`` runs the
   fused kernels under Triton's interpreter). Where the ``adasplash`` package serves an
   alpha-entmax kernel, its time and its largest difference to the project's path too.
4. ``deepspeed``: ``train.py`` with the 124M recipe on the bundled story corpus under
   DeepSpeed ZeRO-2 bf16 on one GPU for 200 steps with a checkpoint at step 100, then resumed
   from it; the resumed losses must equal the uninterrupted ones. Tokens/s and MFU from the
   run's metrics.jsonl.

Writes ``<out>/gpu_check.json`` (after every section) and prints a table per section.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
            pair = [{"T": T, "mode": mode, "error": f"{type(err).__name__}: "
                     f"{str(err).splitlines()[0][:200] if str(err) else ''}"}]
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        rows.extend(pair)
        for r in pair:
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

def time_kernel(kernel: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor,
                beta: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Forward + backward of one kernel on (keys, values, beta): median ms over the repeats,
    the first call's seconds apart (Triton compiles, autotuning, caches), and the peak memory
    above the inputs (MB, CUDA only)."""
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


KERNEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def kernel_speed(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every registered kernel's forward + backward against ``gaussian`` (B 1, H heads of
    ``hs``), per dtype and length, with the path it took, its first-call cost and its peak
    memory; rows print as they are measured, so a run stopped at its limit keeps them."""
    from mosaics import available_kernels, get_kernel
    from mosaics.kernels import EntmaxKernel

    H, hs = args.kernel_heads, args.kernel_head_size
    rows = []
    print(f"{'dtype':>5} {'T':>6} {'kernel':>20} {'fwd+bwd ms':>11} {'vs gaussian':>12} "
          f"{'peak MB':>9} {'1st call s':>10}  path", flush=True)
    for T in args.kernel_lengths:  # every dtype of one length before the next length
        for dname in args.kernel_dtypes:
            dtype = KERNEL_DTYPES[dname]
            g = torch.Generator(device="cpu").manual_seed(0)
            keys = torch.nn.functional.normalize(torch.randn(1, H, T, hs, generator=g), dim=-1)
            values = torch.randn(1, H, T, hs, generator=g)
            keys, values = keys.to(args.device, dtype), values.to(args.device, dtype)
            beta = torch.full((H,), 7.39, device=args.device)
            base = None
            for name in ["gaussian"] + [k for k in available_kernels() if k != "gaussian"]:
                row: dict[str, Any] = {"dtype": dname, "T": T, "kernel": name}
                try:
                    kernel = get_kernel(name)
                    kernel.build(H, hs)
                    kernel.to(args.device)
                    row.update(time_kernel(kernel, keys, values, beta, args))
                    row["path"] = kernel_path(name)
                    if name == "gaussian":
                        base = row["ms"]
                    row["vs_gaussian"] = row["ms"] / base if base else None
                    if isinstance(kernel, EntmaxKernel):
                        row.update(adasplash_row(kernel, keys, values, beta, args))
                except Exception as err:  # out of memory at 16k, a kernel without a path...
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()
                rows.append(row)
                print_kernel_row(row)
    return rows


def print_kernel_row(r: dict[str, Any]) -> None:
    head = f"{r['dtype']:>5} {r['T']:>6} {r['kernel']:>20}"
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


# --- 4. DeepSpeed on one GPU -----------------------------------------------------------------

def deepspeed_settings(args: argparse.Namespace) -> list[str]:
    """The run of the DeepSpeed section: the 124M recipe (``configs/babistories_124m.yaml``:
    12 layers, d 768, 12 heads, T 512, 32 windows a step, dropout 0.05) on the bundled story
    corpus with its own BPE, one optimizer step per batch, bf16; tiny with ``--quick``."""
    if args.quick:
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


# --- driver ------------------------------------------------------------------------------------

SECTIONS = {"tests": run_tests, "throughput": throughput, "kernels": kernel_speed,
            "deepspeed": deepspeed_resume}
# seconds each section may take on a GPU (600 in all); a section past its limit is stopped
# and recorded with what it left behind, and the next one starts
BUDGETS = {"tests": 150, "throughput": 200, "kernels": 160, "deepspeed": 90}
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
    """What a section stopped at its limit left behind (throughput rows so far, the tests'
    last log lines), or None."""
    if name == "throughput" and (out / "throughput_rows.json").exists():
        return json.loads((out / "throughput_rows.json").read_text())
    if name == "tests" and (out / "cuda_tests.log").exists():
        return (out / "cuda_tests.log").read_text(errors="replace").splitlines()[-5:]
    return None


def run_isolated(name: str, argv: list[str], budget: float, out: Path) -> Any:
    """Section ``name`` in a child process (this script with ``--only``), stopped with its
    process group after ``budget`` seconds: a hang or a crash costs that section only."""
    result_file = out / "sections" / f"{name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--only", name]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"{name}: stopped at its limit of {budget:.0f} s", flush=True)
        return {"timed_out": True, "limit_s": budget, "partial": partial_result(name, out)}
    if not result_file.exists():
        return {"error": f"the section's process ended with status {proc.returncode} and no "
                         "result"}
    return json.loads(result_file.read_text())["result"]


def section_failed(name: str, result: Any) -> bool:
    """An error, a stop at the limit, failing CUDA tests or a resume that differs."""
    if isinstance(result, dict) and ("error" in result or result.get("timed_out")):
        return True
    if name == "tests":
        return result.get("returncode", 0) not in (0, 5)  # 5: no test collected
    return name == "deepspeed" and not result.get("ok", False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--out", default="runs/gpu_check")
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
    p.add_argument("--ds-steps", type=int, help="deepspeed: steps of the uninterrupted run, "
                   "checkpointed half way (default 200)")
    p.add_argument("--ds-compile", action="store_true", help="deepspeed: compile=true")
    p.add_argument("--budget", nargs="+", metavar="SECTION=SECONDS",
                   help=f"time limits of the sections (default {BUDGETS})")
    p.add_argument("--in-process", action="store_true", help="run the sections in this process, "
                   "without time limits (debugging)")
    p.add_argument("--only", choices=list(SECTIONS), help=argparse.SUPPRESS)  # a section's child
    args = p.parse_args(argv)
    big = not args.quick
    args.precision = "bf16" if args.device.startswith("cuda") else "fp32"
    args.n_layer, args.n_embd, args.n_head = (12, 768, 12) if big else (2, 64, 2)
    args.vocab = 50304 if big else 512
    args.lengths = args.lengths or ([512, 2048, 8192] if big else [64])
    args.compile_backend = args.compile_backend or ("inductor" if big else "eager")
    args.tokens_per_step = 16384 if big else 256
    args.steps, args.warmup = (10, 3) if big else (2, 1)
    args.kernel_lengths = args.kernel_lengths or ([1024, 4096, 16384] if big else [64, 128])
    args.kernel_dtypes = args.kernel_dtypes or (
        ["fp32", "bf16"] if args.device.startswith("cuda") else ["fp32"])
    args.kernel_heads, args.kernel_head_size = (12, 64) if big else (2, 16)
    args.kernel_repeats, args.kernel_warmup = (3, 1) if big else (1, 1)
    args.ds_steps = args.ds_steps or (200 if big else 8)
    args.ds_vocab = 8192
    budgets = parse_budgets(args.budget, args.quick)
    args.tests_timeout = budgets["tests"] - 10
    args.deepspeed_timeout = budgets["deepspeed"]
    out = Path(args.out)
    from mosaics.evaluation.jobs import write_json

    if args.only:  # a section's child process: run it, write its result
        t0 = time.perf_counter()
        result = SECTIONS[args.only](args)
        write_json(out / "sections" / f"{args.only}.json",
                   {"result": result, "seconds": time.perf_counter() - t0})
        return 0
    if not args.device.startswith("cuda"):
        print(f"note: no CUDA device; running on {args.device} (nothing here measures a GPU)")

    report: dict[str, Any] = {"device": args.device, "quick": args.quick,
                              "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                              else None, "budgets_s": budgets}
    failed = []
    for name in args.sections:
        print(f"\n=== {name} (limit {budgets[name]:.0f} s) ===", flush=True)
        t0 = time.perf_counter()
        try:
            if args.in_process:
                report[name] = SECTIONS[name](args)
            else:
                report[name] = run_isolated(name, argv, budgets[name], out)
        except Exception as err:
            traceback.print_exc()
            report[name] = {"error": f"{type(err).__name__}: {err}"}
        if section_failed(name, report[name]):
            failed.append(name)
        report[f"{name}_seconds"] = time.perf_counter() - t0
        write_json(out / "gpu_check.json", report)  # after every section, atomically
    print(f"\nreport: {out / 'gpu_check.json'}" + (f"; failed: {', '.join(failed)}"
                                                     if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
