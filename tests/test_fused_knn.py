"""The fused kNN retrieval (gaussian_knn, uniform_knn) against its dense float64 reference and
the kernels' chunked paths, run on CPU under Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` where there is no CUDA)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

triton = pytest.importorskip("triton")
if not (triton.knobs.runtime.interpret or torch.cuda.is_available()):
    pytest.skip("Triton imported without its interpreter (TRITON_INTERPRET=1)",
                allow_module_level=True)

from mosaics.kernels import get_kernel  # noqa: E402
from mosaics.ops import knn_attention, knn_attention_reference  # noqa: E402
from mosaics.ops import triton_backend as tb  # noqa: E402

knn_ops = importlib.import_module("mosaics.ops.knn_attention")  # the module, not the function


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def inputs(n: int, S: int, hs: int = 16, hv: int = 16, B: int = 1, H: int = 2, seed: int = 0):
    """float64 unit queries and keys around a shared direction, values."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(1, 1, 1, hs, generator=g, dtype=torch.float64)
    q = unit(torch.randn(B, H, n, hs, generator=g, dtype=torch.float64) + common)
    k = unit(torch.randn(B, H, S, hs, generator=g, dtype=torch.float64) + common)
    v = torch.randn(B, H, S, hv, generator=g, dtype=torch.float64)
    return q, k, v


def dyadic(n: int, S: int, distinct: int, hs: int = 16, H: int = 2, seed: int = 0):
    """Queries and keys with entries in 2^-7 Z (|x| < 1), so every score is exact in float32;
    the keys repeat ``distinct`` rows, so rows have exact ties, also at the k-th score."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-60, 61, (1, H, n, hs), generator=g).double() / 128
    base = torch.randint(-60, 61, (1, H, distinct, hs), generator=g).double() / 128
    k = base[:, :, torch.randint(0, distinct, (S,), generator=g)]
    v = torch.randn(1, H, S, hs, generator=g, dtype=torch.float64)
    return q, k, v


def compare(q, k, v, beta, offset: int, k_top: int, uniform: bool, dtype=torch.float32,
            lo=None, hi=None, out_tol: float = 1e-5, grad_tol: float = 1e-4) -> None:
    """Fused output and gradients (inputs rounded to ``dtype``) against the float64 reference
    on the same rounded inputs; tolerances relative to each reference's largest entry."""
    rounded = [x.to(dtype).double() for x in (q, k, v)]
    fused_in = [x.to(dtype).requires_grad_() for x in (q, k, v)] + [
        beta.float().requires_grad_()]
    ref_in = [x.clone().requires_grad_() for x in rounded] + [beta.double().requires_grad_()]
    y = knn_attention(*fused_in, offset, k_top, uniform, lo, hi)
    ref = knn_attention_reference(*ref_in, offset, k_top, uniform, lo, hi)
    assert y.dtype == dtype and y.shape == ref.shape
    scale = ref.abs().max().clamp_min(1e-30)
    assert (y.double() - ref).abs().max() <= out_tol * scale
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(y, fused_in, g.to(dtype))
    refs = torch.autograd.grad(ref, ref_in, g, allow_unused=True)
    for name, got, want in zip(("q", "k", "v", "beta"), grads, refs):
        assert torch.isfinite(got).all(), name
        if want is None:  # uniform weights: no gradient to q, k, beta
            assert not got.any(), name
            continue
        err = (got.double() - want).abs().max()
        assert err <= grad_tol * want.abs().max().clamp_min(1e-12), (name, float(err))


@pytest.mark.parametrize("T,k_top,offset", [(130, 16, -1), (70, 100, 0), (90, 5, -1)])
def test_gaussian_matches_float64_reference(T: int, k_top: int, offset: int) -> None:
    # T 130: three key blocks, the first rows see fewer than k entries; k 100 > T: all entries
    q, k, v = inputs(T, T, seed=T)
    compare(q, k, v, torch.tensor([2.0, math.exp(3)]), offset, k_top, uniform=False)


@pytest.mark.parametrize("uniform", [False, True])
def test_prompt_after_a_memory(uniform: bool) -> None:
    # 20 new queries after 30 stored entries (offset 30: query i sees j <= i + 30 of 50)
    q, k, _ = inputs(20, 50, seed=9)
    v = inputs(50, 50, seed=10)[2]
    compare(q, k, v, torch.tensor([3.0, 9.0]), 30, 7, uniform)


def test_uniform_matches_float64_reference() -> None:
    q, k, v = inputs(130, 130, seed=3)
    compare(q, k, v, torch.tensor([1.0, 5.0]), -1, 8, uniform=True)


@pytest.mark.parametrize("uniform", [False, True])
def test_exact_ties_go_to_the_lowest_columns(uniform: bool) -> None:
    # exact float32 scores from repeated keys: ties everywhere, also across the k-th score;
    # the reference sorts stably, so both take the lowest tied columns; beta e^10
    q, k, v = dyadic(100, 100, distinct=6)
    compare(q, k, v, torch.tensor([math.exp(10), 30.0]), -1, 7, uniform, grad_tol=1e-3)


