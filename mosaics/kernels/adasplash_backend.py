"""Fused alpha-entmax retrieval on CUDA through the ``adasplash`` package (optional).

The alpha-entmax kernels (epanechnikov = sparsemax, biweight = 1.5-entmax, triweight =
4/3-entmax, entmax) compute, for unit keys k_t, values v_t and per-head bandwidths beta_h,

    y_t = sum_{s < t} p_ts v_s,   p_t. = alpha-entmax(beta_h cos(k_t, k_s), s < t),   y_0 = 0,

with alpha-entmax(z)_s = [(alpha - 1) z_s - tau]_+^(1/(alpha-1)), tau such that the row sums
to one. ``adasplash`` (Goncalves et al., "AdaSplash: Adaptive Sparse Flash Attention", 2025;
Triton, CUDA only) computes the same map for causal attention with inclusive masks and scores
q_i . k_j / sqrt(D). :func:`retrieval` turns one into the other:

- strict past: queries k_1..k_{T-1} against keys k_0..k_{T-2} with the inclusive causal mask
  (query i sees entries j <= i), and a zero row 0 in front;
- bandwidth: the queries are multiplied by beta_h sqrt(D), so q_i . k_j / sqrt(D) =
  beta_h cos(k_t, k_s) (D the padded head size below);
- precision: queries, keys and values are cast to fp32 whatever the autocast dtype (the
  chunked path's rule: scores, thresholds and normalisers in fp32); the output is cast back
  to the values' dtype;
- shapes: the head sizes are zero-padded to the smallest D in :data:`HEAD_DIMS` that holds
  both (zero columns change no dot product) and the length n = T - 1 to the next power of
  two, at least :data:`MIN_LENGTH`. Padded rows come after every real row, so the causal
  mask keeps them out of the real rows, and they receive no output gradient. Training
  lengths T = 2^k give n = 2^k - 1: one padded row; a length just above a power of two
  costs up to twice the work (adasplash's ``varlen`` argument would avoid that, unused here
  so that only its plain power-of-two path runs).

The function that does the attention lives in a slot (:data:`BACKEND`, :func:`use_backend`):
None means :func:`sparse_attention`, adasplash's kernels; tests install a pure-PyTorch
function with the same call contract (:data:`AttentionFn`) to check the mapping on CPU.

:func:`skip_reason` decides, per call, whether the fused path runs; the chunked path of
:class:`~.score_kernel.PowerKernel` (the reference) serves every other case:

- ``MOSAICS_ADASPLASH=0`` in the environment, or ``use_adasplash = False`` on the kernel;
- adasplash or triton not installed (``pip install -e ".[gpu]"``), or inputs not on CUDA;
- alpha outside (1, 2] (adasplash's solver brackets the threshold for alpha <= 2 only);
- fp64 inputs (adasplash runs in the inputs' dtype; fp32 is the precision checked here);
- a head size above 256.
Decoding (``step``) never comes here: it keeps the kernels' own row solvers.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn import functional as F

from ..ops.entmax import work_dtype

if TYPE_CHECKING:
    from .entmax_kernel import EntmaxKernel

ENV_SWITCH = "MOSAICS_ADASPLASH"  # "0" keeps the chunked path everywhere
HEAD_DIMS = (16, 32, 64, 128, 256)  # head sizes adasplash's kernels are compiled for
MIN_LENGTH = 64  # shortest sequence passed (AdaSplash-2 tiles; AdaSplash-1's 64-row blocks)
V1_NITER = 10  # Halley/bisection steps of AdaSplash-1's threshold (its default)
V2_NITER = 2  # refinement steps of AdaSplash-2 after its histogram start (its default: 1)

AttentionFn = Callable[[Tensor, Tensor, Tensor, float], Tensor]
"""The call contract of a backend: ``fn(q, k, v, alpha) -> out``.

q, k, v: (B, H, N, D) contiguous tensors of one dtype (fp32; fp64 only with a backend
installed by :func:`use_backend`), N a power of two >= MIN_LENGTH, D in HEAD_DIMS; alpha in
(1, 2]. Returns (B, H, N, D) in the same dtype:

    out_i = sum_{j <= i} p_ij v_j,   p_i. = alpha-entmax(q_i . k_j / sqrt(D), j <= i),

