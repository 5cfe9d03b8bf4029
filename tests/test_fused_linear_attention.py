"""The fused (Triton) causal linear attention, run under Triton's interpreter on CPU tensors:
values and gradients against a float64 dense reference, and FSKA's fused path against its
chunked path."""

from __future__ import annotations

import pytest
import torch

from mosaics.kernels import get_kernel
from mosaics.ops import causal_linear_attention, causal_linear_attention_reference, triton_backend
from mosaics.ops.linear_attention import linear_attention_unsupported

pytest.importorskip("triton")


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv("MOSAICS_FUSED", "1")
    reason = triton_backend.fused_reason(torch.zeros(1))
    if reason is not None:
        pytest.skip(f"no interpreted Triton here: {reason}")


def _inputs(B, H, T, F, D, dtype, shared, seed=0):
    """Non-negative features (B, H, T, F), values (B, H, T, D), rounded to ``dtype``, as
    leaves in ``dtype`` and in float64 (the same numbers)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, H, T, F, generator=g) + 0.05
    k = None if shared else torch.rand(B, H, T, F, generator=g) + 0.05
    v = torch.randn(B, H, T, D, generator=g)
    low = [None if x is None else x.to(dtype).requires_grad_() for x in (q, k, v)]
    ref = [None if x is None else x.detach().double().requires_grad_() for x in low]
    return low, ref


def _leaves(xs):
    return [x for x in xs if x is not None]


def _check(low, ref, chunk, dtype, eps=1e-20, tol=None, precision=None):
    y = causal_linear_attention(*low, eps=eps, chunk=chunk, precision=precision)
    assert y.dtype == dtype and y.shape == low[2].shape
    y_ref = causal_linear_attention_reference(*ref, eps=eps)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1),
                     dtype=torch.float64).to(y.device)
    grads = torch.autograd.grad(y, _leaves(low), dy.to(dtype))
    grads_ref = torch.autograd.grad(y_ref, _leaves(ref), dy)
    # relative to each tensor's largest entry; bf16 gradients cancel (dn . (v_s - y_t)) in
    # sums of rounded products: up to 3.4e-2 seen on the tiny case (5 rows, 3 features)
    tol = tol or {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 5e-3),
                  torch.bfloat16: (1e-2, 6e-2)}[dtype]
    for i, (got, want) in enumerate(zip((y, *grads), (y_ref, *grads_ref), strict=True)):
        assert got.dtype == dtype
        scale = want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= tol[i > 0] * scale, (i, got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("T,F,D,chunk", [(37, 20, 11, 16), (129, 70, 24, 32), (5, 3, 65, 64)])
def test_fused_matches_float64_reference(fused, dtype, shared, T, F, D, chunk):
    """Odd lengths, feature and value sizes off powers of two (70 features: two feature
    blocks; 65 values: two value blocks of the chunk states), one to nine chunks."""
    low, ref = _inputs(1, 2, T, F, D, dtype, shared)
    _check(low, ref, chunk, dtype)


def test_fused_fp16_and_mixed_dtypes(fused):
    low, ref = _inputs(1, 3, 50, 24, 16, torch.float16, False, seed=3)
    _check(low, ref, 16, torch.float16)
    # fp32 features with bf16 values promote to fp32
    q, k, v = (torch.rand(1, 1, 20, 8), torch.rand(1, 1, 20, 8), torch.randn(1, 1, 20, 4))
    y = causal_linear_attention(q, k, v.bfloat16(), chunk=16)
    ref = causal_linear_attention_reference(q.double(), k.double(), v.bfloat16().double())
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "bf16"])
def test_precision_overrides_match_float64_reference(fused, precision):
    """fp32 inputs with each ``precision``: IEEE and tf32x3 at fp32 tolerance, bf16 operands
    (fp32 accumulation and states, fp32 outputs) at bf16 tolerance."""
    low, ref = _inputs(1, 2, 37, 20, 11, torch.float32, False, seed=2)
    tol = (1e-2, 6e-2) if precision == "bf16" else None
    _check(low, ref, 16, torch.float32, tol=tol, precision=precision)


def test_bf16_products_round_the_operands(fused):
    """precision="bf16" on fp32 inputs equals the bf16 inputs' own run up to the order of
    the fp32 sums and the output's rounding (both multiply the same bf16 numbers)."""
    low, _ = _inputs(1, 1, 40, 12, 8, torch.bfloat16, False, seed=6)
    y16 = causal_linear_attention(*low, chunk=16)
    y32 = causal_linear_attention(*(x.float() for x in low), chunk=16, precision="bf16")
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32.bfloat16(), y16, atol=1e-2, rtol=1e-2)
    exact = causal_linear_attention(*(x.float() for x in low), chunk=16)
    assert (y32 - exact).abs().max() > 0  # the (C, C) block and the states were rounded