def test_ties_across_small_blocks_and_library_sort(monkeypatch) -> None:
    # 16-column tiles: ties and top-k merges across several key blocks; the second call runs
    # Triton's own tl.topk / tl.bitonic_merge (the compiled path's network) interpreted
    monkeypatch.setattr(knn_ops, "_INTERPRETED_BLOCK", 16)
    q, k, v = dyadic(45, 45, distinct=5, seed=2)
    compare(q, k, v, torch.tensor([20.0, 3.0]), -1, 6, uniform=False)
    monkeypatch.setattr(knn_ops, "LIBRARY_SORT_ON_CPU", True)
    q, k, v = dyadic(33, 33, distinct=4, seed=4)
    compare(q, k, v, torch.tensor([20.0, 3.0]), 0, 3, uniform=False)


@pytest.mark.parametrize("inserts", [0, 64])
def test_top_k_by_the_network_or_by_insertion(inserts: int, monkeypatch) -> None:
    # 0: every key block that enters some row's top k runs the bitonic network; 64: every such
    # block is inserted value by value (16-column tiles, exact ties across blocks included)
    monkeypatch.setattr(knn_ops, "MERGE_INSERTS", inserts)
    monkeypatch.setattr(knn_ops, "_INTERPRETED_BLOCK", 16)
    q, k, v = dyadic(45, 45, distinct=5, seed=2)
    compare(q, k, v, torch.tensor([20.0, 3.0]), -1, 6, uniform=False)
    q, k, v = inputs(70, 70, seed=11)
    compare(q, k, v, torch.tensor([2.0, 9.0]), -1, 16, uniform=True)


def test_key_blocks_that_enter_no_top_k() -> None:
    # past key 40 every score is ~1e-3 of the first ones: no later block enters a top 5 of a
    # row that has seen the first 40 keys, and those blocks skip the merge
    q, k, v = inputs(150, 150, seed=12)
    k[:, :, 40:] *= 1e-3
    compare(q, k, v, torch.tensor([3.0, 7.0]), -1, 5, uniform=False)


@pytest.mark.parametrize("keys", ["random", "ties"])
def test_work_model_counts_the_kernels_merges_and_insertions(keys: str, monkeypatch) -> None:
    # bench/work_model.py's replica of pass 1 against the kernel's own calls of the bitonic
    # top-k and of the insertion (and its steps), 64-column tiles, query i sees keys j <= i
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_work_model_knn", Path(__file__).resolve().parents[1] / "bench" / "work_model.py")
    wm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wm)
    if keys == "random":
        kk = wm.check_keys(400, 1, 16)[0, 0]
        q, k, k_top = kk[1:], kk[:-1], 4
    else:  # exact dyadic scores, ties at the k-th value
        q, k, _ = dyadic(200, 200, distinct=40, seed=8)
        q, k, k_top = q[0, 0].float(), k[0, 0].float(), 3
    mod = tb.triton_module(knn_ops._KERNELS)
    counts = {"network": 0, "insert": 0, "steps": 0}
    top, insert = mod._top_ascending, mod._insert

    def counted_top(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        counts["network"] += 1
        return top(*args, **kwargs)

    def counted_insert(run, cand, steps, kcol):  # noqa: ANN001, ANN202
        counts["insert"] += 1
        counts["steps"] += int(steps.handle.data.reshape(-1)[0])
        return insert(run, cand, steps, kcol)

    monkeypatch.setattr(mod, "_top_ascending", counted_top)
    monkeypatch.setattr(mod, "_insert", counted_insert)
    n, hs = q.shape
    x = q.reshape(1, 1, n, hs)
    knn_attention(x, k.reshape(1, 1, n, hs), k.reshape(1, 1, n, hs), torch.tensor([3.0]), 0,
                  k_top)
    want = wm.knn_head(q, k, k_top, 64, 64)
    assert counts == {"network": want["merges"], "insert": want["inserts"],
                      "steps": want["insert_steps"]}
    assert counts["network"] > 0 and counts["insert"] > 0


def test_empty_rows_offsets_and_bfloat16() -> None:
    # offset -3: rows 0..2 see nothing -> output 0, gradients finite; bf16 inputs, fp32 sums
    q, k, v = inputs(70, 70, seed=5)
    y = knn_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.tensor([3.0, 8.0]), -3, 9)
    assert y.dtype == torch.bfloat16 and not y[:, :, :3].any() and y[:, :, 3:].abs().sum() > 0
    compare(q, k, v, torch.tensor([3.0, 8.0]), -3, 9, uniform=False, dtype=torch.bfloat16,
            out_tol=1e-2, grad_tol=3e-2)


