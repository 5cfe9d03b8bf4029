"""Strict-past (causal) linear attention, numerator and denominator in one fused pass.

    y_t = sum_{s<t} (q_t . k_s) v_s / (sum_{s<t} q_t . k_s + eps)    (0 where that is 0)

for non-negative features q, k (B, H, T, F) and values v (B, H, T, D)
(:func:`causal_linear_attention_reference`, dense). :func:`causal_linear_attention` runs the
chunked Triton kernels of ``triton_kernels/linear_attention.py`` (compiled on CUDA, under
Triton's interpreter on CPU tensors with ``MOSAICS_FUSED=1``; see :mod:`.triton_backend`):
per chunk of C rows the strictly-lower (C, C) block q k^T against [v, 1] plus the fp32 prefix
state sum_{s in earlier chunks} k_s [v_s, 1]^T, so the numerator and the denominator come out
of one pass, and nothing of size T x T or T x F x D is formed. Cost O(T (C + D) F)
multiply-adds each way, chunk states (T / C) F D fp32 numbers; saved for backward: the
inputs, y and den (the chunk states are recomputed). Where the fused kernels do not run (the
switch, the device, float64, D > 256) the same chunks run in PyTorch.
:func:`fused_forward` / :func:`fused_backward` are the two passes without autograd, for a
caller's own autograd Function; :func:`fused_elu1_forward` / :func:`fused_elu1_backward` are
the same with FSKA's ELU+1 features computed inside the kernels from keys and frequencies.

Inputs of one floating dtype (fp32, bf16 or fp16; mixed inputs are promoted) are multiplied
in that dtype with fp32 accumulation; fp32 products use TF32 on the GPU only where PyTorch's
own fp32 matmuls may (``torch.backends.cuda.matmul.allow_tf32``, i.e.
``torch.set_float32_matmul_precision("high")``), IEEE fp32 otherwise. With bf16 / fp16 inputs
the fp32 chunk states, the (C, C) blocks and dy / den are rounded to that dtype where they
enter a product (as flash attention rounds its probabilities). ``precision`` overrides the
choice (:data:`PRECISIONS`): ``"ieee"``, ``"tf32"`` or ``"tf32x3"`` (three TF32 products, about
fp32 accuracy on tensor cores) for fp32 operands, or ``"bf16"``: every operand rounded to bf16
(tensor cores at bf16 rate) whatever the inputs' dtype, still with fp32 accumulation, fp32
states and outputs in the inputs' dtype.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .triton_backend import fused_reason, kernel_source, pinned_tiles, triton_module

KERNEL_FILE = kernel_source(__file__, "linear_attention")
CHUNK = 64  # rows per chunk of the fused kernels
MAX_VALUE_DIM = 128  # a chunk's (C, D) blocks stay in registers and shared memory
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PRECISIONS = ("ieee", "tf32", "tf32x3", "bf16")  # the ``precision`` overrides
# The per-chunk kernels hold several (C, C) and (C, D) fp32 blocks: 8 warps keep them in
# registers, 2 stages keep the pipelined (C, BK) tiles within shared memory. Compiled for
# sm_90 (ptxas -v), C 64, D 64: forward BK 32 uses 154 registers (fp32) / 128 (bf16) and no
# spills, where BK 64 used 255 and spilled; backward BK 16 (fp32) / 32 (bf16, fp16) uses 255
# with 60 bytes of spills / 212 with none. At D 128 the fp32 backward needs 136 KiB of shared
# memory (D 256 would need 232 KiB, past the H100's 227).
LAUNCH = {"num_warps": 8, "num_stages": 2}
FORWARD_BK = 32


def _backward_bk(dtype: torch.dtype) -> int:
    return 16 if dtype == torch.float32 else 32


def _tiles(dtype: torch.dtype) -> tuple[int, int, dict[str, int]]:
    """(forward BK, backward BK, launch options) of the per-chunk kernels: the tiles pinned
    for "linear" (:func:`~.triton_backend.use_tiles`, ``MOSAICS_TILES``; the backward takes
    at most its own BK), else FORWARD_BK, :func:`_backward_bk` and LAUNCH."""
    pinned = pinned_tiles("linear")
    if pinned is None:
        return FORWARD_BK, _backward_bk(dtype), LAUNCH
    launch = {"num_warps": pinned["num_warps"], "num_stages": pinned["num_stages"]}
    return pinned["BK"], min(pinned["BK"], _backward_bk(dtype)), launch


def _block(n: int, cap: int) -> int:
    """The power of two >= n (at least 16, the smallest ``tl.dot`` side), at most cap."""
    return min(cap, max(16, 1 << (n - 1).bit_length()))


def _check_shapes(q: Tensor, k: Tensor | None, v: Tensor) -> None:
    k = q if k is None else k
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"causal_linear_attention: features q, k (B, H, T, F) and values v "
                         f"(B, H, T, D) expected, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")


def linear_attention_unsupported(q: Tensor, k: Tensor | None, v: Tensor) -> str | None:
    """None when the fused kernels take these inputs (dtypes, value size, the kernel source
    installed), else why not; the device and the ``MOSAICS_FUSED`` switch are
    :func:`.triton_backend.fused_reason`'s business."""
    dtypes = {q.dtype, v.dtype} | ({q.dtype} if k is None else {k.dtype})
    if not dtypes <= set(DTYPES):
        return f"dtypes {sorted(map(str, dtypes))}: the fused kernels take fp32, bf16 or fp16"
    if v.shape[-1] > MAX_VALUE_DIM:
        return f"value size {v.shape[-1]} > {MAX_VALUE_DIM}"
    if not KERNEL_FILE.exists():
        return f"the Triton source {KERNEL_FILE.name} is not installed beside this module"
    return None