def test_row_without_memory_is_zero(fused):
    """eps = 0: row 0 has no past (0 / 0); it outputs 0 with zero, finite gradients."""
    low, ref = _inputs(1, 1, 19, 6, 5, torch.float32, True, seed=2)
    y = causal_linear_attention(*low, eps=0.0, chunk=16)
    assert torch.equal(y[:, :, 0], torch.zeros_like(y[:, :, 0]))
    y.square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in _leaves(low))
    _check(*_inputs(1, 1, 19, 6, 5, torch.float32, True, seed=2), 16, torch.float32, eps=0.0)


@pytest.mark.parametrize("T,F,D", [(0, 5, 3), (7, 0, 3), (7, 5, 0)])
def test_empty_sizes(fused, T, F, D):
    """No rows, features or value columns: nothing is launched; y = 0 (no weight), and the
    gradients have the inputs' shapes."""
    q = torch.rand(1, 2, T, F, requires_grad=True)
    v = torch.randn(1, 2, T, D, requires_grad=True)
    y = causal_linear_attention(q, None, v, chunk=16)
    assert torch.equal(y, causal_linear_attention_reference(q, None, v))
    y.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


def test_chunked_pytorch_form_without_the_switch(monkeypatch):
    """MOSAICS_FUSED=0 (and float64, which the kernels do not take): the same chunks in
    PyTorch, equal to the dense reference."""
    monkeypatch.setenv("MOSAICS_FUSED", "0")
    low, ref = _inputs(1, 2, 45, 9, 7, torch.float64, False, seed=4)
    y = causal_linear_attention(*low, chunk=16)
    torch.testing.assert_close(y, causal_linear_attention_reference(*ref))
    assert "dtypes" in linear_attention_unsupported(*low)


def test_bad_inputs_name_the_fix():
    q = torch.rand(1, 2, 8, 4)
    with pytest.raises(ValueError, match="power of two"):
        causal_linear_attention(q, None, torch.randn(1, 2, 8, 3), chunk=24)
    with pytest.raises(ValueError, match=r"values v \(B, H, T, D\)"):
        causal_linear_attention(q, None, torch.randn(1, 2, 7, 3))
    with pytest.raises(ValueError, match="precision must be None or one of"):
        causal_linear_attention(q, None, torch.randn(1, 2, 8, 3), precision="fp8")


def _fska(positive="elu1"):
    torch.manual_seed(0)
    kernel = get_kernel("fska", num_features=10, flow_layers=1, flow_hidden=8,
                        positive=positive, chunk_size=16)
    kernel.build(2, 6)
    return kernel


