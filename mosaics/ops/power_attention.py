"""Power-kernel retrieval over visible intervals, fused (Triton), beside its plain reference.

For queries q_i, keys k_j, values v_j and per-row scales a_i, query i sees the entries
lo_i <= j <= hi_i (clipped to 0..S-1; none when hi_i < lo_i) and retrieves

    c_ij = q_i . k_j,   u_ij = [a_i (c_ij - m_i) - shift_i]_+,   p_ij = u_ij^r,
    y_i  = sum_j p_ij v_j / sum_j p_ij         (0 for a row with no weight),

with the anchor m_i the row max of c_i. over the visible j (``anchor=None``) or a constant,
and shift_i a constant or, ``entmax=True``, the alpha-entmax threshold (alpha = 1 + 1/r) that
makes sum_j p_ij = 1. These are the weights of :class:`~mosaics.kernels.score_kernel.
PowerKernel`: epanechnikov (r 1), biweight (r 2), triweight (r 3) and entmax (r >= 1) with
a = (alpha - 1) beta; relumax (anchor max, shift -b) and epanechnikov_fixed (anchor 1, shift
-1) with a = beta.

:func:`power_attention` runs Triton kernels (:mod:`.triton_kernels.power_attention`): compiled
on CUDA tensors, under Triton's interpreter on CPU tensors (slow: for tests). It keeps O(n) per
row for the backward (m, shift, N) and one byte per (row block, key block) tile (whether the
tile holds any weight: the backward skips the others), never a score matrix. Scores,
thresholds and sums are fp32; bf16/fp16 inputs enter the products as they are (fp32
accumulation), fp32 inputs at about fp32's accuracy (three TF32 products on the GPU,
``tf32x3``; plain TF32 scores would be off by ~1e-3 beta).
:func:`power_attention_reference` is the same map written densely in PyTorch.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .triton_backend import cdiv, kernel_source, pinned_tiles, pow2_at_least, triton_module

KERNELS = kernel_source(__file__, "power_attention")
NEWTON_STEPS = 30  # cap on the threshold's Newton passes (r >= 1: monotone, 3-6 measured)
NEWTON_TOL = 1e-6  # a Newton step below this (scores are O(beta)) ends the passes (fp32)
# ... bf16/fp16 inputs: their scores err by ~2^-8 |c| (x by ~a 4e-3), so a threshold closer
# than 1e-3 buys nothing; after a step this small the next is ~1e-6 (quadratic convergence)
NEWTON_TOL_HALF = 1e-3
# the forward's counts, appended per call while a list (tests, bench/work_model.py):
# {"iters": (B H, row blocks) passes after the row max (Newton's, then the output's unless
# the last Newton pass made it), "live": (B H, row blocks, key blocks) live tiles}
RECORD: list[dict[str, Tensor]] | None = None


def newton_tol(dtype: torch.dtype) -> float:
    """The Newton stopping step for inputs of this dtype."""
    return NEWTON_TOL if dtype in (torch.float32, torch.float64) else NEWTON_TOL_HALF


def newton_pred(r: float, tol: float) -> float:
    """After a Newton step below this, the next pass also makes the output (kept when it ends
    the passes). Steps shrink quadratically for r > 1 (the next after sqrt(tol) is ~tol); for
    r = 1 (sparsemax) Newton is exact once the support is found, after steps up to ~3e-2.
    On gpu_check's inputs (T 4096, bf16 and fp32 tolerances) this saves the output pass of
    0.9-1.0 of the row blocks for 0.0-0.3 value products wasted (docs/notes/
    2026-12-07-work-model.md)."""
    return 3e-2 if r == 1 else tol ** 0.5


def _r_kind(r: float) -> int:
    return int(r) if r in (1.0, 2.0, 3.0) else 0


def _blocks(device: torch.device, d: int, dv: int, dtype: torch.dtype,
            arch: int | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, num_warps) for head size d, value size dv on a
    GPU of compute capability ``arch`` (e.g. 90; default: the device's): the tiles pinned for
    "power" (:func:`~.triton_backend.use_tiles`, ``MOSAICS_TILES``), else this rule, from
    compiles of the launches with their divisibility hints (tests/test_fused_compile.py;
    docs/notes/2026-12-07-work-model.md, "Rows inside one warp"):

    - sm_90 and later: 128 rows, 8 warps (64 keys for bf16/fp16 up to head size 64, else
      32). Each warp then holds whole rows of the score tile (wgmma layout warpsPerCTA
      [8, 1]), so a row's sums and maxima need no shared memory: 41 / 22 / 17 barriers in
      the forward / dq / dkv against 64 / 33 / 21 at 64 x 64 (whose [4, 2] layout splits each
      row over two warpgroups), no stack for bf16 (235 / 211 / 231 registers, biweight with
      ALiBi, with prefetched loads), and less for fp32 (72 / 0 / 304 bytes). The Newton
      passes grow by 0-3% (a block stops with its slowest row).
    - sm_80: 64 x 64 with 8 warps for bf16/fp16 up to head size 64, else 64 x 32 (the
      128-row tiles split rows there too, and spill more at head size 128)."""
    bd = pow2_at_least(d, 16)
    bdv = pow2_at_least(dv, 16)
    pinned = pinned_tiles("power")
    if pinned is not None:
        return pinned["BLOCK_M"], pinned["BLOCK_N"], bd, bdv, pinned["num_warps"]
    if device.type != "cuda":
        return 32, 32, bd, bdv, 1  # the interpreter: fewer, larger numpy operations
    if arch is None:
        major, minor = torch.cuda.get_device_capability(device)
        arch = 10 * major + minor
    wide = dtype == torch.float32 or max(bd, bdv) > 64
    return 128 if arch >= 90 else 64, 32 if wide else 64, bd, bdv, 8


