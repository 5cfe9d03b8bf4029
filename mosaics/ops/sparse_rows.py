"""The decoding row of sparsemax attention (the ``epanechnikov`` kernel), compiled on CPU,
beside its reference:

    z_j = beta_h (q . k_j),   y = sum_j [z_j - tau]_+ v_j,   sum_j [z_j - tau]_+ = 1,

for one query per (batch, head) that sees every memory entry. Only entries within 1 of the
row max can have weight; sorted descending, tau = max_k (sum_{i <= k} z_(i) - 1) / k.

:func:`sparsemax_row` runs ``mosaics/csrc/sparse_rows.cpp`` (one pass per row: the scores,
the candidates, their sort, the threshold and the weighted values), built on first use like
the slot-bank kernel (:func:`~.banks.build_extension`; ``MOSAICS_CPU_EXTENSION=0`` skips it).
In PyTorch ops the same row is ~18 small calls (scores, max, count, ``topk``, cumsum, gather,
product): B 1, H 4, 600 entries, head size 64, one thread, 119 against 34 us.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from .banks import build_extension

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "sparse_rows.cpp"
NAME = "mosaics_sparse_rows"


def sparsemax_row_reference(query: Tensor, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
    """The row written out: query (B, H, 1, hs), keys and values (B, H, S, hs), beta (H,) ->
    (B, H, 1, hs), sparsemax of beta q.k over all S entries (a full sort), times V."""
    z = (query @ keys.transpose(-1, -2)) * beta.view(1, -1, 1, 1)
    srt = z.sort(dim=-1, descending=True).values
    k = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype, device=z.device)
    tau = ((srt.cumsum(-1) - 1.0) / k).amax(-1, keepdim=True)
    return (z - tau).clamp_min(0.0) @ values


def _check(module: ModuleType) -> None:
    """Two rows of 70 entries with near ties against the reference; raises on a mismatch."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen) for n in (1, 70, 70))
    k[:, :, 40:] = k[:, :, :1] + 0.05 * k[:, :, 40:]  # many candidates near the query
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    beta = torch.tensor([7.4, 300.0])
    got = module.sparsemax_rows(q.view(2, 8), k.view(2, 70, 8), v.view(2, 70, 8), beta)
    ref = sparsemax_row_reference(q.double(), k.double(), v.double(), beta.double())
    if not torch.allclose(got.double(), ref.view(2, 8), rtol=1e-4, atol=1e-5):
        raise RuntimeError("its results differ from the sparsemax formula")


@functools.cache
def rows_extension() -> ModuleType | None:
    """The compiled module (``sparsemax_rows``), or None (see :func:`~.banks.build_extension`)."""
    return build_extension(SOURCE, NAME, _check, "the compiled sparsemax decoding row",
                           "decoding takes the PyTorch row instead")


def sparsemax_row(query: Tensor, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor | None:
    """:func:`sparsemax_row_reference` through the compiled row, or None where it does not
    apply: not fp32 on CPU, gradients, values of another size than the keys, entries not in
    rows of hs contiguous numbers (the decoding memory's buffers are), or no compiled module
    here."""
    if (query.device.type != "cpu" or torch.is_grad_enabled()
            or any(t.dtype != torch.float32 for t in (query, keys, values, beta))):
        return None
    B, H, S, hs = keys.shape
    if (values.shape[3] != hs or keys.stride(3) != 1 or keys.stride(2) != hs
            or values.stride(3) != 1 or values.stride(2) != hs
            or keys.stride(0) != H * keys.stride(1)
            or values.stride(0) != H * values.stride(1)):
        return None
    module = rows_extension()
    if module is None:
        return None
    y = module.sparsemax_rows(query.reshape(B * H, hs), keys.view(B * H, S, hs),
                              values.view(B * H, S, hs), beta.repeat(B))
    return y.view(B, H, 1, -1)
