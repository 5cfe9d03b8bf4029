"""Linear + cross-entropy in row chunks, without materialising the (N, V) logits.

    loss = reduce_i [logsumexp_v (h_i W^T)_v - (h_i W^T)_{y_i}]     over rows with y_i != ignore

When gradients are needed the forward also computes them, chunk by chunk (softmax minus
one-hot, then dh = dz W and dW += dz^T h), so the largest temporary is (chunk, V) instead of
the logits, their log-softmax and their gradient, (N, V) each. The backward only scales the
stored gradients by the incoming one. Logits are computed in the autocast dtype when autocast
is on (as ``F.linear`` would) and normalised in fp32.

``linear_cross_entropy_reference`` is the same loss through the (N, V) logits.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(x: Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int,
                reduction: str, chunk: int) -> Tensor:
        dt = _compute_dtype(h)
        acc = torch.promote_types(dt, torch.float32)  # fp32, or fp64 for fp64 inputs
        w = weight.to(dt)
        ctx.dtypes = (h.dtype, weight.dtype)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=acc) if want_w else None
        total = torch.zeros((), device=h.device, dtype=acc)
        count = (labels != ignore_index).sum()
        # then skip masking the gradient rows (compiled: always mask, no host sync)
        all_valid = not torch.compiler.is_compiling() and bool(count == labels.numel())
        for start in range(0, h.shape[0], chunk):
            hc = h[start: start + chunk].to(dt)
            yc = labels[start: start + chunk]
            valid = yc != ignore_index
            target = yc.clamp_min(0)[:, None]  # any index for ignored rows; masked below
            z = (hc @ w.t()).to(acc)  # (c, V)
            target_logit = z.gather(1, target)
            # one exp pass serves both the loss (log-sum-exp) and the gradient (softmax)
            m = z.amax(dim=-1, keepdim=True)
            e = z.sub_(m).exp_()
            s = e.sum(dim=-1, keepdim=True)
            total += ((m + s.log() - target_logit)[:, 0] * valid).sum()
            if want_h or want_w:
                p = e.mul_(s.reciprocal())  # softmax, in place
                p.scatter_add_(1, target, -torch.ones_like(target, dtype=p.dtype))
                if not all_valid:
                    p.mul_(valid[:, None])
                pc = p.to(dt)
                if want_h:
                    grad_h[start: start + chunk] = (pc @ w).to(h.dtype)
                if want_w and dt == acc:
                    grad_w.addmm_(pc.t(), hc)
                elif want_w:  # half-precision GEMM, fp32 accumulation across chunks
                    grad_w.add_(pc.t() @ hc)
        denom = count.clamp_min(1).to(acc) if reduction == "mean" else None
        ctx.save_for_backward(grad_h, grad_w, denom)
        return total / denom if denom is not None else total

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        grad_h, grad_w, denom = ctx.saved_tensors
        scale = g / denom if denom is not None else g
        h_dtype, w_dtype = ctx.dtypes
        gh = (grad_h * scale).to(h_dtype) if grad_h is not None else None
        gw = (grad_w * scale).to(w_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None


def linear_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
                         reduction: str = "mean", chunk_size: int = 1024) -> Tensor:
    """Cross-entropy of ``h @ weight.T`` against ``labels``.

    Args:
        h: (N, d) inputs of the head; weight: (V, d); labels: (N,) ids, ``ignore_index`` skipped.
        reduction: ``"mean"`` over the counted rows, or ``"sum"``.
        chunk_size: rows per chunk; peak extra memory is about chunk_size x V floats.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if h.dim() != 2 or labels.shape != h.shape[:1]:
        raise ValueError(f"expected h (N, d) and labels (N,), got {tuple(h.shape)} and "
                         f"{tuple(labels.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _LinearCrossEntropy.apply(h, weight, labels, ignore_index, reduction, chunk_size)


def linear_cross_entropy_reference(h: Tensor, weight: Tensor, labels: Tensor,
                                   ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """``F.cross_entropy(h @ weight.T, labels)`` through the full logits."""
    logits = (h @ weight.t()).to(torch.promote_types(h.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index,
                                             reduction=reduction)
