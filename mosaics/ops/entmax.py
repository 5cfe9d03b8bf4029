"""Sparse normalizers of score rows: sparsemax, 1.5-entmax and alpha-entmax.

alpha-entmax maps a score row z to the distribution

    p_i = [x_i - tau]_+^r,   x = (alpha - 1)(z - max z),   r = 1 / (alpha - 1),

with tau such that sum_i p_i = 1; sparsemax is the alpha = 2 case and 1.5-entmax the
alpha = 1.5 case (softmax is the limit alpha -> 1). All functions work on the last dimension,
take an optional boolean ``mask`` (True = valid entry, broadcastable to the scores), compute
in fp32 (fp64 stays fp64), subtract the row max before solving for tau, give exactly 0 on
masked entries and output an all-zero row (never NaN) when a row has no valid entry.

Threshold solver (:func:`entmax_tau`), for alpha <= 2 (r >= 1):

1. a lower bound: the entries of a row are cut into 16 strided blocks and the threshold of
   the block maxima alone is solved (a few Newton steps on a row 16x shorter); a subset of the
   entries has a smaller threshold, so tau >= that bound;
2. only blocks whose maximum exceeds the bound can hold the support: they are gathered into a
   narrower tensor when they are at most half of the row;
3. Newton's method on g(tau) = ||[x - tau]_+||_r - 1 from the lower bound. g is convex and
   decreasing, so the iterates increase monotonically to the root; for r = 1 (sparsemax) each
   step is tau <- (sum_{x > tau} x - 1) / #{x > tau} and stops exactly on the sort-based
   solution, for other r the convergence is quadratic (3-4 steps measured at T 1024-4096,
   beta e^2, from the block bound). The r-norm form is exact in one step for a single entry
   and stays well conditioned for large r, where Newton on sum [x - tau]_+^r - 1 crawls.

alpha > 2 (r < 1, g not convex) uses a safeguarded Newton/bisection inside the bracket
[-1, -(1/n)^(alpha-1)]. Rows are renormalized at the end, so they always sum to one.

Backward (the Jacobian-vector product of Peters et al., 2019), with g = p^(2 - alpha) on the
support and 0 elsewhere:  dz = g * dp - g * sum(g * dp) / sum(g).

:func:`entmax` (with :func:`sparsemax` and :func:`entmax15`) is the differentiable form with
that backward; :func:`entmax_reference` is the same map written out (the threshold by
bisection, autograd throughout). The score kernels (:mod:`mosaics.kernels`) and the score
retrievals (:mod:`.score_retrieval`, :mod:`.topk_retrieval`) build on the pieces above.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

BLOCK = 16  # strided blocks per row of the threshold's lower bound
LOWER_BOUND_STEPS = 4  # Newton steps on the block maxima


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


def block_max(x: Tensor) -> Tensor:
    """(..., W / BLOCK) maxima of the strided blocks {j, j + W/BLOCK, j + 2 W/BLOCK, ...} of
    each row; W must be a multiple of BLOCK (a power of 2).

    A max over the second-to-last axis of the (..., BLOCK, W / BLOCK) view vectorizes, unlike
    a max over short contiguous runs, but below 32 blocks its inner loop is too short (1.35 ns
    per entry at 8 blocks vs 0.1 at 32, (16, 96, 128) fp32): there, halve the row
    log2(BLOCK) times, max(x[:w/2], x[w/2:w]) (0.28 ns per entry), which gives the same
    blocks.
    """
    nb = x.shape[-1] // BLOCK
    if nb >= 32:
        return x.unflatten(-1, (BLOCK, nb)).amax(dim=-2)
    width = x.shape[-1]
    while width > nb:
        width //= 2
        x = torch.maximum(x[..., :width], x[..., width:2 * width])
    return x


def entmax_exponent(alpha: float) -> float | int:
    """r = 1 / (alpha - 1), as an int when it is one (integer powers are much faster)."""
    r = 1.0 / (alpha - 1.0)
    return round(r) if abs(r - round(r)) < 1e-9 else r


def power_sums(d: Tensor, r: float, buf: Tensor) -> tuple[Tensor, Tensor]:
    """(sum d^r, sum d^(r-1)) over the last dim of d >= 0, (..., 1) each, d^0 = 1[d > 0].

    ``buf`` (shaped like d) is overwritten: no temporary of the size of d is allocated.
    """
    if r == 1:
        return d.sum(-1, keepdim=True), torch.sign(d, out=buf).sum(-1, keepdim=True)
    if r == 2:
        return (torch.linalg.vector_norm(d, 2, dim=-1, keepdim=True).square(),
                d.sum(-1, keepdim=True))
    torch.pow(d, r - 1, out=buf)
    low = buf.sum(-1, keepdim=True)
    return buf.mul_(d).sum(-1, keepdim=True), low


def newton_tau(x: Tensor, r: float, tau: Tensor, n_iter: int, tol: float | None = None,
               buffers: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Newton's method on g(tau) = (sum_i [x_i - tau]_+^r)^(1/r) - 1 from a lower bound.

    With f = sum d^r and s = sum d^(r-1), d = [x - tau]_+, the step is
    tau <- tau + (f - f^(1 - 1/r)) / s. For r >= 1, g is convex and decreasing: from
    tau <= root the iterates increase to the root. Stops when every step is <= ``tol``
    (default 16 eps; None: run ``n_iter`` steps). Rows without a valid entry keep their tau.
    ``buffers``: two tensors shaped like x, overwritten (allocated when None).
    """
    d, buf = buffers if buffers is not None else (torch.empty_like(x), torch.empty_like(x))
    tol = 16 * torch.finfo(x.dtype).eps if tol is None else tol
    for _ in range(n_iter):
        torch.sub(x, tau, out=d).clamp_min_(0.0)
        f, s = power_sums(d, r, buf)
        step = (f - f.pow(1.0 - 1.0 / r)).div_(s).nan_to_num_(0.0, posinf=0.0, neginf=0.0)
        tau = tau + step
        if bool(step.abs().max() <= tol):
            break
    return tau