differentiable with respect to q, k and v.
"""

BACKEND: AttentionFn | None = None  # None: sparse_attention (adasplash)


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, alpha: float) -> Tensor:
    """adasplash's causal alpha-entmax attention, under the :data:`AttentionFn` contract.

    alpha = 1.5 runs AdaSplash-2 (``adasplash.adasplash_v2``: 1.5-entmax only, causal,
    histogram start of the threshold, ``V2_NITER`` refinements); other alphas run
    AdaSplash-1 (``adasplash.adasplash_v1`` with ``is_causal=True``: Halley steps inside the
    bracket [max - 1, max - n^(1 - alpha)], ``V1_NITER`` of them). Both scale scores by
    1 / sqrt(D), return q's dtype and do not renormalise the rows.
    """
    import adasplash

    if alpha == 1.5:
        return adasplash.adasplash_v2(q, k, v, niter=V2_NITER)
    if torch.is_grad_enabled() and not q.requires_grad and (k.requires_grad or v.requires_grad):
        q = q.detach().requires_grad_()  # AdaSplash-1 keeps what backward needs only for such q
    return adasplash.adasplash_v1(q, k, v, alpha=alpha, is_causal=True, niter=V1_NITER)


@contextmanager
def use_backend(fn: AttentionFn | None) -> Iterator[None]:
    """Run the fused path with ``fn`` (:data:`AttentionFn`) instead of adasplash's kernels.

    A replacement is taken to run on any device and in fp64, so inside the block the fused
    path is also used on CPU (what the CPU tests rely on). None restores adasplash.
    """
    global BACKEND
    previous, BACKEND = BACKEND, fn
    try:
        yield
    finally:
        BACKEND = previous


@functools.cache
def _missing_package() -> str | None:
    for name in ("adasplash", "triton"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (pip install -e \".[gpu]\")"
    return None


def _switched_off() -> str | None:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"disabled by {ENV_SWITCH}={os.environ[ENV_SWITCH]}"
    return None


def disabled_reason() -> str | None:
    """Why adasplash's kernels cannot run on this machine (switch, packages, CUDA), or None."""
    reason = _switched_off() or _missing_package()
    if reason is not None:
        return reason
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def available() -> bool:
    """Whether adasplash and a CUDA device can be used (see :func:`disabled_reason`)."""
    return disabled_reason() is None


def skip_reason(kernel: EntmaxKernel, keys: Tensor, values: Tensor) -> str | None:
    """Why the fused path does not serve this call of an alpha-entmax kernel, or None when
    it does (``kernel.use_adasplash = False`` keeps it off)."""
    if BACKEND is None and keys.device.type != "cuda":  # the common CPU case, decided first
        return f"inputs on {keys.device.type}; adasplash needs CUDA"
    reason = _switched_off()
    if reason is not None:
        return reason
    if not kernel.use_adasplash:
        return "disabled on this kernel (use_adasplash = False)"
    if BACKEND is None:
        reason = disabled_reason()
        if reason is not None:
            return reason
        if keys.dtype == torch.float64 or values.dtype == torch.float64:
            return "fp64 inputs (adasplash runs in fp32 here)"
    alpha = float(kernel.alpha)
    if not 1.0 < alpha <= 2.0:
        return f"alpha = {alpha:g} outside (1, 2]"
    if max(keys.shape[-1], values.shape[-1]) > HEAD_DIMS[-1]:
        return f"head size above {HEAD_DIMS[-1]}"
    return None


def padded_sizes(n: int, head_size: int) -> tuple[int, int]:
    """(N, D): the length n rounded up to a power of two >= MIN_LENGTH, and the smallest
    supported head dimension >= head_size."""
    length = max(MIN_LENGTH, 1 << max(0, n - 1).bit_length())
    dim = next(d for d in HEAD_DIMS if d >= head_size)
    return length, dim


def retrieval(keys: Tensor, values: Tensor, beta: Tensor, alpha: float) -> Tensor:
    """Strict-past alpha-entmax retrieval through the backend.

    Args:
        keys: (B, H, T, hs) unit keys (also the queries).
        values: (B, H, T, hv).
        beta: (H,) bandwidths.
        alpha: in (1, 2].
    Returns:
        (B, H, T, hv) in the values' dtype: row t = sum_{s < t} p_ts v_s with
        p_t. = alpha-entmax(beta cos(k_t, k_s), s < t); row 0 is exactly 0. Differentiable in
        keys, values and beta. Computed in fp32 (fp64 stays fp64 with a replaced backend).
    """
    B, H, T, hs = keys.shape
    hv = values.shape[-1]
    if beta.dim() != 1 or beta.shape[0] != H:
        raise ValueError(f"beta must have shape (H,) = ({H},), got {tuple(beta.shape)}")
    zero_row = values.new_zeros(B, H, 1, hv)
    if T < 2:
        return values.new_zeros(B, H, T, hv)
    n = T - 1
    N, D = padded_sizes(n, max(hs, hv))
    wd = work_dtype(keys.dtype) if BACKEND is not None else torch.float32
    fn = sparse_attention if BACKEND is None else BACKEND
    with torch.autocast(keys.device.type, enabled=False):
        scale = (beta.to(wd) * math.sqrt(D)).view(1, H, 1, 1)
        q = _pad(keys[:, :, 1:].to(wd) * scale, N, D)
        k = _pad(keys[:, :, :-1].to(wd), N, D)
        v = _pad(values[:, :, :-1].to(wd), N, D)
        y = fn(q, k, v, float(alpha))[:, :, :n, :hv]
    return torch.cat([zero_row, y.to(values.dtype)], dim=2)


def _pad(x: Tensor, length: int, dim: int) -> Tensor:
    """(B, H, n, d) -> contiguous (B, H, length, dim), zeros appended."""
    pad = (0, dim - x.shape[-1], 0, length - x.shape[-2])
    return F.pad(x, pad).contiguous() if any(pad) else x.contiguous()