@pytest.mark.parametrize("training", [False, True])
def test_fska_fused_path_equals_chunked_path(fused, monkeypatch, training):
    """FSKA's strict-past retrieval (20 elu1 features, head size 6, T 45) on the fused path
    and on its segmented PyTorch path: same output and gradients (keys, values, bandwidth,
    and in training the flow through the sampled frequencies); PATHS says which ran."""
    kernel = _fska().train(training)
    g = torch.Generator().manual_seed(5)
    keys = torch.nn.functional.normalize(torch.randn(2, 2, 45, 6, generator=g), dim=-1)
    values = torch.randn(2, 2, 45, 6, generator=g)
    beta = torch.tensor([2.0, 7.0])
    params = [p for p in kernel.parameters() if p.requires_grad] if training else []
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("MOSAICS_FUSED", switch)
        k, v, b = (x.clone().requires_grad_() for x in (keys, values, beta))
        torch.manual_seed(1)  # the same frequency draw in training
        y = kernel(k, v, b)
        results[switch] = (y, *torch.autograd.grad(y.sin().sum(), (k, v, b, *params)))
        path = triton_backend.PATHS["fska"]
        assert path == "fused" if switch == "1" else path.startswith("chunked: MOSAICS_FUSED=0")
    for got, want in zip(results["1"], results["0"], strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_fska_fused_precision_follows_keys_and_autocast(fused, monkeypatch):
    """bf16 keys, or fp32 keys under a bf16 autocast, take bf16 products (fp32 accumulation
    and states) on the fused path: within bf16 tolerance of the fp32 PyTorch path; fp32 keys
    without autocast keep fp32 products."""
    from mosaics.ops.feature_attention import fused_precision

    kernel = _fska().eval()
    g = torch.Generator().manual_seed(7)
    keys = torch.nn.functional.normalize(torch.randn(1, 2, 40, 6, generator=g), dim=-1)
    values = torch.randn(1, 2, 40, 6, generator=g)
    beta = torch.tensor([2.0, 7.0])
    assert fused_precision(keys) is None and fused_precision(keys.bfloat16()) == "bf16"
    monkeypatch.setenv("MOSAICS_FUSED", "0")
    want = kernel(keys, values, beta)
    monkeypatch.setenv("MOSAICS_FUSED", "1")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fused_precision(keys) == "bf16"
        k = keys.clone().requires_grad_()
        got = kernel(k, values, beta)
    assert triton_backend.PATHS["fska"] == "fused" and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert (got - want).abs().max() > 1e-6  # bf16 operands, not fp32 ones
    (dk,) = torch.autograd.grad(got.sum(), k)
    assert torch.isfinite(dk).all()
    got = kernel(keys.bfloat16(), values.bfloat16(), beta)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def _elu1_inputs(HS, M, T=45, D=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(2, 2, T, HS, generator=g), dim=-1)
    w1, w2 = (torch.randn(2, M, HS, generator=g) * 2 for _ in range(2))
    return x, w1, w2, torch.randn(2, 2, T, D, generator=g)


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_in_kernel_elu1_map_matches_float64_reference(fused, monkeypatch, precision):
    """The ELU+1 features computed inside the chunk kernels (20 frequency pairs: two blocks;
    head size 6, T 45, chunks of 16): output and gradients to the keys, both frequency sets and
    the values against autograd through the float64 features and the dense reference; no
    (B, H, T, 2M) feature tensor is formed in PyTorch on the way."""
    from mosaics.ops import feature_attention as fa

    x, w1, w2, v = _elu1_inputs(6, 20)
    ref = [t.double().requires_grad_() for t in (x, w1, w2, v)]
    y_ref = causal_linear_attention_reference(fa.elu1_features(*ref[:3]), None, ref[3])
    dy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(1),
                     dtype=torch.float64)
    want = (y_ref, *torch.autograd.grad(y_ref, ref, dy))

    def no_features(*args):
        raise AssertionError("features formed in PyTorch")

    monkeypatch.setattr(fa, "elu1_features", no_features)
    low = [t.clone().requires_grad_() for t in (x, w1, w2, v)]
    y = fa.FusedElu1Attention.apply(low[0], low[3], low[1], low[2], 1e-20, 16, precision)
    dx, dw1, dw2, dv = torch.autograd.grad(y, low, dy.float())
    tol = (2e-5, 2e-5) if precision is None else (1e-2, 3e-2)
    for i, (got, ref_) in enumerate(zip((y, dx, dw1, dw2, dv), want, strict=True)):
        assert got.dtype == torch.float32
        err = (got.double() - ref_).abs().max().item()
        assert err <= tol[i > 0] * ref_.abs().max().item(), (i, err)


