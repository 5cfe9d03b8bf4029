"""``torch.compile`` of the model: which parts the compiler traces and where it stops.

The training forward and backward of the v1 block with the ``gaussian`` kernel trace into one
graph (embeddings, leaky averages, unit keys, look-ahead values, strict-past SDPA, the slot
bank, the chunked loss), so inductor fuses the block's element-wise chains. The ops that pick
a CPU-eager fast form (buffers written through ``out=``, a compiled C++ extension, a Python
``bool`` of a tensor) take their plain PyTorch form while compiling (:func:`compiling`).

Retrieval whose plan depends on the data (the sparse kernels' CPU tiles, the v2 memory's
per-query visible intervals) runs eagerly behind :func:`eager_boundary`: one graph break per
memory, with the kernel's own autograd in between. A kernel that traces cleanly says so with
``compile_traceable = True``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .kernels import Kernel


def compiling() -> bool:
    """Whether the code runs under ``torch.compile`` tracing now."""
    return torch.compiler.is_compiling()


def kernel_traceable(kernel: Kernel) -> bool:
    """Whether ``kernel``'s strict-past retrieval (``kernel(keys, values, beta)``) traces
    without a graph break (:attr:`~mosaics.kernels.Kernel.compile_traceable`)."""
    return bool(kernel.compile_traceable)


@torch.compiler.disable
def eager_boundary(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run eagerly (not traced) under ``torch.compile``: one clean graph break
    instead of the many a data-dependent Python loop would make."""
    return fn(*args)


def graph_breaks(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, list[str]]:
    """(graph breaks, their distinct reasons with the user frame) of one call of ``fn`` under
    ``torch._dynamo.explain``; resets dynamo's caches first."""
    torch._dynamo.reset()
    report = torch._dynamo.explain(fn)(*args, **kwargs)
    torch._dynamo.reset()
    reasons = []
    for brk in report.break_reasons:
        frame = brk.user_stack[-1] if brk.user_stack else None
        where = f" ({frame.filename}:{frame.lineno})" if frame is not None else ""
        text = str(brk.reason).splitlines()[0] + where
        if text not in reasons:
            reasons.append(text)
    return report.graph_break_count, reasons


BACKEND_ENV = "MOSAICS_COMPILE_BACKEND"


def compile_backend() -> str:
    """The ``torch.compile`` backend of training: ``inductor``, or ``MOSAICS_COMPILE_BACKEND``
    (``aot_eager`` traces and differentiates the same graphs without generating code)."""
    return os.environ.get(BACKEND_ENV, "inductor")