def _ieee(dtype: torch.dtype, device: torch.device) -> bool:
    """Full-fp32 products: for fp32 inputs, and for every dtype under Triton's interpreter
    (CPU tensors), whose bf16/fp16 ``tl.dot`` is wrong (bf16 products are exact in fp32, so
    upcasting first changes only the summation order)."""
    return dtype == torch.float32 or device.type != "cuda"


def _fold(dtype: torch.dtype) -> bool:
    """Whether the kernels form a (c - m) - shift as one multiply-add, a c - (a m + shift):
    for 16-bit inputs, whose weights round far more than a c does (``_u``)."""
    return dtype in (torch.bfloat16, torch.float16)


def _row_bounds(lo: Tensor, hi: Tensor, S: int) -> tuple[Tensor, Tensor]:
    """(B or 1, n) int32 bounds clipped to -1..S, both with the same batch size."""
    lo, hi = torch.broadcast_tensors(lo, hi)
    return (lo.clamp(-1, S).to(torch.int32).contiguous(),
            hi.clamp(-1, S).to(torch.int32).contiguous())


def block_sees(lo: Tensor, hi: Tensor, S: int, block_m: int, block_n: int) -> Tensor:
    """(B or 1, query blocks, key blocks): whether some row of the query block may see some
    key of the key block (the union of the rows' visible columns; the forward's tiles)."""
    nb_q = -(-lo.shape[1] // block_m)
    nb_k = max(1, -(-S // block_n))
    pad = nb_q * block_m - lo.shape[1]
    lo_c, hi_c = lo.clamp_min(0), hi.clamp_max(S - 1)
    empty = hi_c < lo_c
    big = torch.iinfo(torch.int32).max
    lo_b = torch.nn.functional.pad(lo_c.masked_fill(empty, big), (0, pad), value=big)
    hi_b = torch.nn.functional.pad(hi_c.masked_fill(empty, -1), (0, pad), value=-1)
    q_lo = lo_b.view(lo.shape[0], nb_q, block_m).amin(-1)  # (B, nb_q) first visible column
    q_hi = hi_b.view(lo.shape[0], nb_q, block_m).amax(-1)
    k0 = torch.arange(nb_k, device=lo.device) * block_n
    return (q_lo.unsqueeze(-1) <= (k0 + block_n - 1)) & (q_hi.unsqueeze(-1) >= k0)


def _live_lists(live: Tensor, sees: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward's live tiles (``live``, (B H, query blocks, key blocks), inside ``sees``,
    (B or 1, ...), :func:`block_sees`) as lists the backward kernels walk: per query block its
    key blocks, per key block its query blocks, each ascending and padded, with their
    lengths. A loop over a list has its loads prefetched by the compiler; a branch on a flag
    around them does not."""
    BH, nb_q, nb_k = live.shape
    on = (live.view(sees.shape[0], -1, nb_q, nb_k) != 0) & sees.unsqueeze(1)
    on = on.reshape(BH, nb_q, nb_k).to(torch.int8)
    dtype = torch.int16 if max(nb_q, nb_k) < 2**15 else torch.int32

    def lists(flags: Tensor) -> tuple[Tensor, Tensor]:
        order = torch.sort(flags, dim=-1, descending=True, stable=True).indices
        return order.to(dtype).contiguous(), flags.sum(-1, dtype=torch.int32).contiguous()

    return (*lists(on), *lists(on.transpose(1, 2)))


class _PowerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, a: Tensor, bias: Tensor | None,
                lo: Tensor, hi: Tensor, pos0: int, r: float, anchor: float | None,
                shift: float | None, entmax: bool) -> Tensor:
        B, H, n, D = q.shape
        S, DV = k.shape[2], v.shape[-1]
        dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        qf, kf, vf = (x.to(dt).reshape(B * H, x.shape[2], x.shape[3]).contiguous()
                      for x in (q, k, v))
        af = a.to(torch.float32).contiguous()
        bf = af if bias is None else bias.to(torch.float32).contiguous()  # af: an unread stand-in
        lo_i, hi_i = _row_bounds(lo, hi, S)
        bm, bn, bd, bdv, warps = _blocks(q.device, D, DV, dt)
        out = torch.zeros(B * H, n, DV, dtype=torch.float32, device=q.device)
        stats = torch.zeros(3, B * H, n, dtype=torch.float32, device=q.device)  # m, shift, N
        arg = torch.zeros(B * H, n, dtype=torch.int32, device=q.device)
        # one flag per (row block, key block): cleared where a pass finds no weight
        live = torch.ones(B * H, cdiv(n, bm), max(1, cdiv(S, bn)), dtype=torch.int8,
                          device=q.device)
        iters = torch.zeros(B * H, cdiv(n, bm), dtype=torch.int32, device=q.device)
        # the passes' lists of live key blocks (two per row block; the kernel's own scratch)
        lists = torch.empty(*live.shape[:2], 2, live.shape[2], device=q.device,
                            dtype=torch.int16 if live.shape[2] < 2**15 else torch.int32)
        if n and S:
            mod = triton_module(KERNELS)
            mod._power_fwd[(cdiv(n, bm), B * H)](
                qf, kf, vf, af, bf, lo_i, hi_i, out, stats[0], stats[1], stats[2], arg, live,
                lists, iters, qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1),
                vf.stride(0), vf.stride(1), out.stride(0), out.stride(1),
                lo_i.stride(0) if lo_i.shape[0] > 1 else 0, live.stride(0), lists.stride(0),
                H, n, S, D, DV, float(r), float(-1.0 if shift is None else shift),
                float(0.0 if anchor is None else anchor), newton_tol(dt),
                newton_pred(r, newton_tol(dt)), pos0, live.shape[2],
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, BLOCK_DV=bdv, ANCHOR_MAX=anchor is None,
                SOLVE=entmax, R_KIND=_r_kind(r), N_ITER=NEWTON_STEPS, IEEE=_ieee(dt, q.device),
                HAS_BIAS=bias is not None, FOLD=_fold(dt), num_warps=warps)
        ctx.config = (r, anchor, entmax, pos0, bias is not None, (bm, bn, bd, bdv, warps), dt,
                      q.dtype, k.dtype, v.dtype, a.dtype, None if bias is None else bias.dtype)
        if RECORD is not None:
            RECORD.append({"iters": iters.cpu(), "live": live.cpu()})
        ctx.save_for_backward(qf, kf, vf, af, bf, lo_i, hi_i, out, stats, arg, live)
        return out.view(B, H, n, DV).to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):  # noqa: ANN205
        qf, kf, vf, af, bf, lo_i, hi_i, y, stats, arg, live = ctx.saved_tensors
        (r, anchor, entmax, pos0, has_bias, (bm, bn, bd, bdv, warps), dt, q_dt, k_dt, v_dt, a_dt,
         b_dt) = ctx.config
        B, H, n, DV = grad.shape
        BH, S, D = kf.shape
        m, shift, total = stats
        g = grad.reshape(BH, n, DV).to(dt).contiguous()
        valid = total > 0
        safe = torch.where(valid, total, 1.0)
        inv = torch.where(valid, 1.0 / safe, 0.0)
        kappa = torch.where(valid, r * safe.pow(1.0 / r - 1.0) if entmax else r * inv, 0.0)
        c = torch.zeros_like(total) if entmax else (g.float() * y).sum(-1)
        dq = torch.zeros(BH, n, bd, dtype=torch.float32, device=qf.device)
        dk = torch.zeros(BH, S, bd, dtype=torch.float32, device=qf.device)
        dv = torch.zeros(BH, S, bdv, dtype=torch.float32, device=qf.device)
        rsum, rsumj = torch.zeros_like(total), torch.zeros_like(total)
        s_lo = lo_i.stride(0) if lo_i.shape[0] > 1 else 0
        if n and S:
            mod = triton_module(KERNELS)
            common = (qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), vf.stride(0),
                      vf.stride(1), g.stride(0), g.stride(1), s_lo)
            consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": bd, "BLOCK_DV": bdv,
                      "R_KIND": _r_kind(r), "IEEE": _ieee(dt, qf.device), "HAS_BIAS": has_bias,
                      "FOLD": _fold(dt), "num_warps": warps}
            row_list, row_count, col_list, col_count = _live_lists(
                live, block_sees(lo_i, hi_i, S, bm, bn))
            mod._power_bwd_dq[(cdiv(n, bm), BH)](
                qf, kf, vf, g, af, bf, lo_i, hi_i, m, shift, kappa, c, dq, rsum, rsumj, row_list,
                row_count, *common, row_list.stride(0), H, n, S, D, DV, float(r), pos0,
                live.shape[2], SOLVE=entmax, **consts)
            mod._power_bwd_dkv[(cdiv(S, bn), BH)](
                qf, kf, vf, g, af, bf, lo_i, hi_i, m, shift, kappa, c, inv, dk, dv, col_list,
                col_count, *common, col_list.stride(0), H, n, S, D, DV, float(r), live.shape[1],
                pos0, **consts)
        dq, dk, dv = dq[..., :D], dk[..., :D], dv[..., :DV]
        qd = qf.float()
        # with x_ij = a_i (c'_ij - m_i), c' = c - bias_i (t_i - j): sum_j dx_ij c'_ij =
        # q_i . dq~_i - bias_i sum_j dx_ij (t_i - j)
        lag = (torch.arange(n, device=qf.device) + pos0) * rsum - rsumj  # sum_j dx_ij (t_i - j)
        da = (dq * qd).sum(-1) - m * rsum - (bf * lag if has_bias else 0.0)
        dbias = -af * lag if has_bias else None
        dq = dq * af.unsqueeze(-1)
        if anchor is None and not entmax and S:  # m_i = max_j c'_ij moves with c' at its arg max
            coef = -af * rsum
            idx = arg.long().clamp(0, S - 1)
            if has_bias:
                dbias = dbias - coef * (torch.arange(n, device=qf.device) + pos0 - idx)
            coef, idx = coef.unsqueeze(-1), idx.unsqueeze(-1).expand(-1, -1, D)
            dq = dq + coef * kf.float().gather(1, idx)
            dk = dk.scatter_add(1, idx, coef * qd)
        return (dq.view(B, H, n, D).to(q_dt), dk.view(B, H, S, D).to(k_dt),
                dv.view(B, H, S, DV).to(v_dt), da.to(a_dt),
                None if dbias is None else dbias.to(b_dt), None, None, None, None, None, None,
                None)


def power_attention(q: Tensor, k: Tensor, v: Tensor, a: Tensor, lo: Tensor, hi: Tensor, *,
                    r: float, anchor: float | None = None, shift: float | None = None,
                    entmax: bool = False, bias: Tensor | None = None, pos0: int = 0) -> Tensor:
    """Fused power-kernel retrieval (see the module docstring).

    Args:
        q: (B, H, n, D) queries; k: (B, H, S, D) keys; v: (B, H, S, DV) values.
        a: (B H, n) fp32 scale of each query row's scores (differentiable).
        lo, hi: (B or 1, n) integer bounds of the entries each query sees.
        r: the power (> 0; >= 1 with ``entmax``).
        anchor: the constant m_i, or None for the row max.
        shift: the constant shift_i (ignored with ``entmax``).
        entmax: solve shift_i so that the row's weights sum to one.
        bias: optional (B H, n) slope of a linear position bias on the cosines (ALiBi: slope
            m_h / beta_h), c_ij - bias_i (t_i - j) with t_i = i + ``pos0`` (differentiable).
    Returns:
        (B, H, n, DV) in the values' dtype.
    """
    if entmax and r < 1:
        raise ValueError(f"fused entmax needs r >= 1 (alpha <= 2), got r={r}")
    if not entmax and shift is None:
        raise ValueError("power_attention needs a constant shift unless entmax=True")
    B, H, n, _ = q.shape
    if a.shape != (B * H, n):
        raise ValueError(f"a must have shape (B H, n) = ({B * H}, {n}), got {tuple(a.shape)}")
    if bias is not None and bias.shape != a.shape:
        raise ValueError(f"bias must have a's shape {tuple(a.shape)}, got {tuple(bias.shape)}")
    return _PowerAttention.apply(q, k, v, a, bias, lo, hi, int(pos0), float(r), anchor, shift,
                                 entmax)


def power_attention_reference(q: Tensor, k: Tensor, v: Tensor, a: Tensor, lo: Tensor,
                              hi: Tensor, *, r: float, anchor: float | None = None,
                              shift: float | None = None, entmax: bool = False,
                              bias: Tensor | None = None, pos0: int = 0) -> Tensor:
    """The same map as :func:`power_attention`, densely in PyTorch (autograd throughout; the
    entmax threshold by bisection, then one exact renormalization). Computes in the inputs'
    dtype promoted to at least fp32."""
    B, H, n, _ = q.shape
    S = k.shape[2]
    dt = torch.promote_types(q.dtype, torch.float32)
    c = q.to(dt) @ k.to(dt).transpose(-1, -2)  # (B, H, n, S)
    j = torch.arange(S, device=q.device)
    if bias is not None:
        lag = (torch.arange(n, device=q.device) + pos0).view(n, 1) - j  # t_i - j
        c = c - bias.to(dt).view(B, H, n, 1) * lag
    vis = ((j >= lo.unsqueeze(-1)) & (j <= hi.unsqueeze(-1))).unsqueeze(1)  # (B or 1, 1, n, S)
    scale = a.to(dt).view(B, H, n, 1)
    if anchor is None:
        m = c.masked_fill(~vis, float("-inf")).amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    else:
        m = torch.full_like(c[..., :1], anchor)
    x = scale * (c - m)
    if entmax:
        with torch.no_grad():
            xm = x.masked_fill(~vis, float("-inf"))
            lo_t, hi_t = torch.full_like(m, -1.0), torch.zeros_like(m)
            for _ in range(100):  # sum_j [x - tau]_+^r decreases in tau; root in [-1, 0]
                mid = (lo_t + hi_t) / 2
                big = (xm - mid).clamp_min(0).pow(r).sum(-1, keepdim=True) > 1
                lo_t, hi_t = torch.where(big, mid, lo_t), torch.where(big, hi_t, mid)
            tau = (lo_t + hi_t) / 2
            h = torch.where(vis & (xm > tau), (xm - tau).clamp_min(0).pow(r - 1), 0.0)
            h = h / h.sum(-1, keepdim=True).clamp_min(1e-30)
        # the threshold follows x: sum_j [x_j - tau]_+^r = 1 gives d tau / d x_j = h_j / sum h
        tau = tau + (h * (x - x.detach())).sum(-1, keepdim=True)
        u = (x - tau).clamp_min(0)
    else:
        u = (x - shift).clamp_min(0)
    p = torch.where(vis, u.pow(r), 0.0)
    total = p.sum(-1, keepdim=True)
    w = p / torch.where(total > 0, total, torch.ones_like(total))
    return (w @ v.to(dt)).to(v.dtype)
