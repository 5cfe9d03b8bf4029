"""Slot-bank attention of the persistent memory: softmax(q K^T) V over P learned slots.

    y = softmax(q M_k^T) M_v,   q: (H, N, hs) queries,  M_k, M_v: (H, P, hs) banks

:func:`bank_attention` is the one entry point; :func:`bank_attention_reference` states it.
Training on CPU it dispatches to

- :class:`_StoredBankAttention`: the compiled kernel of ``mosaics/csrc/bank_attention.cpp``
  (probabilities kept for the backward, oneDNN batch-reduce GEMMs), built on first use with
  :func:`torch.utils.cpp_extension.load` and checked against the formula on a small problem;
  where that fails, one warning and the next form. ``MOSAICS_CPU_EXTENSION=0`` skips it.
- :class:`_BankAttention`: PyTorch's fused CPU forward, its backward in blocks of at most
  ``BANK_BLOCK`` slots (exact: a flash backward needs only P = exp(S - lse) and
  rowsum(dO * O) of the whole row).

Everything else (inference, dropout, other devices) is one fused
``F.scaled_dot_product_attention`` call. ``bench/bank_bound.py`` compares the forms.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from .causal import _BWD, _FWD, blocked_attention_available

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "bank_attention.cpp"
NAME = "mosaics_bank"  # the build's name, with the capability appended
ENV = "MOSAICS_CPU_EXTENSION"
# the compiler flags of ATen's own kernels for each capability torch reports
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def extension_enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def bank_extension() -> ModuleType | None:
    """The compiled module (``forward``, ``backward``), or None where it is disabled or does
    not build or pass its check on this machine (warned once). A flat copy of the model code
    beside a checkpoint (``trust_remote_code``) has no C++ source: None, silently."""
    return build_extension(SOURCE, NAME, _check, "the compiled CPU slot-bank kernel",
                           "the persistent memory uses PyTorch's fused attention instead")


def build_extension(source: Path, name: str, check: Callable[[ModuleType], None], what: str,
                    instead: str) -> ModuleType | None:
    """Build ``source`` with :func:`torch.utils.cpp_extension.load` for this CPU's capability
    and run ``check`` on it; None where ``MOSAICS_CPU_EXTENSION`` disables it, the source is
    absent, or the build or the check fails (one warning naming ``what`` and ``instead``)."""
    if not extension_enabled() or not source.exists():
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    flags = CAPABILITY_FLAGS.get(capability, [])
    if flags:
        flags = [*flags, f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    try:
        from torch.utils.cpp_extension import load

        # one build per checkout and source: two checkouts sharing TORCH_EXTENSIONS_DIR would
        # otherwise rebuild each other's build (its build file names the source's path)
        digest = hashlib.sha256(str(source).encode() + source.read_bytes()).hexdigest()[:10]
        module = load(name=f"{name}_{capability.lower()}_{digest}", sources=[str(source)],
                      extra_cflags=["-O3", "-fopenmp", *flags], verbose=False)
        check(module)
    except Exception as err:  # no compiler, no ninja, an unsupported CPU, a wrong result
        warnings.warn(f"mosaics: {what} is unavailable ({type(err).__name__}: "
                      f"{str(err).strip()[:300]}); {instead} (set {ENV}=0 to skip the build)",
                      RuntimeWarning, stacklevel=3)
        return None
    return module


def _check(module: ModuleType) -> None:
    """Forward and gradients on a small problem (two blocks of rows, 70 slots) against
    autograd through softmax(q k^T) v; raises on a mismatch."""
    gen = torch.Generator().manual_seed(0)
    # the first call may come from inside no_grad, inference_mode or autocast
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
        q, k, v, g = (torch.randn(2, n, 8, generator=gen) for n in (5, 70, 70, 5))
        y, *probs = module.forward(q, k, v, 3)
        grads = module.backward(g, q, k, v, y, probs, 3)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref = torch.softmax(q64 @ k64.transpose(1, 2), dim=-1) @ v64
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    for mine, theirs in zip((y, *grads), (ref, *ref_grads), strict=True):
        if not torch.allclose(mine.double(), theirs, rtol=1e-4, atol=1e-5):
            raise RuntimeError("its results differ from the softmax formula")


BANK_BLOCK = 448  # most bank slots per call of the blocked CPU backward (_BankAttention)
BANK_ROWS = 256  # queries per block of the compiled CPU bank kernel (_StoredBankAttention)
# most bytes of probabilities one slot-bank call keeps for its backward on CPU (H N P floats;
# above it the backward recomputes them: _BankAttention)
STORED_PROBS_MAX_BYTES = 256 * 2**20
SMALL_ROWS = 8  # at most this many query rows per head: batched GEMVs, not the fused call

class _BankAttention(torch.autograd.Function):
    """softmax(q k^T) v for (1, H, N, hs) queries and (1, H, P, hs) banks on CPU: the fused
    forward in one call, the fused backward in blocks of at most ``BANK_BLOCK`` slots (PyTorch's
    CPU kernel cuts keys into blocks of 512; 448 measured cheaper per slot, see
    ``bench/bank_bound.py``). Each block of slots yields its own dK, dV and a share of dq."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out, lse = _FWD(q, k, v, 0.0, False, scale=1.0)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, out, lse = ctx.saved_tensors
        P = k.shape[2]
        width = -(-P // -(-P // BANK_BLOCK))  # even blocks of at most BANK_BLOCK slots
        dq, dk, dv = None, torch.empty_like(k), torch.empty_like(v)
        for s in range(0, P, width):
            blk = slice(s, min(s + width, P))
            gq, gk, gv = _BWD(grad, q, k[:, :, blk], v[:, :, blk], out, lse, 0.0, False,
                                    scale=1.0)
            dk[:, :, blk], dv[:, :, blk] = gk, gv
            dq = gq if dq is None else dq.add_(gq)
        return dq, dk, dv


class _StoredBankAttention(torch.autograd.Function):
    """softmax(q k^T) v for (H, N, hs) fp32 queries and (H, P, hs) banks on CPU through the
    compiled kernel (``mosaics/csrc/bank_attention.cpp``): the forward keeps the probabilities
    (H N P floats), the backward reads them instead of recomputing q k^T and its exp, and every
    product runs in oneDNN's batch-reduce GEMM. ``bench/bank_bound.py`` compares it with
    :class:`_BankAttention`."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        y, *probs = bank_extension().forward(q, k, v, BANK_ROWS)
        ctx.save_for_backward(q, k, v, y, *probs)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, y, *probs = ctx.saved_tensors
        dq, dk, dv = bank_extension().backward(grad.contiguous(), q, k, v, y, probs, BANK_ROWS)
        return dq, dk, dv


def stored_bank_applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :class:`_StoredBankAttention` takes (H, N, hs) fp32 CPU queries and banks:
    their probabilities fit ``STORED_PROBS_MAX_BYTES`` and the kernel builds here."""
    return (q.shape[1] > 0 and q.device.type == "cpu"
            and all(t.dtype == torch.float32 for t in (q, k, v))
            and 4 * q.shape[0] * q.shape[1] * k.shape[1] <= STORED_PROBS_MAX_BYTES
            and bank_extension() is not None)


def bank_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
    """softmax(q k^T) v, unscaled, for (H, N, hs) queries and (H, P, hs) banks. Training on
    CPU without dropout: :class:`_StoredBankAttention` where it applies (fp32, the
    probabilities within ``STORED_PROBS_MAX_BYTES``), else :class:`_BankAttention` above
    ``BANK_BLOCK`` slots; otherwise the fused call, or two batched GEMVs for a few rows
    without gradients (decoding), where the fused call's set-up costs more than the work."""
    if not torch.is_grad_enabled() and dropout_p == 0.0 and q.shape[1] <= SMALL_ROWS:
        return torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1), v)
    training_cpu = (q.device.type == "cpu" and dropout_p == 0.0 and torch.is_grad_enabled()
                    and (q.requires_grad or k.requires_grad or v.requires_grad)
                    and not torch.compiler.is_compiling())  # compiled: the fused call
    if not training_cpu:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=1.0,
                                              dropout_p=dropout_p)[0]
    if torch.is_autocast_enabled("cpu"):  # as F.scaled_dot_product_attention under autocast
        dtype = torch.get_autocast_dtype("cpu")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.autocast("cpu", enabled=False):
        if stored_bank_applies(q, k, v):
            return _StoredBankAttention.apply(q.contiguous(), k.contiguous(), v.contiguous())
        if k.shape[1] > BANK_BLOCK and blocked_attention_available():
            return _BankAttention.apply(q[None], k[None], v[None])[0]
        return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=1.0)[0]


def bank_attention_reference(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q k^T) v written out (no scale, no fused kernel): the formula the fast forms
    are tested against."""
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