def test_elu1_map_past_the_kernels_head_size_forms_features(fused):
    """Head size 129 (past the in-kernel map's 128): the features are formed in PyTorch and
    the plain fused scan runs on them, equal to the segmented PyTorch scan."""
    from mosaics.ops.feature_attention import CosineFeatureAttention, FusedElu1Attention
    from mosaics.ops.linear_attention import elu1_unsupported

    x, w1, w2, v = _elu1_inputs(129, 3, T=20, D=5)
    assert "head size 129" in elu1_unsupported(x, w1, v)
    results = []
    for fn in (FusedElu1Attention, CosineFeatureAttention):
        leaves = [t.clone().requires_grad_() for t in (x, v, w1, w2)]
        y = fn.apply(*leaves, 16, 1e-20) if fn is CosineFeatureAttention else fn.apply(
            *leaves, 1e-20, 16)
        results.append((y, *torch.autograd.grad(y.sin().sum(), leaves)))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_fska_exp_map_records_its_chunked_path(fused):
    kernel = _fska("exp").eval()
    keys = torch.nn.functional.normalize(torch.randn(1, 2, 9, 6), dim=-1)
    kernel(keys, torch.randn(1, 2, 9, 6), torch.tensor([2.0, 2.0]))
    assert triton_backend.PATHS["fska"].startswith("chunked: positive='exp'")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype,tf32", [(torch.float32, False), (torch.float32, True),
                                        (torch.bfloat16, False)])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("T,F,D", [(1000, 192, 64), (777, 70, 40)])