def check_precision(precision: str | None) -> None:
    """Raise ValueError unless ``precision`` is None (from the inputs) or in PRECISIONS."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"causal_linear_attention: precision must be None or one of "
                         f"{PRECISIONS}, got {precision!r}")


def _dot_args(dtype: torch.dtype, device: torch.device, precision: str | None = None) -> dict:
    """The kernels' PREC (fp32 products: "ieee", "tf32" or "tf32x3"; by default "tf32" where
    PyTorch allows TF32), DT (the dtype to which every product operand is rounded: the
    inputs', or bf16 with ``precision="bf16"``) and DOT (the operands' dtype: DT, or fp32 for
    bf16 under Triton's interpreter, see ``_op`` in the kernels)."""
    import triton.language as tl

    check_precision(precision)
    cuda = device.type == "cuda"
    if precision == "bf16":
        dtype = torch.bfloat16
    if precision in (None, "bf16"):
        tf32 = not cuda or torch.backends.cuda.matmul.allow_tf32
        prec = "tf32" if tf32 and precision is None else "ieee"
    else:
        prec = precision
    dt = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    dot = tl.float32 if dtype == torch.bfloat16 and not cuda else dt[dtype]
    return {"PREC": prec, "DT": dt[dtype], "DOT": dot}


def _chunk_states(mod: ModuleType, a: Tensor, b: Tensor, w: Tensor | None, reverse: bool,
                  chunk: int, dots: dict) -> tuple[Tensor, Tensor]:
    """Exclusive prefix (suffix when ``reverse``) sums over chunks of a^T b and a^T w:
    (BH, NC, F, D) and (BH, NC, F) fp32, from a (BH, T, F), b (BH, T, D), w (BH, T) or 1."""
    BH, T, F = a.shape
    D = b.shape[-1]
    nc = -(-T // chunk)
    S = a.new_empty(BH, nc, F, D, dtype=torch.float32)
    z = a.new_empty(BH, nc, F, dtype=torch.float32)
    BK, BD = _block(F, 32), _block(D, 32)  # small blocks: more programs walk the chunks
    grid = (-(-F // BK), -(-D // BD), BH)
    mod.chunk_states[grid](a, b, S if w is None else w, S, z, T, F, D, nc, HAS_W=w is not None,
                           REVERSE=reverse, C=chunk, BK=BK, BD=BD, **dots)
    return S, z


def fused_forward(q: Tensor, k: Tensor | None, v: Tensor, eps: float, chunk: int = CHUNK,
                  precision: str | None = None) -> tuple[Tensor, Tensor]:
    """The fused forward, no autograd: y (B, H, T, D) and den' = den + eps (B, H, T) fp32,
    from q, k (B, H, T, F) (k None: k = q) and v (B, H, T, D), contiguous, of one dtype
    (checked by :func:`causal_linear_attention`; also the building block of a caller's own
    autograd Function, as FSKA's); ``precision`` as in :func:`causal_linear_attention`."""
    B, H, T, F = q.shape
    D = v.shape[-1]
    if q.numel() == 0 or v.numel() == 0:  # nothing to launch (a grid may not be empty)
        return torch.zeros_like(v), q.new_full((B, H, T), eps, dtype=torch.float32)
    mod = triton_module(KERNEL_FILE, q.device)
    dots = _dot_args(q.dtype, q.device, precision)
    kk = q if k is None else k
    q3, k3, v3 = q.view(B * H, T, F), kk.view(B * H, T, F), v.view(B * H, T, D)
    P, z = _chunk_states(mod, k3, v3, None, False, chunk, dots)
    y = torch.empty_like(v3)
    den = q.new_empty(B * H, T, dtype=torch.float32)
    nc = P.shape[1]
    bk, _, launch = _tiles(q.dtype)
    mod.chunk_forward[(nc, B * H)](q3, k3, v3, P, z, y, den, T, F, D, nc, eps, C=chunk,
                                   BK=_block(F, bk), BD=_block(D, MAX_VALUE_DIM), **dots,
                                   **launch)
    return y.view(B, H, T, D), den.view(B, H, T)


def fused_backward(q: Tensor, k: Tensor | None, v: Tensor, y: Tensor, den: Tensor, dy: Tensor,
                   chunk: int = CHUNK, precision: str | None = None
                   ) -> tuple[Tensor, Tensor | None, Tensor]:
    """(dq, dk, dv) of :func:`fused_forward` from its inputs, its (y, den') and dy (B, H, T, D);
    dk None when k is None (then dq is the whole gradient of the shared features). The chunk
    states are recomputed."""
    B, H, T, F = q.shape
    D = v.shape[-1]
    BH = B * H
    if q.numel() == 0 or v.numel() == 0:  # y = 0 whatever the inputs
        return torch.zeros_like(q), None if k is None else torch.zeros_like(k), torch.zeros_like(v)
    mod = triton_module(KERNEL_FILE, q.device)
    dots = _dot_args(q.dtype, q.device, precision)
    kk = q if k is None else k
    q3, k3, v3 = q.view(BH, T, F), kk.view(BH, T, F), v.view(BH, T, D)
    dy = dy.reshape(BH, T, D).contiguous()
    dn = torch.empty_like(v3)
    dd = torch.empty(BH, T, device=q.device, dtype=torch.float32)
    BT, BD = 64, _block(D, MAX_VALUE_DIM)
    mod.output_grad[(-(-T // BT), BH)](dy, y, den, dn, dd, T, D, BT=BT, BD=BD, DT=dots["DT"])
    P, z = _chunk_states(mod, k3, v3, None, False, chunk, dots)
    R, r = _chunk_states(mod, q3, dn, dd, True, chunk, dots)
    dq = torch.empty_like(q3)
    dk = dq if k is None else torch.empty_like(k3)
    dv = torch.empty_like(v3)
    nc = P.shape[1]
    _, bk, launch = _tiles(q.dtype)
    mod.chunk_backward[(nc, BH)](q3, k3, v3, dn, dd, P, z, R, r, dq, dk, dv, T, F, D, nc,
                                 SHARED=k is None, C=chunk, BK=_block(F, bk), BD=BD, **dots,
                                 **launch)
    return dq.view(q.shape), None if k is None else dk.view(k.shape), dv.view(v.shape)


MAX_HEAD_DIM = 128  # keys of the in-kernel ELU+1 map: one (C, HS) block per chunk
ELU1_BM = 16  # frequencies per block of the in-kernel ELU+1 map (2 BM features)


def elu1_unsupported(x: Tensor, w1: Tensor, v: Tensor) -> str | None:
    """None when the in-kernel ELU+1 map (:func:`fused_elu1_forward`) takes keys x (B, H, T,
    HS), frequencies (H, M, HS) and values v (B, H, T, D), else why not."""
    if x.dtype != torch.float32 or w1.dtype != torch.float32:
        return "the in-kernel ELU+1 map takes fp32 keys and frequencies"
    if x.shape[-1] > MAX_HEAD_DIM:
        return f"head size {x.shape[-1]} > {MAX_HEAD_DIM}"
    return linear_attention_unsupported(x, None, v)


def _elu1_args(x: Tensor, w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor, Tensor, dict]:
    """x as (BH, T, HS), contiguous fp32 frequencies and the kernels' shape arguments."""
    B, H, T, HS = x.shape
    M = w1.shape[1]
    sizes = {"T": T, "M": M, "HS": HS, "H": H, "scale": (4 * M) ** -0.5}
    return (x.contiguous().view(B * H, T, HS), w1.float().contiguous(),
            w2.float().contiguous(), sizes)


def _angle_precision(device: torch.device) -> str:
    """The angles' products x w^T: three TF32 products on the GPU, IEEE fp32 elsewhere."""
    return "tf32x3" if device.type == "cuda" else "ieee"


def _elu1_states(mod: ModuleType, x3: Tensor, w1: Tensor, w2: Tensor, sizes: dict, b: Tensor,
                 w: Tensor | None, reverse: bool, chunk: int, dots: dict
                 ) -> tuple[Tensor, Tensor]:
    """:func:`_chunk_states` with a = g(x) computed in the kernel: (BH, NC, 2M, D), (BH, NC,
    2M) fp32."""
    BH, T, HS = x3.shape
    M, D = sizes["M"], b.shape[-1]
    nc = -(-T // chunk)
    S = x3.new_empty(BH, nc, 2 * M, D, dtype=torch.float32)
    z = x3.new_empty(BH, nc, 2 * M, dtype=torch.float32)
    BD = _block(D, 32)
    grid = (-(-M // ELU1_BM), -(-D // BD), BH)
    mod.elu1_chunk_states[grid](x3, w1, w2, b, S if w is None else w, S, z, T, M, HS, D, nc,
                                sizes["H"], sizes["scale"], HAS_W=w is not None,
                                REVERSE=reverse, C=chunk, BM=ELU1_BM,
                                BS=_block(HS, MAX_HEAD_DIM), BD=BD,
                                APREC=_angle_precision(x3.device), **dots)
    return S, z


def fused_elu1_forward(x: Tensor, w1: Tensor, w2: Tensor, v: Tensor, eps: float,
                       chunk: int = CHUNK, precision: str | None = None
                       ) -> tuple[Tensor, Tensor]:
    """:func:`fused_forward` of the features g = ELU(phi(x)) + 1 (q = k = g) computed inside
    the chunk kernels from keys x (B, H, T, HS) fp32 and frequencies w1, w2 (H, M, HS) fp32,
    phi = (4M)^-1/2 [cos x w1^T + cos x w2^T ; sin x w1^T + sin x w2^T]: y (B, H, T, D) and
    den' (B, H, T) fp32; no (B, H, T, 2M) tensor is formed. The attention products follow
    ``precision`` and v's dtype; the angles are fp32 products."""
    B, H, T, _ = x.shape
    D = v.shape[-1]
    if x.numel() == 0 or v.numel() == 0 or w1.numel() == 0:
        return torch.zeros_like(v), x.new_full((B, H, T), eps, dtype=torch.float32)
    mod = triton_module(KERNEL_FILE, x.device)
    dots = _dot_args(v.dtype, v.device, precision)
    x3, w1, w2, sizes = _elu1_args(x, w1, w2)
    v3 = v.contiguous().view(B * H, T, D)
    P, z = _elu1_states(mod, x3, w1, w2, sizes, v3, None, False, chunk, dots)
    y = torch.empty_like(v3)
    den = x.new_empty(B * H, T, dtype=torch.float32)
    nc = P.shape[1]
    _, _, launch = _tiles(v.dtype)
    mod.elu1_chunk_forward[(nc, B * H)](
        x3, w1, w2, v3, P, z, y, den, T, sizes["M"], sizes["HS"], D, nc, H, sizes["scale"],
        eps, C=chunk, BM=ELU1_BM, BS=_block(sizes["HS"], MAX_HEAD_DIM),
        BD=_block(D, MAX_VALUE_DIM), APREC=_angle_precision(x.device), **dots, **launch)
    return y.view(B, H, T, D), den.view(B, H, T)


def fused_elu1_backward(x: Tensor, w1: Tensor, w2: Tensor, v: Tensor, y: Tensor, den: Tensor,
                        dy: Tensor, chunk: int = CHUNK, precision: str | None = None
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw1, dw2, dv) of :func:`fused_elu1_forward` from its inputs, its (y, den') and dy;
    the features and chunk states are recomputed in the kernels, the frequencies' gradients
    summed over batch and chunks with fp32 atomic adds (their order is not fixed)."""
    B, H, T, HS = x.shape
    D = v.shape[-1]
    BH = B * H
    if x.numel() == 0 or v.numel() == 0 or w1.numel() == 0:
        return (torch.zeros_like(x), torch.zeros_like(w1), torch.zeros_like(w2),
                torch.zeros_like(v))
    mod = triton_module(KERNEL_FILE, x.device)
    dots = _dot_args(v.dtype, v.device, precision)
    x3, w1c, w2c, sizes = _elu1_args(x, w1, w2)
    v3 = v.contiguous().view(BH, T, D)
    dy = dy.reshape(BH, T, D).contiguous()
    dn = torch.empty_like(v3)
    dd = torch.empty(BH, T, device=x.device, dtype=torch.float32)
    BD = _block(D, MAX_VALUE_DIM)
    mod.output_grad[(-(-T // 64), BH)](dy, y, den, dn, dd, T, D, BT=64, BD=BD, DT=dots["DT"])
    P, z = _elu1_states(mod, x3, w1c, w2c, sizes, v3, None, False, chunk, dots)
    R, r = _elu1_states(mod, x3, w1c, w2c, sizes, dn, dd, True, chunk, dots)
    dx = torch.empty(x3.shape, device=x.device, dtype=torch.float32)
    dw1 = torch.zeros(w1c.shape, device=x.device, dtype=torch.float32)
    dw2 = torch.zeros_like(dw1)
    dv = torch.empty_like(v3)
    nc = P.shape[1]
    _, _, launch = _tiles(v.dtype)
    mod.elu1_chunk_backward[(nc, BH)](
        x3, w1c, w2c, v3, dn, dd, P, z, R, r, dx, dw1, dw2, dv, T, sizes["M"], HS, D, nc, H,
        sizes["scale"], C=chunk, BM=ELU1_BM, BS=_block(HS, MAX_HEAD_DIM), BD=BD,
        APREC=_angle_precision(x.device), **dots, **launch)
    return (dx.view(x.shape).to(x.dtype), dw1.to(w1.dtype), dw2.to(w2.dtype),
            dv.view(v.shape))


class _LinearAttention(torch.autograd.Function):
    """y (B, H, T, D) of :func:`causal_linear_attention` from q, k (B, H, T, F) (k None:
    k = q, one gradient) and v (B, H, T, D), all contiguous of one dtype. Saves the inputs,
    y and den'."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor | None, v: Tensor, eps: float, chunk: int,
                precision: str | None) -> Tensor:
        y, den = fused_forward(q, k, v, eps, chunk, precision)
        ctx.save_for_backward(q, k, v, y, den)
        ctx.chunk, ctx.precision = chunk, precision
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor):  # noqa: ANN205
        q, k, v, y, den = ctx.saved_tensors
        return (*fused_backward(q, k, v, y, den, dy, ctx.chunk, ctx.precision), None, None, None)


def causal_linear_attention(q: Tensor, k: Tensor | None, v: Tensor, eps: float = 1e-20,
                            chunk: int = CHUNK, precision: str | None = None) -> Tensor:
    """y_t = sum_{s<t} (q_t . k_s) v_s / (sum_{s<t} q_t . k_s + eps), 0 where the denominator
    is 0 (row 0 with eps = 0).

    Args:
        q, k: (B, H, T, F) non-negative features; k None means k = q (one gradient).
        v: (B, H, T, D) (the fused kernels take D <= 128).
        eps: added to the denominator.
        chunk: rows per chunk, a power of two >= 16 (the cost per row is O((C + D) F)).
        precision: the fused kernels' products: None (from the inputs' dtype), or one of
            PRECISIONS (see the module docstring); the PyTorch chunks ignore it.
    Returns:
        (B, H, T, D) in the promoted dtype of the inputs.

    The fused Triton kernels run where :func:`.triton_backend.fused_reason` and
    :func:`linear_attention_unsupported` allow (CUDA, or CPU under ``MOSAICS_FUSED=1``; fp32 /
    bf16 / fp16, D <= 256); elsewhere the same chunks in PyTorch (through autograd, keeping
    its (C, C) blocks and chunk states for backward).
    """
    _check_shapes(q, k, v)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"causal_linear_attention: chunk must be a power of two >= 16, "
                         f"got {chunk!r}")
    check_precision(precision)
    dtype = q.dtype if k is None else torch.promote_types(q.dtype, k.dtype)
    dtype = torch.promote_types(dtype, v.dtype)
    tensors = (q, v) if k is None else (q, k, v)
    if fused_reason(*tensors) is not None or linear_attention_unsupported(q, k, v) is not None:
        return _chunked_reference(q.to(dtype), None if k is None else k.to(dtype), v.to(dtype),
                                  eps, chunk)
    q, v = q.to(dtype).contiguous(), v.to(dtype).contiguous()
    k = None if k is None else k.to(dtype).contiguous()
    return _LinearAttention.apply(q, k, v, float(eps), chunk, precision)


def _chunked_reference(q: Tensor, k: Tensor | None, v: Tensor, eps: float,
                       chunk: int) -> Tensor:
    """:func:`causal_linear_attention` in PyTorch chunks: per chunk the strictly-lower (C, C)
    block q k^T against [v, 1] plus q P_c, P_c = sum over earlier chunks of k^T [v, 1]."""
    k = q if k is None else k
    B, H, T, F = q.shape
    n = -(-T // chunk)
    pad = n * chunk - T
    v1 = torch.cat([v, v.new_ones(B, H, T, 1)], dim=-1)
    qc, kc, vc = (torch.nn.functional.pad(x, (0, 0, 0, pad)).view(B, H, n, chunk, -1)
                  for x in (q, k, v1))
    o = (qc @ kc.transpose(-1, -2)).tril(-1) @ vc  # (B, H, n, C, D + 1)
    states = kc.transpose(-1, -2) @ vc  # (B, H, n, F, D + 1)
    prefix = torch.cat([torch.zeros_like(states[:, :, :1]), states[:, :, :-1].cumsum(2)], 2)
    o = (o + qc @ prefix).reshape(B, H, n * chunk, -1)[:, :, :T]
    den = o[..., -1:] + eps
    return torch.where(den > 0, o[..., :-1] / torch.where(den > 0, den, 1.0), 0.0)


def causal_linear_attention_reference(q: Tensor, k: Tensor | None, v: Tensor,
                                      eps: float = 1e-20) -> Tensor:
    """The same as :func:`causal_linear_attention`, dense: the strictly-lower (T, T) weights
    q k^T (s < t) times [v, 1], in the inputs' dtype."""
    k = q if k is None else k
    w = (q @ k.transpose(-1, -2)).tril(-1)
    den = w.sum(-1, keepdim=True) + eps
    return torch.where(den > 0, (w @ v) / torch.where(den > 0, den, 1.0), 0.0)
