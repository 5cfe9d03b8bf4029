"""Sparse normalizers of score rows: sparsemax, 1.5-entmax and alpha-entmax.

alpha-entmax maps a score row z to the distribution

    p_i = [(alpha - 1) z_i - tau]_+^(1 / (alpha - 1)),   tau such that sum_i p_i = 1,

with sparsemax the alpha = 2 case and 1.5-entmax the alpha = 1.5 case (softmax is the limit
alpha -> 1). All functions work on the last dimension, take an optional boolean ``mask``
(True = valid entry, broadcastable to the scores), compute in fp32 (fp64 stays fp64), subtract
the row max before solving for tau, give exactly 0 on masked entries and output an all-zero
row (never NaN) when a row has no valid entry.

Solvers: alpha = 2 and 1.5 are solved exactly by sorting; any other alpha by a safeguarded
Newton iteration on tau inside the bracket [-1, -(1/n)^(alpha-1)] followed by an explicit
renormalization (so rows always sum to one). Only candidates with (alpha - 1)(z_i - max) > -1
can be in the support, so the sort / iteration runs on the top-c entries when that set is small.

Backward (the Jacobian-vector product of Peters et al., 2019), with g = p^(2 - alpha) on the
support and 0 elsewhere:  dz = g * dp - g * sum(g * dp) / sum(g).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype normalizers compute in: float64 stays, everything else becomes float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def shifted_scores(z: Tensor, mask: Tensor | None, scale: float = 1.0,
                   top: Tensor | None = None) -> Tensor:
    """scale * (z - row max) in the work dtype: <= 0 on valid entries, -inf on masked ones.

    Rows with no valid entry are all -inf (their max is taken as 0, never NaN). ``top``
    replaces the row max when given (see :func:`row_max`).
    """
    x = z.to(work_dtype(z.dtype))
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf"))
    x = x - (row_max(x) if top is None else top)
    return x * scale if scale != 1.0 else x


def row_max(x: Tensor) -> Tensor:
    """(..., 1) max of each row over its finite entries; 0 for a row with none."""
    top = x.amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(top), top, torch.zeros_like(top))


def _top_candidates(x: Tensor, sort: bool) -> Tensor:
    """Entries of the shifted row x that can be in the support (x > -1), as a narrower tensor.

    Returns the top-c values (sorted descending if ``sort``) where c is the largest candidate
    count over all rows; falls back to the whole (sorted) row when c is not small.
    """
    n = x.shape[-1]
    c = max(int((x > -1.0).sum(dim=-1).max()) if x.numel() else 1, 1)
    if 4 * c < n:
        return x.topk(c, dim=-1, sorted=sort).values
    return x.sort(dim=-1, descending=True).values if sort else x


def _sparsemax_tau(x: Tensor) -> Tensor:
    """Exact threshold of sparsemax on shifted scores x (sort-based)."""
    srt = _top_candidates(x, sort=True)
    valid = torch.isfinite(srt)
    srt = srt.masked_fill(~valid, 0.0)
    ks = torch.arange(1, srt.shape[-1] + 1, device=x.device, dtype=x.dtype)
    csum = srt.cumsum(dim=-1)
    support = ((1.0 + ks * srt) > csum) & valid
    size = support.sum(dim=-1, keepdim=True)
    return (csum.gather(-1, (size - 1).clamp_min(0)) - 1.0) / size.clamp_min(1).to(x.dtype)


def _entmax15_tau(x: Tensor) -> Tensor:
    """Exact threshold of 1.5-entmax on shifted, halved scores x (sort-based)."""
    srt = _top_candidates(x, sort=True)
    valid = torch.isfinite(srt)
    srt = srt.masked_fill(~valid, 0.0)
    ks = torch.arange(1, srt.shape[-1] + 1, device=x.device, dtype=x.dtype)
    mean = srt.cumsum(dim=-1) / ks
    mean_sq = (srt * srt).cumsum(dim=-1) / ks
    spread = ks * (mean_sq - mean * mean)
    delta = ((1.0 - spread) / ks).clamp_min(0.0)
    tau_k = mean - delta.sqrt()
    support = (tau_k <= srt) & valid
    size = support.sum(dim=-1, keepdim=True)
    return tau_k.gather(-1, (size - 1).clamp_min(0))


def entmax_exponent(alpha: float) -> float | int:
    """r = 1 / (alpha - 1), as an int when it is one (integer powers are much faster)."""
    r = 1.0 / (alpha - 1.0)
    return round(r) if abs(r - round(r)) < 1e-9 else r


def _bisect_tau(x: Tensor, alpha: float, n_iter: int) -> Tensor:
    """Threshold of alpha-entmax on shifted, scaled scores x: safeguarded Newton/bisection.

    f(tau) = sum_i [x_i - tau]_+^r - 1 is decreasing; the bracket [lo, hi] keeps f(lo) >= 0 >=
    f(hi), a Newton step is taken when it stays inside the bracket, bisection otherwise.
    """
    r = entmax_exponent(alpha)
    tiny = torch.finfo(x.dtype).tiny
    cand = _top_candidates(x, sort=False)
    n_valid = torch.isfinite(cand).sum(dim=-1, keepdim=True).clamp_min(1).to(x.dtype)
    lo = torch.full_like(n_valid, -1.0)  # f(lo) >= 0: the max entry alone has p = 1
    hi = -(1.0 / n_valid) ** (alpha - 1.0)  # f(hi) <= 0: every p_i <= 1/n
    tau = lo.clone()
    tol = 64 * torch.finfo(x.dtype).eps
    for it in range(n_iter):
        d = (cand - tau).clamp_min(0.0)
        if isinstance(r, int) and r >= 2:
            d_r1 = d.pow(r - 1)  # d^(r-1), 0 off the support
            f = (d_r1 * d).sum(dim=-1, keepdim=True) - 1.0
            slope = -r * d_r1.sum(dim=-1, keepdim=True)
        else:
            pr = d.pow(r)
            f = pr.sum(dim=-1, keepdim=True) - 1.0
            slope = -r * torch.where(d > 0, pr / d.clamp_min(tiny), 0.0).sum(dim=-1, keepdim=True)
        lo = torch.where(f >= 0, tau, lo)
        hi = torch.where(f < 0, tau, hi)
        newton = tau - f / slope.clamp_max(-tiny)
        inside = (newton >= lo) & (newton <= hi)
        tau = torch.where(inside, newton, 0.5 * (lo + hi))
        if it % 4 == 3 and bool((f.abs() <= tol).all()):
            break
    return tau


def _power(x: Tensor, tau: Tensor, alpha: float) -> Tensor:
    """Unnormalized weights [x - tau]_+^(1/(alpha-1))."""
    d = (x - tau).clamp_min(0.0)
    r = entmax_exponent(alpha)
    return d if r == 1 else d.pow(r)


def _row_total(p: Tensor) -> Tensor:
    return p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)


def entmax_threshold(z: Tensor, alpha: float, mask: Tensor | None = None,
                     n_iter: int = 50) -> tuple[Tensor, Tensor]:
    """alpha-entmax(z) and its (..., 3) row state [max, tau, normalizer]. No autograd.

    Exact sort-based solver for alpha = 2 and 1.5, Newton/bisection otherwise; rows are
    renormalized at the end (sum-to-one whatever the remaining error in tau). The state
    rebuilds the weights in one pass with :func:`entmax_from_threshold` (used by backward).
    """
    check_alpha(alpha)
    x = z.to(work_dtype(z.dtype))
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf"))
    top = row_max(x)
    x = x - top if alpha == 2.0 else (x - top) * (alpha - 1.0)
    if alpha == 2.0:
        tau = _sparsemax_tau(x)
    elif alpha == 1.5:
        tau = _entmax15_tau(x)
    else:
        tau = _bisect_tau(x, alpha, n_iter)
    p = _power(x, tau, alpha)
    total = _row_total(p)
    return p / total, torch.cat([top, tau, total], dim=-1)


def entmax_from_threshold(z: Tensor, alpha: float, mask: Tensor | None,
                          state: Tensor) -> Tensor:
    """The weights of :func:`entmax_threshold` rebuilt from its row state (one pass)."""
    top, tau, total = state.split(1, dim=-1)
    return _power(shifted_scores(z, mask, scale=alpha - 1.0, top=top), tau, alpha) / total


def entmax_forward(z: Tensor, alpha: float, mask: Tensor | None = None,
                   n_iter: int = 50) -> Tensor:
    """alpha-entmax(z) along the last dim; rows sum to one (renormalized). No autograd."""
    return entmax_threshold(z, alpha, mask, n_iter)[0]


def sparsemax_forward(z: Tensor, mask: Tensor | None = None) -> Tensor:
    """sparsemax(z) = [z - tau]_+ (exact, sort-based). No autograd."""
    return entmax_forward(z, 2.0, mask)


def entmax15_forward(z: Tensor, mask: Tensor | None = None) -> Tensor:
    """1.5-entmax(z) = [z/2 - tau]_+^2 (exact, sort-based). No autograd."""
    return entmax_forward(z, 1.5, mask)


def entmax_bisect_forward(z: Tensor, alpha: float, mask: Tensor | None = None,
                          n_iter: int = 50) -> Tensor:
    """alpha-entmax(z) by safeguarded Newton/bisection on tau, whatever alpha. No autograd.

    Rows are renormalized at the end, so every non-empty row sums to one (up to rounding)
    whatever the remaining error in tau.
    """
    check_alpha(alpha)
    x = shifted_scores(z, mask, scale=alpha - 1.0)
    p = _power(x, _bisect_tau(x, alpha, n_iter), alpha)
    return p / _row_total(p)


def entmax_backward(p: Tensor, dp: Tensor, alpha: float) -> Tensor:
    """Vector-Jacobian product of alpha-entmax at output p: dz = g dp - g sum(g dp) / sum(g).

    g = p^(2 - alpha) on the support (p > 0) and 0 elsewhere, so masked entries get exactly 0;
    alpha = 2 gives g = 1[p > 0] (sparsemax), alpha = 1 gives the softmax backward.
    """
    support = p > 0
    if alpha == 2.0:
        g = support.to(p.dtype)
    elif alpha == 1.0:
        g = p
    else:
        g = torch.where(support, p.clamp_min(torch.finfo(p.dtype).tiny).pow(2.0 - alpha), 0.0)
    gdp = g * dp
    total = g.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    return gdp - g * (gdp.sum(dim=-1, keepdim=True) / total)


def check_alpha(alpha: float) -> None:
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 1.0:
        raise ValueError(f"entmax needs alpha > 1 (alpha = 1 + 1/r; alpha = 1 is softmax, use the "
                         f"'gaussian' kernel), got alpha={alpha!r}")


class _EntmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: Tensor, alpha: float, mask: Tensor | None, n_iter: int) -> Tensor:
        p = entmax_forward(z, alpha, mask, n_iter)
        ctx.alpha = alpha
        ctx.save_for_backward(p)
        return p.to(z.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dp: Tensor):  # noqa: ANN205
        (p,) = ctx.saved_tensors
        dz = entmax_backward(p, dp.to(p.dtype), ctx.alpha)
        return dz.to(dp.dtype), None, None, None


def sparsemax(z: Tensor, mask: Tensor | None = None) -> Tensor:
    """Differentiable sparsemax over the last dim (custom backward)."""
    return _EntmaxFunction.apply(z, 2.0, mask, 1)


def entmax15(z: Tensor, mask: Tensor | None = None) -> Tensor:
    """Differentiable 1.5-entmax over the last dim (custom backward)."""
    return _EntmaxFunction.apply(z, 1.5, mask, 1)


def entmax(z: Tensor, alpha: float, mask: Tensor | None = None, n_iter: int = 50) -> Tensor:
    """Differentiable alpha-entmax (alpha > 1) over the last dim (custom backward)."""
    check_alpha(alpha)
    return _EntmaxFunction.apply(z, float(alpha), mask, n_iter)