def candidate_blocks(x: Tensor, bmax: Tensor, lower: Tensor) -> Tensor:
    """The strided blocks of x whose max exceeds ``lower``, gathered into (..., BLOCK c) with c
    the largest such count over rows (extra blocks are harmless: all their entries are
    <= lower); x itself when that is more than half of the row."""
    nb = bmax.shape[-1]
    c = max(int((bmax > lower).sum(-1).max()), 1) if bmax.numel() else 1
    if 2 * c > nb:
        return x
    idx = bmax.topk(c, dim=-1, sorted=False).indices.unsqueeze(-2)
    blocks = x.unflatten(-1, (BLOCK, nb)).gather(-1, idx.expand(*idx.shape[:-2], BLOCK, c))
    return blocks.flatten(-2)


def _bisect_tau(x: Tensor, alpha: float, n_iter: int) -> Tensor:
    """Threshold for alpha > 2 (r < 1): safeguarded Newton/bisection on f(tau) = sum_i
    [x_i - tau]_+^r - 1, decreasing; the bracket [lo, hi] keeps f(lo) >= 0 >= f(hi)."""
    r = entmax_exponent(alpha)
    tiny = torch.finfo(x.dtype).tiny
    n_valid = torch.isfinite(x).sum(dim=-1, keepdim=True).clamp_min(1).to(x.dtype)
    lo = torch.full_like(n_valid, -1.0)  # f(lo) >= 0: the max entry alone has p = 1
    hi = -(1.0 / n_valid) ** (alpha - 1.0)  # f(hi) <= 0: every p_i <= 1/n
    tau = lo.clone()
    tol = 64 * torch.finfo(x.dtype).eps
    for it in range(n_iter):
        d = (x - tau).clamp_min(0.0)
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


