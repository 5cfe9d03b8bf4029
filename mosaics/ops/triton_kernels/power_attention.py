"""Triton kernels of the power-kernel retrieval (see :mod:`mosaics.ops.power_attention`).

Per query row i (cosines c_ij = q_i . k_j over its visible entries lo_i <= j <= hi_i, less
bias_i (t_i - j) with HAS_BIAS, t_i = i + pos0):

    x_ij = a_i (c_ij - m_i),  u_ij = [x_ij - shift_i]_+,  p_ij = u_ij^r,  N_i = sum_j p_ij,
    y_i  = sum_j p_ij v_j / N_i   (0 when N_i = 0),

m_i the row max of c (ANCHOR_MAX) or a constant, shift_i a constant or (SOLVE) the
alpha-entmax threshold: Newton on g(tau) = (sum_j [x_ij - tau]_+^r)^(1/r) - 1, one pass over
the row's keys per step, the row sums of [x - tau]_+^r and of its derivative accumulated
elementwise and reduced once per pass. Newton starts below the root and rises to it (g is
convex and decreasing), from the best lower bound the row-max pass gives for free: tau = -1
(x <= 0 and max x = 0), or, for any subset A of the row's entries, by the power mean,

    tau_A = (sum_{j in A} x_ij - |A|^(1 - 1/r)) / |A|   (g(tau_A) >= 0),

with A_k the entries within delta_k / a_i of the running row max when their tile is read
(sum_A x = a (sum_A c - |A| m): accumulated before m is known), delta in {1/2, 1/4} (a
third subset at delta 1 moved the passes by at most 0.01 on gpu_check's keys at beta 1-20,
for 5 of the pass's 17 ops per score).

Every loop walks the key blocks of a block of query rows (only those inside the rows'
intervals); no score block outlives its loop body. Only an edge tile (one some row of the
block does not fully see: the diagonal, an interval's first keys) tests visibility per score.
Live tiles: ``LIVE`` holds one flag per (row block, key block), 1 on entry. A tile where
every u is 0 at a pass's tau is cleared, and since tau only rises it stays dead: later
passes, the output pass and both backward kernels skip its QK^T, not only its value and
gradient products (AdaSplash's block mask). The loops walk the live tiles as lists of block
indices (the forward's in ``LIST``, two buffers per row block, each Newton pass writing the
blocks it finds live for the next; the backward's built from ``LIVE`` by the caller), not
over every block with a branch on its flag: the compiler prefetches the loads of a loop over
a list (software pipelining), never those inside a branch.

Backward (dx = kappa h (dp - c), h = u^(r-1), dp_ij = g_i . v_j):
- ``_power_bwd_dq``, per block of query rows: (SOLVE) c_i = sum h dp / sum h in a first pass,
  then dq~_i = sum_j dx_ij k_j and sum_j dx_ij;
- ``_power_bwd_dkv``, per block of keys, over the query blocks that see them:
  dv_j = sum_i (p_ij / N_i) g_i and dk_j = sum_i a_i dx_ij q_i.

Launch order: heaviest first, as FlashAttention-2 does. ``_power_fwd`` and ``_power_bwd_dq``
take their row blocks from the last (under a causal mask, the most key blocks) to the first;
``_power_bwd_dkv``'s first key block is already the one most query blocks see.

Offsets: the (batch x head) program id is int64, so every pointer argument moves by an int64
offset first (tensors past 2^31 elements; tests/test_fused_offsets.py); rows and columns
inside one (batch, head) slice stay int32.
"""

import os

import triton
import triton.language as tl

_knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; earlier, the environment says
_INTERPRETING = (bool(_knobs.runtime.interpret) if _knobs is not None
                 else os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
FP32_PRECISION: tl.constexpr = tl.constexpr("ieee" if _INTERPRETING else "tf32x3")
# below the subset bound: its sums of up to ~16k fp32 cosines err by ~1e-6 in tau
START_MARGIN: tl.constexpr = tl.constexpr(1e-3)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation. IEEE (fp32 inputs, and any inputs under the interpreter,
    whose bf16 products are wrong): fp32 products, as three TF32 products on a GPU's tensor
    cores (``tf32x3``, about fp32's accuracy; plain IEEE fp32 products spill registers on
    sm_90 at these tiles), exact under the interpreter; else products in the inputs' dtype."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=FP32_PRECISION)
    return tl.dot(a, b)


@triton.jit
def _power(u, R_KIND: tl.constexpr, r):
    """u^r for u >= 0 (R_KIND 1: r = 1, 2: r = 2, 3: r = 3, 0: any r > 0)."""
    if R_KIND == 1:
        return u
    if R_KIND == 2:
        return u * u
    if R_KIND == 3:
        return u * u * u
    return tl.where(u > 0, tl.exp(r * tl.log(tl.maximum(u, 1e-38))), 0.0)


@triton.jit
def _power_m1(u, R_KIND: tl.constexpr, r):
    """h = u^(r-1) on u > 0, 0 elsewhere."""
    if R_KIND == 1:
        return tl.where(u > 0, 1.0, 0.0)
    if R_KIND == 2:
        return u
    if R_KIND == 3:
        return u * u
    return tl.where(u > 0, tl.exp((r - 1.0) * tl.log(tl.maximum(u, 1e-38))), 0.0)


@triton.jit
def _mask(row_ok, col_ok, FULL: tl.constexpr):
    """The load/store mask of a (rows, head columns) tile; FULL: the head fills its block, so
    only the rows are tested (no per-element mask on an interior tile)."""
    if FULL:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & col_ok[None, :]
    return mask


@triton.jit
def _scores(q, k_base, sk_n, j, d_ok, S, bias, t, IEEE: tl.constexpr,
            HAS_BIAS: tl.constexpr, FULL: tl.constexpr):
    """(BLOCK_M, BLOCK_N) fp32 scores of the rows q against the keys j (rows of k_base,
    stride sk_n), with the rows' position bias (``_biased``)."""
    k = tl.load(k_base + j[:, None] * sk_n, mask=_mask(j < S, d_ok, FULL), other=0.0)
    return _biased(_dot(q, tl.trans(k), IEEE), bias, t, j, HAS_BIAS)


@triton.jit
def _any_positive(u):
    """Whether a (BLOCK_M, BLOCK_N) tile of u >= 0 has a nonzero entry."""
    return tl.max(tl.max(u, axis=1), axis=0) > 0


@triton.jit
def _subset_sum(c, m, inv_a, delta):
    """Row sums of c and counts over the entries within delta / a of the running max m."""
    inside = c > (m - delta * inv_a)[:, None]
    return tl.sum(tl.where(inside, c, 0.0), axis=1), tl.sum(inside.to(tl.float32), axis=1)


@triton.jit
def _subset_bound(sc, cnt, a, m, r):
    """tau_A = (a (sum_A c - |A| m) - |A|^(1 - 1/r)) / |A| (-1 for an empty A)."""
    safe = tl.maximum(cnt, 1.0)
    low = (a * (sc - cnt * m) - tl.exp((1.0 - 1.0 / r) * tl.log(safe))) / safe
    return tl.where(cnt > 0, low, -1.0)


@triton.jit
def _biased(c, bias, t, j, HAS_BIAS: tl.constexpr):
    """c - bias_i (t_i - j): a linear position bias (ALiBi) on the cosines. The positions
    are converted before the tile is formed (exact below 2^24), so the tile's distance is
    one float subtraction, not an integer one and a conversion per score."""
    if HAS_BIAS:
        return c - bias[:, None] * (t.to(tl.float32)[:, None] - j.to(tl.float32)[None, :])
    return c


@triton.jit
def _row_bounds(LO, HI, offsets, row_ok, S):
    """The rows' visible columns lo..hi, clipped to 0..S-1 (hi < lo: none)."""
    lo = tl.maximum(tl.load(LO + offsets, mask=row_ok, other=0), 0)
    hi = tl.minimum(tl.load(HI + offsets, mask=row_ok, other=-1), S - 1)
    return lo, hi


@triton.jit
def _edge(j_first, j_last, lo_max, hi_min):
    """Whether some row of the block (visible keys lo..hi, lo_max = max lo, hi_min = min hi)
    does not see some key j_first..j_last of the tile: only such tiles are masked, as
    FlashAttention masks only its diagonal blocks."""
    return (j_first < lo_max) | (j_last > hi_min)


@triton.jit
def _u(c, a, m, shift, lo, hi, j, edge, FOLD: tl.constexpr):
    """u = [a (c - m) - shift]_+ on the visible entries (lo <= j <= hi), 0 elsewhere; a tile
    off the edge skips the mask. FOLD (16-bit inputs): one multiply-add per score,
    a c - (a m + shift); it rounds a c, an error of ~a |c| 2^-24, far below the 2^-9 of the
    bf16 weights it feeds. fp32 inputs keep the exact c - m near the anchor: folded, a
    gradient near the support's edge moved by 2.4e-5 (fixed anchor 1, a 11)."""
    if FOLD:
        x = a[:, None] * c - (a * m + shift)[:, None]
    else:
        x = a[:, None] * (c - m[:, None]) - shift[:, None]
    u = tl.maximum(x, 0.0)
    if edge:
        vis = (j[None, :] >= lo[:, None]) & (j[None, :] <= hi[:, None])
        u = tl.where(vis, u, 0.0)
    return u


@triton.jit
def _newton_pass(q, k_base, sk_n, v_base, sv_n, src, dst, n_list, live_row, d_ok, dv_ok, S,
                 bias, t, a, m, tau, lo, hi, lo_max, hi_min, r, cols, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, R_KIND: tl.constexpr,
                 IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, FULL_D: tl.constexpr,
                 FULL_DV: tl.constexpr, FOLD: tl.constexpr, SPEC: tl.constexpr):
    """One Newton pass at tau over the live key blocks src[:n_list]: the row sums of
    u^r and u^(r-1) (u = [x - tau]_+, accumulated elementwise, reduced once), with SPEC the
    output's sum_j u^r v_j too; the blocks still live are written to dst (their count
    returned), a dead one's flag cleared. No load or product sits in a branch, so the
    compiler prefetches them; a tile dying in this pass adds zeros."""
    f2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    s2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    kept = 0
    for ti in range(0, n_list):
        kb = tl.load(src + ti).to(tl.int32)
        j = kb * BLOCK_N + cols
        c = _scores(q, k_base, sk_n, j, d_ok, S, bias, t, IEEE, HAS_BIAS, FULL_D)
        edge = _edge(kb * BLOCK_N, kb * BLOCK_N + BLOCK_N - 1, lo_max, hi_min)
        d = _u(c, a, m, tau, lo, hi, j, edge, FOLD)
        p = _power(d, R_KIND, r)
        f2 += p
        s2 += _power_m1(d, R_KIND, r)
        if SPEC:
            v = tl.load(v_base + j[:, None] * sv_n, mask=_mask(j < S, dv_ok, FULL_DV),
                        other=0.0)
            acc += _dot(p.to(v.dtype), v, IEEE)
        alive = _any_positive(d)
        tl.store(dst + kept, kb.to(dst.dtype.element_ty))  # kept only if alive
        kept += alive.to(tl.int32)
        if not alive:  # dead at this tau, so at every later one
            tl.store(live_row + kb, 0)
    return tl.sum(f2, axis=1), tl.sum(s2, axis=1), acc, kept


@triton.jit
def _power_fwd(Q, K, V, A, BIAS, LO, HI, OUT, M, SHIFT, NSUM, ARG, LIVE, LIST, ITERS,
               sq_bh, sq_n, sk_bh, sk_n, sv_bh, sv_n, so_bh, so_n, s_lo_b, s_live_bh, s_list_bh,
               H, n, S, D: tl.constexpr, DV: tl.constexpr, r, shift_const, anchor_const, tol,
               pred, pos0, n_kb,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, ANCHOR_MAX: tl.constexpr, SOLVE: tl.constexpr,
               R_KIND: tl.constexpr, N_ITER: tl.constexpr, IEEE: tl.constexpr,
               HAS_BIAS: tl.constexpr, FOLD: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the last rows (most keys) first
    bh = tl.program_id(1).to(tl.int64)
    batch = bh // H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    cols = tl.arange(0, BLOCK_N)

    q = tl.load(Q + bh * sq_bh + rows[:, None] * sq_n + dd[None, :],
                mask=_mask(row_ok, d_ok, D == BLOCK_D), other=0.0)
    lo, hi = _row_bounds(LO, HI, batch * s_lo_b + rows, row_ok, S)
    a = tl.load(A + bh * n + rows, mask=row_ok, other=0.0)
    bias = tl.load(BIAS + bh * n + rows, mask=row_ok, other=0.0)  # read if HAS_BIAS
    t = rows + pos0
    start = (tl.min(tl.where(row_ok & (hi >= lo), lo, S), axis=0) // BLOCK_N) * BLOCK_N
    end = tl.max(tl.where(row_ok, hi, -1), axis=0) + 1  # key blocks [start, end) seen
    lo_max = tl.max(lo, axis=0)  # (rows past n: lo 0, hi -1, so their block is all edge)
    hi_min = tl.min(hi, axis=0)
    k_base = K + bh * sk_bh + dd[None, :]
    live_row = LIVE + bh * s_live_bh + pid_m * n_kb  # this row block's tile flags
    # the live key blocks as a list the passes walk: a loop over a list has its loads
    # prefetched by the compiler, one with a branch around them does not. Two buffers: a
    # pass reads one and writes the blocks it finds live into the other.
    list_a = LIST + bh * s_list_bh + pid_m * (2 * n_kb)
    n_list = tl.maximum((end - start + BLOCK_N - 1) // BLOCK_N, 0)
    for i0 in range(0, n_list, BLOCK_N):
        idx = i0 + cols
        tl.store(list_a + idx, (start // BLOCK_N + idx).to(LIST.dtype.element_ty),
                 mask=idx < n_list)
    tl.debug_barrier()
    cur = 0  # the buffer holding the current list

    # the anchor m: the row max of the visible scores, or a constant; with SOLVE the subset
    # sums of the lower bounds tau_A (delta 1/2, 1/4)
    m = tl.full((BLOCK_M,), anchor_const, tl.float32)
    arg = tl.zeros((BLOCK_M,), tl.int32)
    inv_a = tl.where(a > 0, 1.0 / tl.maximum(a, 1e-38), 0.0)
    sc1 = tl.zeros((BLOCK_M,), tl.float32)
    sc2 = tl.zeros((BLOCK_M,), tl.float32)
    n1 = tl.zeros((BLOCK_M,), tl.float32)
    n2 = tl.zeros((BLOCK_M,), tl.float32)
    if ANCHOR_MAX:
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        for j0 in range(start, end, BLOCK_N):
            j = j0 + cols
            c = _scores(q, k_base, sk_n, j, d_ok, S, bias, t, IEEE, HAS_BIAS,
                        D == BLOCK_D)
            if _edge(j0, j0 + BLOCK_N - 1, lo_max, hi_min):
                vis = (j[None, :] >= lo[:, None]) & (j[None, :] <= hi[:, None])
                c = tl.where(vis, c, float("-inf"))
            bm = tl.max(c, axis=1)
            better = bm > m
            if not SOLVE:  # relumax's backward moves m with c at its arg max; entmax's does not
                arg = tl.where(better, tl.argmax(c, axis=1).to(tl.int32) + j0, arg)
            m = tl.where(better, bm, m)
            if SOLVE:
                s_, c_ = _subset_sum(c, m, inv_a, 0.5)
                sc1 += s_
                n1 += c_
                s_, c_ = _subset_sum(c, m, inv_a, 0.25)
                sc2 += s_
                n2 += c_
        m = tl.where(m == float("-inf"), 0.0, m)

    # the shift: a constant, or the alpha-entmax threshold (Newton from a lower bound)
    shift = tl.full((BLOCK_M,), shift_const, tl.float32)
    it = 0
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    v_base = V + bh * sv_bh + dv[None, :]
    fused = 0  # 1: the last Newton pass also made the output (no output pass)
    if SOLVE:
        tau = tl.full((BLOCK_M,), -1.0, tl.float32)
        if ANCHOR_MAX:  # the best subset bound, less a margin for its fp32 sums
            low = tl.maximum(_subset_bound(sc1, n1, a, m, r), _subset_bound(sc2, n2, a, m, r))
            tau = tl.maximum(tau, low - START_MARGIN)
        tau_used = tau
        last = tl.max(tl.full((BLOCK_M,), float("inf"), tl.float32), axis=0)
        moving = 1
        while (it < N_ITER) & (moving > 0):
            # after a step below ``pred`` this pass is likely the last: it also accumulates
            # the output at its tau, kept if no row then moves by more than tol
            spec = last < pred
            src = list_a + cur * n_kb
            dst = list_a + (1 - cur) * n_kb
            if spec:
                f, s, acc, n_list = _newton_pass(
                    q, k_base, sk_n, v_base, sv_n, src, dst, n_list, live_row, d_ok, dv_ok, S,
                    bias, t, a, m, tau, lo, hi, lo_max, hi_min, r, cols, BLOCK_M, BLOCK_N,
                    BLOCK_DV, R_KIND, IEEE, HAS_BIAS, D == BLOCK_D, DV == BLOCK_DV, FOLD, True)
            else:
                f, s, acc, n_list = _newton_pass(
                    q, k_base, sk_n, v_base, sv_n, src, dst, n_list, live_row, d_ok, dv_ok, S,
                    bias, t, a, m, tau, lo, hi, lo_max, hi_min, r, cols, BLOCK_M, BLOCK_N,
                    BLOCK_DV, R_KIND, IEEE, HAS_BIAS, D == BLOCK_D, DV == BLOCK_DV, FOLD, False)
            cur = 1 - cur
            tl.debug_barrier()  # the next pass reads the list this one wrote
            # g(tau) = f^(1/r) - 1; Newton: tau += (f - f^(1 - 1/r)) / s
            f_low = tl.where(f > 0, tl.exp((1.0 - 1.0 / r) * tl.log(tl.maximum(f, 1e-38))), 0.0)
            step = tl.where(s > 0, (f - f_low) / tl.maximum(s, 1e-38), 0.0)
            tau_used = tau
            total = f
            tau += step
            it += 1
            last = tl.max(tl.abs(step), axis=0)
            moving = tl.sum(tl.where(tl.abs(step) > tol, 1, 0), axis=0)
            fused = tl.where(spec & (moving == 0), 1, 0)
        shift = tl.where(fused > 0, tau_used, tau)

    # the output: y = sum_j p_ij v_j / N_i; the flags left are the backward's live tiles
    if fused == 0:
        acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
        total = tl.zeros((BLOCK_M,), tl.float32)
        src = list_a + cur * n_kb
        for ti in range(0, n_list):
            kb = tl.load(src + ti).to(tl.int32)
            j = kb * BLOCK_N + cols
            c = _scores(q, k_base, sk_n, j, d_ok, S, bias, t, IEEE, HAS_BIAS, D == BLOCK_D)
            edge = _edge(kb * BLOCK_N, kb * BLOCK_N + BLOCK_N - 1, lo_max, hi_min)
            u = _u(c, a, m, shift, lo, hi, j, edge, FOLD)
            v = tl.load(v_base + j[:, None] * sv_n, mask=_mask(j < S, dv_ok, DV == BLOCK_DV),
                        other=0.0)
            p = _power(u, R_KIND, r)  # a dead tile adds zeros (no branch: prefetched loads)
            total += tl.sum(p, axis=1)
            acc += _dot(p.to(v.dtype), v, IEEE)
            if not _any_positive(u):
                tl.store(live_row + kb, 0)
    inv = tl.where(total > 0, 1.0 / tl.maximum(total, 1e-38), 0.0)
    tl.store(OUT + bh * so_bh + rows[:, None] * so_n + dv[None, :], acc * inv[:, None],
             mask=_mask(row_ok, dv_ok, DV == BLOCK_DV))
    stat = bh * n + rows
    tl.store(M + stat, m, mask=row_ok)
    tl.store(SHIFT + stat, shift, mask=row_ok)
    tl.store(NSUM + stat, total, mask=row_ok)
    tl.store(ARG + stat, arg, mask=row_ok)
    tl.store(ITERS + bh * tl.num_programs(0) + pid_m, it + 1 - fused)  # passes after the max


@triton.jit
def _row_stats(A, M, SHIFT, KAPPA, BIAS, stat, row_ok):
    """The forward's per-row statistics the backward reads: a, m, shift, kappa and the bias
    slope."""
    a = tl.load(A + stat, mask=row_ok, other=0.0)
    m = tl.load(M + stat, mask=row_ok, other=0.0)
    shift = tl.load(SHIFT + stat, mask=row_ok, other=0.0)
    kappa = tl.load(KAPPA + stat, mask=row_ok, other=0.0)
    bias = tl.load(BIAS + stat, mask=row_ok, other=0.0)
    return a, m, shift, kappa, bias


@triton.jit
def _dq_tile(list_row, ti, q, g, k_base, sk_n, v_base, sv_n, cols, d_ok, dv_ok, S, bias, t, a,
             m, shift, lo, hi, lo_max, hi_min, r, BLOCK_N: tl.constexpr, R_KIND: tl.constexpr,
             IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, FULL_D: tl.constexpr,
             FULL_DV: tl.constexpr, FOLD: tl.constexpr):
    """The ti-th live key tile of a query block's backward (both dq loops): its columns j,
    keys k, h = u^(r-1) and dp = g v^T."""
    j0 = tl.load(list_row + ti).to(tl.int32) * BLOCK_N
    j = j0 + cols
    k = tl.load(k_base + j[:, None] * sk_n, mask=_mask(j < S, d_ok, FULL_D), other=0.0)
    cs = _biased(_dot(q, tl.trans(k), IEEE), bias, t, j, HAS_BIAS)
    u = _u(cs, a, m, shift, lo, hi, j, _edge(j0, j0 + BLOCK_N - 1, lo_max, hi_min), FOLD)
    v = tl.load(v_base + j[:, None] * sv_n, mask=_mask(j < S, dv_ok, FULL_DV), other=0.0)
    return j, k, _power_m1(u, R_KIND, r), _dot(g, tl.trans(v), IEEE)


@triton.jit
def _power_bwd_dq(Q, K, V, G, A, BIAS, LO, HI, M, SHIFT, KAPPA, C, DQ, RSUM, RSUMJ, LIST,
                  COUNT, sq_bh, sq_n, sk_bh, sk_n, sv_bh, sv_n, sg_bh, sg_n, s_lo_b, s_list_bh,
                  H, n, S, D: tl.constexpr, DV: tl.constexpr, r, pos0, n_kb,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, SOLVE: tl.constexpr, R_KIND: tl.constexpr,
                  IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, FOLD: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the last rows (most keys) first
    bh = tl.program_id(1).to(tl.int64)
    batch = bh // H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    cols = tl.arange(0, BLOCK_N)

    q = tl.load(Q + bh * sq_bh + rows[:, None] * sq_n + dd[None, :],
                mask=_mask(row_ok, d_ok, D == BLOCK_D), other=0.0)
    g = tl.load(G + bh * sg_bh + rows[:, None] * sg_n + dv[None, :],
                mask=_mask(row_ok, dv_ok, DV == BLOCK_DV), other=0.0)
    lo, hi = _row_bounds(LO, HI, batch * s_lo_b + rows, row_ok, S)
    stat = bh * n + rows
    a, m, shift, kappa, bias = _row_stats(A, M, SHIFT, KAPPA, BIAS, stat, row_ok)
    t = rows + pos0
    lo_max = tl.max(lo, axis=0)  # (rows past n: lo 0, hi -1, so their block is all edge)
    hi_min = tl.min(hi, axis=0)
    k_base = K + bh * sk_bh + dd[None, :]
    v_base = V + bh * sv_bh + dv[None, :]
    # the forward's live key blocks of this row block, as a list (``_live_lists``)
    list_row = LIST + bh * s_list_bh + pid_m * n_kb
    n_list = tl.load(COUNT + bh * tl.num_programs(0) + pid_m)

    if SOLVE:  # c_i = sum_j h dp / sum_j h
        num = tl.zeros((BLOCK_M,), tl.float32)
        den = tl.zeros((BLOCK_M,), tl.float32)
        for ti in range(0, n_list):
            j, _, h, dp = _dq_tile(
                list_row, ti, q, g, k_base, sk_n, v_base, sv_n, cols, d_ok, dv_ok, S, bias, t,
                a, m, shift, lo, hi, lo_max, hi_min, r, BLOCK_N, R_KIND, IEEE, HAS_BIAS,
                D == BLOCK_D, DV == BLOCK_DV, FOLD)
            num += tl.sum(h * dp, axis=1)
            den += tl.sum(h, axis=1)
        cc = tl.where(den > 0, num / tl.maximum(den, 1e-38), 0.0)
        tl.store(C + stat, cc, mask=row_ok)
    else:
        cc = tl.load(C + stat, mask=row_ok, other=0.0)

    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    rsum = tl.zeros((BLOCK_M,), tl.float32)
    rsumj = tl.zeros((BLOCK_M,), tl.float32)
    for ti in range(0, n_list):
        j, k, h, dp = _dq_tile(
            list_row, ti, q, g, k_base, sk_n, v_base, sv_n, cols, d_ok, dv_ok, S, bias, t, a,
            m, shift, lo, hi, lo_max, hi_min, r, BLOCK_N, R_KIND, IEEE, HAS_BIAS, D == BLOCK_D,
            DV == BLOCK_DV, FOLD)
        dx = kappa[:, None] * h * (dp - cc[:, None])
        rsum += tl.sum(dx, axis=1)
        if HAS_BIAS:
            rsumj += tl.sum(dx * j[None, :].to(tl.float32), axis=1)
        dq += _dot(dx.to(k.dtype), k, IEEE)
    tl.store(DQ + bh * n * BLOCK_D + rows[:, None] * BLOCK_D + dd[None, :], dq,
             mask=_mask(row_ok, d_ok, D == BLOCK_D))
    tl.store(RSUM + stat, rsum, mask=row_ok)
    if HAS_BIAS:
        tl.store(RSUMJ + stat, rsumj, mask=row_ok)


@triton.jit
def _power_bwd_dkv(Q, K, V, G, A, BIAS, LO, HI, M, SHIFT, KAPPA, C, INV, DK, DV_OUT, LIST,
                   COUNT, sq_bh, sq_n, sk_bh, sk_n, sv_bh, sv_n, sg_bh, sg_n, s_lo_b,
                   s_list_bh, H, n, S, D: tl.constexpr, DV: tl.constexpr, r, n_qb, pos0,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, R_KIND: tl.constexpr, IEEE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, FOLD: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch = bh // H
    j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j_ok = j < S
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    k = tl.load(K + bh * sk_bh + j[:, None] * sk_n + dd[None, :],
                mask=_mask(j_ok, d_ok, D == BLOCK_D), other=0.0)
    v = tl.load(V + bh * sv_bh + j[:, None] * sv_n + dv[None, :],
                mask=_mask(j_ok, dv_ok, DV == BLOCK_DV), other=0.0)
    # the query blocks that see this key block in a live tile of the forward (``_live_lists``)
    list_col = LIST + bh * s_list_bh + pid_n * n_qb
    n_list = tl.load(COUNT + bh * tl.num_programs(0) + pid_n)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dvv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    for ti in range(0, n_list):
        qb = tl.load(list_col + ti).to(tl.int32)
        rows = qb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n
        lo, hi = _row_bounds(LO, HI, batch * s_lo_b + rows, row_ok, S)
        q = tl.load(Q + bh * sq_bh + rows[:, None] * sq_n + dd[None, :],
                    mask=_mask(row_ok, d_ok, D == BLOCK_D), other=0.0)
        g = tl.load(G + bh * sg_bh + rows[:, None] * sg_n + dv[None, :],
                    mask=_mask(row_ok, dv_ok, DV == BLOCK_DV), other=0.0)
        stat = bh * n + rows
        a, m, shift, kappa, bias = _row_stats(A, M, SHIFT, KAPPA, BIAS, stat, row_ok)
        cc = tl.load(C + stat, mask=row_ok, other=0.0)
        inv = tl.load(INV + stat, mask=row_ok, other=0.0)
        cs = _biased(_dot(q, tl.trans(k), IEEE), bias, rows + pos0, j, HAS_BIAS)
        # hi <= S - 1: columns past the keys are not seen (their tile is an edge)
        edge = _edge(pid_n * BLOCK_N, pid_n * BLOCK_N + BLOCK_N - 1, tl.max(lo, axis=0),
                     tl.min(hi, axis=0))
        u = _u(cs, a, m, shift, lo, hi, j, edge, FOLD)
        p = _power(u, R_KIND, r) * inv[:, None]
        dvv += _dot(tl.trans(p).to(g.dtype), g, IEEE)
        dp = _dot(g, tl.trans(v), IEEE)
        dx = (a * kappa)[:, None] * _power_m1(u, R_KIND, r) * (dp - cc[:, None])
        dk += _dot(tl.trans(dx).to(q.dtype), q, IEEE)
    tl.store(DK + bh * S * BLOCK_D + j[:, None] * BLOCK_D + dd[None, :], dk,
             mask=_mask(j_ok, d_ok, D == BLOCK_D))
    tl.store(DV_OUT + bh * S * BLOCK_DV + j[:, None] * BLOCK_DV + dv[None, :], dvv,
             mask=_mask(j_ok, dv_ok, DV == BLOCK_DV))
