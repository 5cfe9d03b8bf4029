"""bench/gpu_check.py runs end to end (tiny sizes, on CPU) and writes its report."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_bench(name: str):
    """bench/<name>.py as a module, with bench/ on the import path while it loads."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def test_gpu_check_smoke_run_on_cpu(tmp_path: Path) -> None:
    from mosaics import available_kernels

    module = load_bench("gpu_check")
    code = module.main(["--device", "cpu", "--quick", "--sections", "throughput", "kernels",
                        "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["device"] == "cpu" and report["quick"] is True
    rows = report["throughput"]
    assert {(r["model"], r["mode"]) for r in rows} == {(m, c) for m in ("mosaics", "gpt2")
                                                       for c in ("eager", "compiled")}
    assert all(r["tok_s"] > 0 and 0 < r["mfu"] < 1 and r["flops_per_token"] > 0 for r in rows)
    assert json.loads((tmp_path / "throughput_rows.json").read_text()) == rows
    kernels = [r for r in report["kernels"] if r["T"] == 64]
    assert {r["kernel"] for r in kernels} == set(available_kernels())
    assert all("error" not in r for r in kernels), [r for r in kernels if "error" in r]
    assert next(r for r in kernels if r["kernel"] == "gaussian")["vs_gaussian"] == 1.0
    power = {r["kernel"]: r for r in kernels if r["kernel"] in (
        "epanechnikov", "biweight", "triweight", "entmax", "relumax", "epanechnikov_fixed")}
    assert len(power) == 6  # each kernel says which path ran, and why not the fused one
    assert all(r["path"].startswith("chunked") and "MOSAICS_FUSED" in r["path"]
               for r in power.values()), power
    assert all("needs CUDA" in r["adasplash"] for k, r in power.items()
               if k not in ("relumax", "epanechnikov_fixed"))


def test_a_section_past_its_limit_is_stopped_and_the_next_one_runs(tmp_path: Path) -> None:
    """Each section runs in its own process under its time limit: one that overruns is
    stopped and recorded, and the sections after it still run."""
    module = load_bench("gpu_check")
    code = module.main(["--device", "cpu", "--quick", "--sections", "deepspeed", "tests",
                        "--budget", "deepspeed=2", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 1 and report["deepspeed"]["timed_out"] and report["budgets_s"]["deepspeed"] == 2
    assert report["deepspeed_seconds"] < 30
    assert report["tests"]["returncode"] in (0, 5)  # CUDA tests: skipped or deselected here


def test_kernels_section_reports_fused_paths_and_adasplash(monkeypatch) -> None:
    """With ``MOSAICS_FUSED=1`` (Triton's interpreter on CPU) the power kernels' rows say
    ``fused``; with an adasplash stand-in in place (dense alpha-entmax, on CPU) the
    alpha-entmax rows time it too and compare its outputs with the fused path's."""
    import argparse
    import math

    import torch

    pytest.importorskip("triton")
    from mosaics.kernels import adasplash_backend
    from mosaics.ops.entmax import entmax

    def dense(q, k, v, alpha):  # noqa: ANN001, ANN202
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        return entmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), alpha, mask) @ v

    monkeypatch.setenv("MOSAICS_FUSED", "1")
    module = load_bench("gpu_check")
    args = argparse.Namespace(device="cpu", kernel_lengths=[40], kernel_heads=2,
                              kernel_head_size=16, kernel_repeats=1, kernel_warmup=0,
                              kernel_dtypes=["fp32"])
    with adasplash_backend.use_backend(dense):
        rows = {r["kernel"]: r for r in module.kernel_speed(args)}
    for name in ("epanechnikov", "biweight", "triweight", "entmax"):
        row = rows[name]
        assert row["path"] == "fused" and row["adasplash_ms"] > 0, row
        assert row["adasplash_max_abs_diff"] < 1e-4
    assert rows["relumax"]["path"] == "fused" and "adasplash" not in rows["relumax"]
    assert rows["gaussian"]["path"] == "sdpa" and "error" not in rows["gaussian"]


def test_bank_bound_smoke_run() -> None:
    """bench/bank_bound.py runs at a tiny size and times every row."""
    rows = load_bench("bank_bound").main(["--T", "16", "--batch", "2", "--n-embd", "32",
                                          "--n-head", "2", "--rows", "8", "--repeats", "1",
                                          "--rounds", "1"])
    from mosaics.ops.banks import bank_extension

    expected = {"bank_attention", "fused (PyTorch)", "parts, recomputing", "parts, storing P",
                "stored P, torch ops", "GPT-2 MLP", "MLP products"}
    if bank_extension() is not None:
        expected.add("compiled, storing P")
    assert set(rows) == expected
    assert all(sec > 0 and flops > 0 for sec, flops in rows.values())
    # the recomputing scheme counts the storing one's products and the recomputed scores
    assert rows["parts, recomputing"][1] > rows["parts, storing P"][1]


def test_bank_bound_stored_scheme_matches_bank_attention() -> None:
    """The stored-probability scheme the bench times computes the same output and gradients
    as ``bank_attention`` (the training path: the compiled kernel where it builds, else the
    fused backward in blocks of slots, P > 448), with a last block of rows shorter than the
    others."""
    import torch

    from mosaics.ops import bank_attention

    module = load_bench("bank_bound")
    torch.manual_seed(0)
    H, N, P, hs = 3, 45, 600, 8
    q = torch.nn.functional.normalize(torch.randn(H, N, hs), dim=-1).requires_grad_()
    k, v = (torch.randn(H, P, hs).requires_grad_() for _ in range(2))
    g = torch.randn(H, N, hs)
    out = bank_attention(q, k, v)
    out.backward(g)
    got = module.stored_attention(q.detach(), k.detach(), v.detach(), g, rows=16)
    for mine, ref in zip(got, (out, q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)


def test_long_context_bench_measures_memory_and_cache_bytes() -> None:
    """bench/long_context.py at tiny sizes: a step time and a peak for every model, GPT-2's
    cache counted to the byte, a view counted once and step-form weights apart."""
    import argparse
    import time
    from typing import NamedTuple

    import torch

    bench = load_bench("long_context")
    args = argparse.Namespace(vocab=64, n_layer=2, n_head=2, n_embd=16, tokens=64, steps=1)
    step, memory = bench.train_length(["v1-gaussian", "gpt2"], 32, args, time.process_time)
    assert set(step) == set(memory) == {"v1-gaussian", "gpt2"}
    assert all(s > 0 for s in step.values()) and all(isinstance(m, int) for m in memory.values())

    prompt = bench.random_tokens(64, (3, 10))
    gpt2 = bench.build("gpt2", args, 32).eval()
    prefill, per_token, (state, weights) = bench.decode(gpt2, prompt, 4, time.process_time)
    assert prefill > 0 and per_token > 0 and weights == 0
    assert state == 2 * 2 * 3 * 2 * (10 + 4) * 8 * 4  # keys and values, fp32, every layer

    class Pair(NamedTuple):
        a: torch.Tensor

    x = torch.zeros(100)
    assert bench.storage_bytes({"x": x, "view": x[:10], "w": Pair(torch.zeros(5))},
                               set()) == (400, 20)
