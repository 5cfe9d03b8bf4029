"""The model written out one position at a time: the oracle the fast code is tested against.

Nothing here is fast or fused; every formula of :mod:`mosaics.memory` appears as a loop over
positions, with the kernel's weights computed row by row from
:meth:`~mosaics.kernels.Kernel.row_weights`. Run it in float64::

    model = MosaicsForCausalLM(config).double().eval()
    torch.testing.assert_close(model(ids).logits, reference_logits(model, ids))
"""

from __future__ import annotations

import torch
from torch import Tensor

from .memory import EXP_SCALE, ContextualMemory, ShortLongMemory, bandwidth
from .persistent_memory import PersistentMemory, SwiGLUMemory


def _unit(x: Tensor) -> Tensor:
    return x / x.norm().clamp_min(1e-6)


def _row_weights(mem: ContextualMemory, scores: Tensor, beta: Tensor) -> Tensor:
    """Kernel weights of one row of cosines (S,) at bandwidth beta (a scalar tensor)."""
    w, index = mem.kernel.row_weights(scores.view(1, 1, 1, -1), beta.view(1, 1, 1, 1))
    if index is None:
        return w.view(-1)
    full = scores.new_zeros(scores.shape[0])
    return full.index_put_((index.view(-1),), w.view(-1), accumulate=True)


def contextual_memory_reference(mem: ContextualMemory, x: Tensor, gap: int = 1,
                                documents: Tensor | None = None) -> Tensor:
    """y (B, T, d) of a contextual memory for inputs x (B, T, d), one query at a time.

    The query at t sees s in [lo_t, t - gap'] with gap' = ``gap`` for the long-term level
    (else 1), lo_t = max(start of t's document, t - h + 1 for the short-term level, 0).
    """
    B, T, d = x.shape
    H = mem.n_head
    hs = d // H
    wk = mem.k_proj.weight if mem.k_proj is not None else torch.eye(d, dtype=x.dtype)
    wv = mem.v_proj.weight if mem.v_proj is not None else mem.v_fixed.T.to(x.dtype)
    kraw = (x @ wk.T).view(B, T, H, hs)
    vraw = (x @ wv.T).view(B, T, H, hs)
    c, scale = mem.lookahead_c, torch.exp(EXP_SCALE * mem.value_q)
    docs = torch.zeros(B, T, dtype=torch.long) if documents is None else documents
    out = torch.zeros(B, T, H, hs, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            kbar = torch.zeros(hs, dtype=x.dtype)
            keys, vals = [], []
            for t in range(T):
                if t > 0 and docs[b, t] != docs[b, t - 1]:
                    kbar = torch.zeros_like(kbar)
                if mem.gated is not None:
                    g = torch.exp(x[b, t] @ mem.gated.gate.weight[h])
                    lam = torch.exp(-(x[b, t] @ mem.gated.decay.weight[h]
                                      + mem.gated.decay_offset[h]).abs())
                else:
                    g, lam = 1.0, torch.exp(-EXP_SCALE * mem.leaky_p[h].abs())
                kbar = g * kraw[b, t, h] + lam * kbar
                keys.append(_unit(kbar))
                nxt = vraw[b, t + 1, h] if t + 1 < T else torch.zeros(hs, dtype=x.dtype)
                vals.append(_unit((1 - c[h]) * nxt + c[h] * vraw[b, t, h]))
            for t in range(T):
                start = int((docs[b, :t + 1] == docs[b, t]).nonzero()[0])
                lo = max(start, t - mem.window + 1 if mem.window is not None else 0)
                hi = t - (gap if mem.level == "long" else 1)
                if hi < lo:
                    continue
                seen = range(lo, hi + 1)
                if mem.adaptive is not None:
                    a = mem.adaptive
                    alpha = a.theta2[h].abs().clamp(max=1)
                    beta = (torch.exp(a.theta1[h].clamp(max=10)) * len(seen) ** alpha
                            + torch.exp(a.theta0[h].clamp(max=10)))
                else:
                    beta = bandwidth(mem.bandwidth_b)[h]
                beta = mem.kernel.bandwidth(beta)
                scores = torch.stack([keys[t] @ keys[s] for s in seen])
                if mem.alibi:  # beta cos - m (t - s), in cosine units
                    dist = torch.tensor([t - s for s in seen], dtype=x.dtype)
                    if H & (H - 1):
                        raise NotImplementedError("the reference's ALiBi slopes need a "
                                                  "power-of-two number of heads")
                    slope = 2.0 ** (-8.0 * (h + 1) / H)
                    scores = scores - slope * dist / beta
                w = _row_weights(mem, scores, beta)
                out[b, t, h] = scale[h] * sum(w[i] * vals[s] for i, s in enumerate(seen))
    return out.reshape(B, T, d) @ mem.c_proj.weight.T


def persistent_memory_reference(mem: PersistentMemory, x: Tensor,
                                documents: Tensor | None = None) -> Tensor:
    """y (B, T, d) of the slot-bank persistent memory, one position at a time."""
    B, T, d = x.shape
    H = mem.n_head
    hs = d // H
    k = (x @ mem.k_proj.weight.T).view(B, T, H, hs)
    beta = bandwidth(mem.bandwidth_b)
    scale = torch.exp(EXP_SCALE * mem.value_q)
    docs = torch.zeros(B, T, dtype=torch.long) if documents is None else documents
    out = torch.zeros(B, T, H, hs, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            kbar = torch.zeros(hs, dtype=x.dtype)
            for t in range(T):
                if t > 0 and docs[b, t] != docs[b, t - 1]:
                    kbar = torch.zeros_like(kbar)
                kbar = k[b, t, h] + torch.exp(-EXP_SCALE * mem.leaky_p[h].abs()) * kbar
                w = torch.softmax(beta[h] * mem.mem_keys[h] @ _unit(kbar), 0)
                out[b, t, h] = scale[h] * (w @ mem.mem_values[h])
    return out.reshape(B, T, d) @ mem.c_proj.weight.T


def reference_logits(model, input_ids: Tensor, gap: int | None = None,
                     documents: Tensor | None = None) -> Tensor:
    """Logits (B, T, V) of a ``MosaicsForCausalLM`` computed with the references above:
    x = wte(ids); per block x += cmem(LN(x)), x += pmem(LN(x)); logits = LN(x) wte^T / sqrt(d).
    ``gap``: the long-term gap (default: the config's inference value)."""
    cfg = model.config
    gap = cfg.long_term_gap if gap is None else gap
    x = model.model.wte.weight[input_ids]
    for block in model.model.blocks:
        h = block.ln_1(x)
        levels = ([block.cmem.short, block.cmem.long] if isinstance(block.cmem, ShortLongMemory)
                  else [block.cmem])
        x = x + sum(contextual_memory_reference(m, h, gap, documents) for m in levels)
        h = block.ln_2(x)
        if isinstance(block.pmem, SwiGLUMemory):
            x = x + block.pmem(h)[0]
        else:
            x = x + persistent_memory_reference(block.pmem, h, documents)
    return model.model.ln_f(x) @ model.lm_head.weight.T / cfg.n_embd ** 0.5
