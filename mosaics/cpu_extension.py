"""The compiled CPU kernel of the persistent memory's slot banks (``mosaics/csrc``).

Built on first use with :func:`torch.utils.cpp_extension.load` (a C++ compiler and ninja; the
build is cached under ``TORCH_EXTENSIONS_DIR``, about 40 s the first time) for the CPU's
vector capability, then checked on a small problem against the softmax formula. Where any of
that fails the caller falls back to PyTorch's fused attention, with one warning saying why.
``MOSAICS_CPU_EXTENSION=0`` skips the build. Only the training step on CPU uses it
(:func:`mosaics.memory.bank_attention`).
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).parent / "csrc" / "bank_attention.cpp"
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
    if not extension_enabled() or not SOURCE.exists():
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    flags = CAPABILITY_FLAGS.get(capability, [])
    if flags:
        flags = [*flags, f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    try:
        from torch.utils.cpp_extension import load

        module = load(name=f"{NAME}_{capability.lower()}", sources=[str(SOURCE)],
                      extra_cflags=["-O3", "-fopenmp", *flags], verbose=False)
        _check(module)
    except Exception as err:  # no compiler, no ninja, an unsupported CPU, a wrong result
        warnings.warn(f"mosaics: the compiled CPU slot-bank kernel is unavailable "
                      f"({type(err).__name__}: {str(err).strip()[:300]}); the persistent memory "
                      f"uses PyTorch's fused attention instead (set {ENV}=0 to skip the build)",
                      RuntimeWarning, stacklevel=2)
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