def test_intervals_odd_head_sizes_and_batch_bounds() -> None:
    # per-row intervals (one per batch row, some empty, some past the memory), hs 24, hv 20
    n, S = 50, 61
    q, k, v = inputs(n, S, hs=24, hv=20, B=2, seed=6)
    g = torch.Generator().manual_seed(7)
    lo = torch.randint(-5, S, (2, n), generator=g)
    hi = lo + torch.randint(-3, 30, (2, n), generator=g)
    compare(q, k, v, torch.tensor([4.0, 12.0]), 0, 6, uniform=False, lo=lo, hi=hi)


@pytest.mark.parametrize("name", ["gaussian_knn", "uniform_knn"])
def test_registry_takes_fused_path_equal_to_chunked(name: str, monkeypatch) -> None:
    kernel = get_kernel(name, k=5)
    keys, _, values = inputs(67, 67, seed=8)
    keys, values = keys.float(), values.float()
    beta = torch.tensor([6.0, 15.0])
    lo = torch.arange(67).view(1, -1) - 20  # a window of 20 past entries
    hi = torch.arange(67).view(1, -1) - 1
    outs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("MOSAICS_FUSED", switch)
        xs = [x.clone().requires_grad_() for x in (keys, values, beta)]
        y = kernel(*xs)
        assert tb.PATHS[name] == ("fused" if switch == "1" else "chunked: MOSAICS_FUSED=0")
        ya = kernel.attend(xs[0], xs[0], xs[1], xs[2], lo, hi)
        assert tb.PATHS[name] == ("fused" if switch == "1" else "chunked: MOSAICS_FUSED=0")
        grads = torch.autograd.grad((y * y).sum() + (ya * ya).sum(), xs)
        outs[switch] = (y, ya, *grads)
    for got, want in zip(outs["1"], outs["0"]):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_bad_input_names_the_fix() -> None:
    q, k, v = (x.float() for x in inputs(8, 8))
    with pytest.raises(ValueError, match="k_top must be an integer >= 1"):
        knn_attention(q, k, v, torch.ones(2), -1, 0)
    with pytest.raises(ValueError, match=r"beta must have shape \(H,\)"):
        knn_attention(q, k, v, torch.ones(3), -1, 4)
    with pytest.raises(ValueError, match="knn_attention_reference"):
        knn_attention(q.double(), k.double(), v.double(), torch.ones(2), -1, 4)
    with pytest.raises(ValueError, match="both lo and hi"):
        knn_attention(q, k, v, torch.ones(2), -1, 4, lo=torch.zeros(1, 8, dtype=torch.long))


_COMPILE_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from triton.runtime.jit import JITFunction
from test_fused_compile import compile_launch
from mosaics.ops.knn_attention import knn_attention

calls = []
JITFunction.run = lambda self, *args, grid, warmup, **kw: calls.append((self, args, kw))
out = []
for dtype, k_top, uniform, bounds, products, names in json.loads(sys.argv[2]):
    calls.clear()
    B, H, n, hs = 1, 2, 128, 64
    q, k, v = (torch.randn(B, H, n, hs, dtype=getattr(torch, dtype), requires_grad=True)
               for _ in range(3))
    beta = torch.ones(H, requires_grad=True)
    lo = torch.zeros(B, n, dtype=torch.long) if bounds else None
    hi = torch.arange(n).view(1, n) - 1 if bounds else None
    knn_attention(q, k, v, beta, -1, k_top, uniform, lo, hi).sum().backward()
    cuda = {"LIBRARY_SORT": True, "PRODUCTS": products,
            "PRECISION": "ieee" if dtype == "float32" else "native"}
    for fn, args, kw in calls:
        if fn.__name__ in names:
            kw = kw | {key: value for key, value in cuda.items() if key in kw}
            r = compile_launch(fn, args, kw | {"num_warps": 4}, 90)
            out.append([fn.__name__, r["ok"], r["shared"], r["hinted"], r["unpipelined"]])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    """The compiled path (tl.topk / tl.bitonic_merge, native bf16 products) builds down to
    cubin for sm_90 within the shared memory of an H100, every loop over tiles with its loads
    prefetched (software-pipelined), in a child process without the
    interpreter (Triton decides at import whether its library is interpreted): each kernel
    from a recorded launch of the op at head size 64, with its CUDA settings and Triton's own
    specialization (divisibility hints; tests/test_fused_compile.py)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    cases = [  # dtype, k, uniform, intervals, products, kernels compiled
        ("float32", 16, False, False, "tf32", ["_knn_fwd", "_knn_bwd_dq"]),
        ("bfloat16", 4, True, True, "native", ["_knn_fwd", "_knn_bwd_dkdv"]),
        ("bfloat16", 16, False, False, "native", ["_knn_bwd_dkdv"]),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", _COMPILE_CHILD, str(Path(__file__).parent),
                           json.dumps(cases)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(compiled) == 5, compiled
    for name, has_entry, shared, hinted, serial in compiled:
        assert has_entry and shared <= 232448 and hinted > 0, (name, shared, hinted)
        assert not serial, (name, serial)  # every tile loop prefetches its loads