def entmax_tau(x: Tensor, alpha: float, n_iter: int = 50, bmax: Tensor | None = None,
               buffers: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """(..., 1) threshold tau of alpha-entmax: sum_i [x_i - tau]_+^r = 1, r = 1/(alpha - 1).

    Args:
        x: shifted, scaled scores (alpha - 1)(z - max z): max 0 on a row with a valid entry,
            -inf on masked entries; the last dim a multiple of BLOCK.
        alpha: > 1.
        n_iter: cap on the Newton (or, alpha > 2, bisection) steps.
        bmax: :func:`block_max` of x when already known.
        buffers: two tensors shaped like x that the dense iteration may overwrite.
    Rows without a valid entry get tau = -1 (all their weights are 0 anyway).
    """
    r = entmax_exponent(alpha)
    bmax = block_max(x) if bmax is None else bmax
    lower = x.new_full((*x.shape[:-1], 1), -1.0)  # tau >= -1: the max entry has p <= 1
    if r < 1:
        return _bisect_tau(candidate_blocks(x, bmax, lower), alpha, n_iter)
    lower = newton_tau(bmax, r, lower, LOWER_BOUND_STEPS)
    cand = candidate_blocks(x, bmax, lower)
    return newton_tau(cand, r, lower, n_iter, buffers=buffers if cand is x else None)


def pad_to_block(x: Tensor) -> Tensor:
    """x with -inf columns appended up to a multiple of BLOCK columns."""
    pad = -x.shape[-1] % BLOCK
    return torch.nn.functional.pad(x, (0, pad), value=float("-inf")) if pad else x


def entmax_power(d: Tensor, r: float, out: Tensor | None = None) -> Tensor:
    """d^r for d >= 0 (d itself for r = 1), into ``out`` when given."""
    if r == 1:
        return d if out is None else out.copy_(d)
    if r == 2:
        return torch.mul(d, d, out=out) if out is not None else d * d
    return torch.pow(d, r, out=out) if out is not None else d.pow(r)


def entmax_forward(z: Tensor, alpha: float, mask: Tensor | None = None,
                   n_iter: int = 50) -> Tensor:
    """alpha-entmax(z) along the last dim in the work dtype; rows sum to one (renormalized),
    rows without a valid entry are 0. No autograd."""
    check_alpha(alpha)
    width = z.shape[-1]
    x = pad_to_block(shifted_scores(z, mask, scale=alpha - 1.0))
    p = entmax_power((x - entmax_tau(x, alpha, n_iter)).clamp_min_(0.0),
                     entmax_exponent(alpha))[..., :width]
    return p / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)


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
    return _EntmaxFunction.apply(z, 2.0, mask, 50)


def entmax15(z: Tensor, mask: Tensor | None = None) -> Tensor:
    """Differentiable 1.5-entmax over the last dim (custom backward)."""
    return _EntmaxFunction.apply(z, 1.5, mask, 50)


def entmax(z: Tensor, alpha: float, mask: Tensor | None = None, n_iter: int = 50) -> Tensor:
    """Differentiable alpha-entmax (alpha > 1) over the last dim (custom backward)."""
    check_alpha(alpha)
    return _EntmaxFunction.apply(z, float(alpha), mask, n_iter)


def entmax_reference(z: Tensor, alpha: float, mask: Tensor | None = None) -> Tensor:
    """:func:`entmax` written out: x = (alpha - 1)(z - max z), tau with sum_i [x_i - tau]_+^r
    = 1 by bisection in [-1, 0], p = [x - tau]_+^r renormalized; 0 on masked entries and on
    rows without a valid entry. Autograd throughout: the threshold follows x through
    d tau / d x_i = h_i / sum h, h = [x - tau]_+^(r - 1)."""
    r = 1.0 / (alpha - 1.0)
    wd = work_dtype(z.dtype)
    tiny = torch.finfo(wd).tiny
    valid = torch.ones_like(z, dtype=torch.bool) if mask is None else mask.expand(z.shape)
    top = row_max(z.detach().to(wd).masked_fill(~valid, float("-inf")))
    x = (alpha - 1.0) * (z.to(wd) - top)
    with torch.no_grad():
        xm = x.masked_fill(~valid, float("-inf"))
        lo, hi = torch.full_like(top, -1.0), torch.zeros_like(top)
        for _ in range(100):  # sum_i [x_i - tau]_+^r decreases in tau
            mid = (lo + hi) / 2
            big = (xm - mid).clamp_min(0).pow(r).sum(-1, keepdim=True) > 1
            lo, hi = torch.where(big, mid, lo), torch.where(big, hi, mid)
        tau = (lo + hi) / 2
        d = (xm - tau).clamp_min(0)
        h = torch.where(d > 0, d, 1.0).pow(r - 1).masked_fill(d <= 0, 0.0)
        h = h / h.sum(-1, keepdim=True).clamp_min(tiny)
    tau = tau + (h * (x - x.detach())).sum(-1, keepdim=True)
    d = torch.where(valid, x - tau, 0.0)
    p = torch.where(d > 0, torch.where(d > 0, d, 1.0).pow(r), 0.0)
    return (p / p.sum(-1, keepdim=True).clamp_min(tiny)).to(z.dtype)