def test_compiled_kernels_on_cuda(monkeypatch, dtype, tf32, shared, T, F, D):
    """The compiled kernels (the GPU's own tile layouts and pipelining; fp32 as IEEE products,
    or TF32 where PyTorch allows it) against the float64 reference."""
    monkeypatch.delenv("MOSAICS_FUSED", raising=False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", tf32)
    assert triton_backend.fused_reason(torch.zeros(1, device="cuda")) is None
    low, ref = _inputs(2, 3, T, F, D, dtype, shared)
    low = [None if x is None else x.detach().cuda().requires_grad_() for x in low]
    ref = [None if x is None else x.detach().cuda().requires_grad_() for x in ref]
    _check(low, ref, 64, dtype, tol=(1e-2, 5e-2) if tf32 else None)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("precision", ["tf32x3", "bf16"])
def test_compiled_precision_overrides_on_cuda(precision):
    """fp32 inputs with tf32x3 products (fp32 tolerance) or bf16 operands (bf16 tolerance)."""
    low, ref = _inputs(2, 3, 1000, 192, 64, torch.float32, True)
    low = [None if x is None else x.detach().cuda().requires_grad_() for x in low]
    ref = [None if x is None else x.detach().cuda().requires_grad_() for x in ref]
    tol = (1e-2, 6e-2) if precision == "bf16" else (1e-4, 1e-3)
    _check(low, ref, 64, torch.float32, tol=tol, precision=precision)


@pytest.mark.cuda
@cuda
def test_fska_fused_path_on_cuda(monkeypatch):
    """FSKA on CUDA (the default switch takes the fused path) against MOSAICS_FUSED=0, at the
    default 96 frequency pairs (192 features) and head size 64."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch.manual_seed(0)
    kernel = get_kernel("fska", flow_hidden=16)
    kernel.build(4, 64)
    kernel = kernel.cuda().eval()
    g = torch.Generator().manual_seed(5)
    keys = torch.nn.functional.normalize(torch.randn(2, 4, 1500, 64, generator=g), dim=-1)
    values = torch.randn(2, 4, 1500, 64, generator=g)
    keys, values, beta = keys.cuda(), values.cuda(), torch.full((4,), 7.39, device="cuda")
    results = {}
    for switch in ("", "0"):
        monkeypatch.setenv("MOSAICS_FUSED", switch)
        k, v = keys.clone().requires_grad_(), values.clone().requires_grad_()
        y = kernel(k, v, beta)
        results[switch] = (y, *torch.autograd.grad(y.sin().sum(), (k, v)))
        assert (triton_backend.PATHS["fska"] == "fused") == (switch == "")
    for got, want in zip(results[""], results["0"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # bf16 products, fp32 states
        monkeypatch.setenv("MOSAICS_FUSED", "")
        k, v = keys.clone().requires_grad_(), values.clone().requires_grad_()
        y = kernel(k, v, beta)
        grads = torch.autograd.grad(y.sin().sum(), (k, v))
    for got, want in zip((y, *grads), results["0"], strict=True):
        scale = want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= 5e-2 * scale



def compile_check(dtype_name: str) -> None:
    """Compile every kernel to an sm_90 cubin (Triton's own ptxas, no GPU needed) at the launch
    settings of ``mosaics.ops.linear_attention``, for D 64 and 128 (the largest the op takes),
    and check the shared memory against the H100's 227 KiB. Run in a process where Triton is
    not in interpreter mode (the standard library's jitted helpers are then compilable)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mosaics.ops import linear_attention as la
    from mosaics.ops.triton_backend import triton_module

    assert not triton.knobs.runtime.interpret
    mod = triton_module(la.KERNEL_FILE, torch.device("cuda"))
    dtype = getattr(torch, dtype_name)
    dt = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}[dtype]
    ptr = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}[dtype]
    dots = {"PREC": "ieee" if dtype == torch.float32 else "tf32", "DT": dt, "DOT": dt}
    types = {n: "i32" for n in ("T", "F", "D", "NC", "M", "HS", "H")} | {
        n: "fp32" for n in ("eps", "scale")} | {
        n: "*fp32" for n in ("w_ptr", "s_ptr", "z_ptr", "den_ptr", "dd_ptr", "rs_ptr", "rz_ptr",
                             "x_ptr", "w1_ptr", "w2_ptr", "dx_ptr", "dw1_ptr", "dw2_ptr")}
    elu1 = {"C": 64, "BM": la.ELU1_BM, "BS": 64, "APREC": "tf32x3", **dots}
    cases = [(mod.chunk_states, {"HAS_W": True, "REVERSE": True, "C": 64, "BK": 32, "BD": 32,
                                 **dots}, {}),
             (mod.output_grad, {"BT": 64, "BD": la.MAX_VALUE_DIM, "DT": dt}, {}),
             (mod.elu1_chunk_states, {"HAS_W": True, "REVERSE": True, "BD": 32, **elu1}, {})]
    for BD in (64, la.MAX_VALUE_DIM):
        cases += [(mod.chunk_forward, {"C": 64, "BK": la.FORWARD_BK, "BD": BD, **dots},
                   la.LAUNCH),
                  (mod.chunk_backward, {"SHARED": True, "C": 64, "BK": la._backward_bk(dtype),
                                        "BD": BD, **dots}, la.LAUNCH),
                  (mod.elu1_chunk_forward, {"BD": BD, **elu1}, la.LAUNCH),
                  (mod.elu1_chunk_backward, {"BD": BD, **elu1}, la.LAUNCH)]
    for fn, consts, options in cases:
        signature = {n: "constexpr" if n in consts else types.get(n, ptr) for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=consts)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        assert "cubin" in kernel.asm, fn.__name__
        assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, consts, kernel.metadata.shared)
        print(fn.__name__, consts.get("BD"), "shared", kernel.metadata.shared)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_compile_for_sm90_without_a_gpu(dtype):
    """:func:`compile_check` in a fresh process without ``TRITON_INTERPRET``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(here)!r}); "
            f"from test_fused_linear_attention import compile_check; "
            f"compile_check({dtype!r})")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    if out.returncode and "ptxas" in out.stderr and "not found" in out.stderr.lower():
        pytest.skip(f"no ptxas for sm_90 here: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("shared") == 11
