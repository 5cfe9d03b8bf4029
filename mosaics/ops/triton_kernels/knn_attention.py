"""Triton kernels of kNN retrieval (:mod:`mosaics.ops.knn_attention`); load them through
:func:`mosaics.ops.triton_backend.triton_module`, never by import.

Per (batch x head) row block of BLOCK_M queries, over key blocks of BLOCK_N columns:

- scores s_ij = q_i . k_j (fp32 accumulation), visible where lo_i <= j <= hi_i and j < S
  (the strict past: lo_i = 0, hi_i = i + offset);
- pass 1 (``_knn_fwd``, unless every visible entry is selected): the K_PAD largest visible
  scores of each row, kept sorted in a (BLOCK_M, K_PAD) register tile. Per row, the count of
  a key block's scores above the row's current k-th value: a block where every count is 0 is
  skipped; one where none exceeds INSERTS is inserted value by value (``_insert``: per step
  a row max, a count and a shift; a row with nothing left keeps its run); any other is
  merged: its top K_PAD (bitonic top-k) in ascending order, elementwise max with the tile (a
  bitonic sequence holding the K_PAD largest of both), one bitonic merge. Compiled, the
  network is Triton's own (``tl.topk``, ``tl.bitonic_merge``: bit tricks the compiler lays
  out well); interpreted, the same network from min / max of reshaped pairs
  (``_top_ascending``, ``_merge``: Triton's integer reductions run element by element under
  the interpreter, and the compiler stalls on these reshapes). tau_i = the k-th largest,
  need_i = how many of the top k equal tau_i;
- pass 2: selected = visible and (s > tau, or s == tau among the first need_i such columns);
  jt_i = the column of the last selected tie (-1: none); the running count of the entries
  equal to tau_i goes through a cumsum only in a block where it crosses need_i for some row
  (elsewhere a row takes all of them or none). Gaussian: online softmax of
  beta (s - m) over the selected entries (m the running max); uniform: 1 / count.

Launch order: heaviest first (FlashAttention-2's): ``_knn_fwd`` and ``_knn_bwd_dq`` take
their row blocks from the last (the strict past: the most key blocks) to the first;
``_knn_bwd_dkdv``'s first key block is already the one the most rows see.

Scores multiply in PRECISION ("ieee" for fp32 inputs: the fp32 reference's values), the other
products in PRODUCTS (the same, or "tf32" where PyTorch allows TF32 matmuls).

Saved per row: m, l (the softmax sum, or the count), tau, jt. The backward recomputes the
scores tile by tile with the same tiles and the same dot (so the same fp32 values) and the
selection s > tau or (s == tau and j <= jt): ``_knn_bwd_dkdv`` per key block (dV, and dK for
the softmax), ``_knn_bwd_dq`` per query block (dQ and the per-row bandwidth gradient).
"""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation. "ieee": products in full fp32 (fp32 inputs, and every
    dtype under the interpreter, whose bf16 / fp16 dot is wrong; bf16 products are exact in
    fp32 anyway); "tf32": fp32 inputs as TF32; "native": in the inputs' dtype (bf16 / fp16 on
    the GPU)."""
    if PRECISION == "ieee":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif PRECISION == "tf32":
        return tl.dot(a, b, input_precision="tf32")
    else:
        return tl.dot(a, b)


@triton.jit
def _bounds(LO, HI, rows, n, S, offset, lo_off, HAS_BOUNDS: tl.constexpr):
    """Per-row visible interval [lo, hi]; rows past n see nothing (lo = S, hi = -1)."""
    valid = rows < n
    if HAS_BOUNDS:
        lo = tl.load(LO + lo_off + rows, mask=valid, other=0).to(tl.int32)
        hi = tl.load(HI + lo_off + rows, mask=valid, other=-1).to(tl.int32)
    else:
        lo = tl.full(rows.shape, 0, tl.int32)
        hi = rows + offset
    lo = tl.where(valid, tl.maximum(lo, 0), S)
    hi = tl.where(valid, tl.minimum(hi, S - 1), -1)
    return lo, hi


@triton.jit
def _scores(q, K, k_off, cols, S, HS, dk, PRECISION: tl.constexpr):
    """(BLOCK_M, BLOCK_N) q k^T for the key columns ``cols`` (zero rows past S)."""
    kt = tl.load(K + k_off + cols[:, None] * HS + dk[None, :],
                 mask=(cols[:, None] < S) & (dk[None, :] < HS), other=0.0)
    return _dot(q, tl.trans(kt), PRECISION), kt


@triton.constexpr_function
def _pow2(x: int, e: int) -> int:
    """x 2^e for a whole power-of-two result (e may be negative): a constexpr shape."""
    return x << e if e >= 0 else x >> -e


@triton.jit
def _merge(x, ROWS: tl.constexpr, N: tl.constexpr, LOG: tl.constexpr, FLIP: tl.constexpr,
           DESC: tl.constexpr):
    """Bitonic half-cleaners at distances D = 2^(LOG-1)..1 on x (ROWS, N): each pair of columns
    (c, c + D) in a block of 2D is put in descending order when DESC, ascending otherwise, the
    other way round where c // FLIP is odd (FLIP 0: never; FLIP < N). This sorts each bitonic
    run of 2^LOG columns. Pairs are split off a reshaped axis of 2 and ordered by min / max
    (plain elementwise ops, also fast under the interpreter)."""
    for jj in tl.static_range(LOG):  # distance D = 2^(LOG - 1 - jj)
        a, b = tl.split(tl.permute(tl.reshape(
            x, [_pow2(ROWS * N, -LOG + jj), 2, _pow2(1, LOG - 1 - jj)]), [0, 2, 1]))
        lo = tl.minimum(a, b)
        hi = tl.maximum(a, b)
        if FLIP > 0:
            blk = tl.arange(0, _pow2(ROWS * N, -LOG + jj))[:, None]
            odd = ((blk // _pow2(FLIP, -LOG + jj)) % 2) == 1
            if DESC:
                first, second = tl.where(odd, lo, hi), tl.where(odd, hi, lo)
            else:
                first, second = tl.where(odd, hi, lo), tl.where(odd, lo, hi)
        else:
            if DESC:
                first, second = hi, lo
            else:
                first, second = lo, hi
        x = tl.reshape(tl.permute(tl.join(first, second), [0, 2, 1]), [ROWS, N])
    return x


@triton.jit
def _top_ascending(s, ROWS: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                   LOG_N: tl.constexpr, LOG_K: tl.constexpr):
    """The K largest entries of each row of s (ROWS, N), in ascending order (bitonic top-k):
    sort runs of K columns in alternating directions, then halve: the elementwise max of a
    descending and an ascending run is a bitonic run holding the K largest of both, sorted
    again, until one run is left."""
    x = s
    for i in tl.static_range(1, LOG_K + 1):
        if i < LOG_N:
            x = _merge(x, ROWS, N, i, _pow2(1, i), True)
        else:  # K = N: the last stage sorts the whole row, ascending
            x = _merge(x, ROWS, N, i, 0, False)
    for r in tl.static_range(1, LOG_N - LOG_K + 1):
        x = tl.reshape(tl.max(tl.reshape(x, [ROWS * (N >> r) // K, 2, K]), 1), [ROWS, N >> r])
        if r < LOG_N - LOG_K:
            x = _merge(x, ROWS, N >> r, LOG_K, K, True)
        else:
            x = _merge(x, ROWS, N >> r, LOG_K, 0, False)
    return x


@triton.jit
def _insert(run, cand, steps, kcol):
    """run (ROWS, K_PAD, descending) with the entries of cand (-inf: none) inserted, the
    largest first, ``steps`` (at least the most entries of any row) times: each step puts a
    row's largest remaining value, times its multiplicity, after the run's entries >= it and
    shifts the rest right (the last ones drop out); a row with none left keeps its run."""
    inf = float("inf")
    for _ in range(steps):
        x = tl.max(cand, 1)
        hit = cand == x[:, None]
        c = tl.where(x > -inf, tl.sum(hit.to(tl.int32), 1), 0)
        pos = tl.sum((run >= x[:, None]).to(tl.int32), 1)
        moved = tl.gather(run, tl.maximum(kcol - c[:, None], 0), 1)
        run = tl.where(kcol < pos[:, None], run,
                       tl.where(kcol < (pos + c)[:, None], x[:, None], moved))
        cand = tl.where(hit, -inf, cand)
    return run


@triton.jit
def _knn_fwd(Q, K, V, BETA, LO, HI, OUT, STATS, JT,
             n, S, H, HS, HV, offset, k_top, lo_stride,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_PAD: tl.constexpr,
             HS_PAD: tl.constexpr, HV_PAD: tl.constexpr, UNIFORM: tl.constexpr,
             SELECT_ALL: tl.constexpr, HAS_BOUNDS: tl.constexpr, PRECISION: tl.constexpr,
             PRODUCTS: tl.constexpr,
             LOG_N: tl.constexpr, LOG_K: tl.constexpr, LIBRARY_SORT: tl.constexpr,
             INSERTS: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the last rows (most keys) first
    bh = tl.program_id(1).to(tl.int64)
    beta = tl.load(BETA + bh % H)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dk = tl.arange(0, HS_PAD)
    dv = tl.arange(0, HV_PAD)
    q_off = bh * n * HS
    k_off = bh * S * HS
    v_off = bh * S * HV
    q = tl.load(Q + q_off + rows[:, None] * HS + dk[None, :],
                mask=(rows[:, None] < n) & (dk[None, :] < HS), other=0.0)
    lo, hi = _bounds(LO, HI, rows, n, S, offset, (bh // H) * lo_stride, HAS_BOUNDS)
    start = (tl.maximum(tl.min(lo, 0), 0) // BLOCK_N) * BLOCK_N
    end = tl.minimum(tl.max(hi, 0) + 1, S)
    inf = float("inf")

    # pass 1: tau = the k-th largest visible score of each row
    if SELECT_ALL:
        tau = tl.full([BLOCK_M], -inf, tl.float32)
        need = tl.full([BLOCK_M], 0, tl.int32)
    else:
        kcol = tl.arange(0, K_PAD)[None, :]
        run = tl.full([BLOCK_M, K_PAD], -inf, tl.float32)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            s, kt = _scores(q, K, k_off, cols, S, HS, dk, PRECISION)
            vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])
            s = tl.where(vis, s, -inf)
            kth = tl.max(tl.where(kcol == k_top - 1, run, -inf), 1)
            beat = s > kth[:, None]  # the entries that enter their row's top k
            most = tl.max(tl.sum(beat.to(tl.int32), 1), 0)
            if most > INSERTS:  # some row takes many: the bitonic network
                if LIBRARY_SORT:  # Triton's bitonic top-k and merge (compiled)
                    top = tl.flip(tl.topk(s, K_PAD), 1)
                    run = tl.bitonic_merge(tl.maximum(run, top), descending=True)
                else:  # the same network from min / max (interpreted)
                    top = _top_ascending(s, BLOCK_M, BLOCK_N, K_PAD, LOG_N, LOG_K)
                    run = _merge(tl.maximum(run, top), BLOCK_M, K_PAD, LOG_K, 0, True)
            elif most > 0:  # at most INSERTS per row: inserted one value at a time
                run = _insert(run, tl.where(beat, s, -inf), most, kcol)
        tau = tl.max(tl.where(kcol == k_top - 1, run, -inf), 1)
        need = tl.sum(((kcol < k_top) & (run == tau[:, None])).to(tl.int32), 1)

    # pass 2: weights of the selected entries times the values
    m_i = tl.full([BLOCK_M], -inf, tl.float32)
    l_i = tl.full([BLOCK_M], 0, tl.float32)
    ties = tl.full([BLOCK_M], 0, tl.int32)
    jt = tl.full([BLOCK_M], -1, tl.int32)
    acc = tl.full([BLOCK_M, HV_PAD], 0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        s, kt = _scores(q, K, k_off, cols, S, HS, dk, PRECISION)
        vt = tl.load(V + v_off + cols[:, None] * HV + dv[None, :],
                     mask=(cols[:, None] < S) & (dv[None, :] < HV), other=0.0)
        vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])
        eq = vis & (s == tau[:, None])
        n_eq = tl.sum(eq.to(tl.int32), 1)
        after = ties + n_eq  # entries equal to tau up to this tile's end
        if tl.max(((ties < need) & (after > need)).to(tl.int32), 0) > 0:
            # a row's ties cross its count here: only the first need are taken
            rank = ties[:, None] + tl.cumsum(eq.to(tl.int32), 1)
            take = eq & (rank <= need[:, None])
            last = tl.max(tl.where(eq & (rank == need[:, None]), cols[None, :], -1), 1)
        else:  # each row takes all of its ties here, or none
            take = eq & (after <= need)[:, None]
            last = tl.where((after == need) & (n_eq > 0),
                            tl.max(tl.where(eq, cols[None, :], -1), 1), -1)
        sel = vis & ((s > tau[:, None]) | take)
        jt = tl.maximum(jt, last)
        ties = after
        if UNIFORM:
            w = sel.to(tl.float32)
            l_i += tl.sum(w, 1)
            acc += _dot(w.to(vt.dtype), vt, PRODUCTS)
        else:
            m_new = tl.maximum(m_i, tl.max(tl.where(sel, s, -inf), 1))
            m_safe = tl.where(m_new == -inf, 0.0, m_new)
            alpha = tl.exp(beta * (m_i - m_safe))
            p = tl.where(sel, tl.exp(beta * tl.where(sel, s - m_safe[:, None], 0.0)), 0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, PRODUCTS)
            m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + bh * n * HV + rows[:, None] * HV + dv[None, :],
             out.to(OUT.dtype.element_ty), mask=(rows[:, None] < n) & (dv[None, :] < HV))
    st = STATS + bh * 3 * n + rows
    tl.store(st, m_i, mask=rows < n)
    tl.store(st + n, l_i, mask=rows < n)
    tl.store(st + 2 * n, tau, mask=rows < n)
    tl.store(JT + bh * n + rows, jt, mask=rows < n)


@triton.jit
def _weights(s, cols, lo, hi, m, l, tau, jt, beta, UNIFORM: tl.constexpr):
    """(selected, weights) of a score tile from the saved row statistics."""
    vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])
    sel = vis & ((s > tau[:, None]) | ((s == tau[:, None]) & (cols[None, :] <= jt[:, None])))
    inv = 1.0 / tl.where(l > 0, l, 1.0)
    if UNIFORM:
        p = tl.where(sel, inv[:, None], 0.0)
    else:
        m_safe = tl.where(m == -float("inf"), 0.0, m)
        e = tl.exp(beta * tl.where(sel, s - m_safe[:, None], 0.0))  # no overflow off the support
        p = tl.where(sel, e * inv[:, None], 0.0)
    return sel, p


@triton.jit
def _row_stats(STATS, JT, DELTA, bh, rows, n, UNIFORM: tl.constexpr):
    st = STATS + bh * 3 * n + rows
    valid = rows < n
    m = tl.load(st, mask=valid, other=0.0)
    l = tl.load(st + n, mask=valid, other=0.0)
    tau = tl.load(st + 2 * n, mask=valid, other=float("inf"))
    jt = tl.load(JT + bh * n + rows, mask=valid, other=-1)
    if UNIFORM:
        delta = tl.full(m.shape, 0.0, tl.float32)
    else:
        delta = tl.load(DELTA + bh * n + rows, mask=valid, other=0.0)
    return m, l, tau, jt, delta


@triton.jit
def _knn_bwd_dkdv(Q, K, V, BETA, LO, HI, STATS, JT, DO, DELTA, DK, DV, QB_FIRST, QB_LAST,
                  n, S, H, HS, HV, offset, lo_stride, qb_stride,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HS_PAD: tl.constexpr, HV_PAD: tl.constexpr, UNIFORM: tl.constexpr,
                  HAS_BOUNDS: tl.constexpr, PRECISION: tl.constexpr,
                  PRODUCTS: tl.constexpr):
    """dV = P^T dO and (gaussian) dK = (beta dZ)^T Q, dZ = P (dO V^T - delta), per key block."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    beta = tl.load(BETA + bh % H)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dk = tl.arange(0, HS_PAD)
    dv = tl.arange(0, HV_PAD)
    q_off = bh * n * HS
    k_off = bh * S * HS
    v_off = bh * S * HV
    o_off = bh * n * HV
    kt = tl.load(K + k_off + cols[:, None] * HS + dk[None, :],
                 mask=(cols[:, None] < S) & (dk[None, :] < HS), other=0.0)
    vt = tl.load(V + v_off + cols[:, None] * HV + dv[None, :],
                 mask=(cols[:, None] < S) & (dv[None, :] < HV), other=0.0)
    acc_k = tl.full([BLOCK_N, HS_PAD], 0, tl.float32)
    acc_v = tl.full([BLOCK_N, HV_PAD], 0, tl.float32)
    # the query blocks that may see this key block: from the caller with intervals, else
    # (the strict past) every block from the first row that sees column pid_n * BLOCK_N. No
    # branch on whether a block sees it inside the loop: the compiler prefetches a loop's
    # loads only outside branches (a block in the range that sees nothing adds zeros).
    if HAS_BOUNDS:
        first = tl.load(QB_FIRST + (bh // H) * qb_stride + pid_n)
        last = tl.load(QB_LAST + (bh // H) * qb_stride + pid_n)
    else:
        first = tl.maximum(pid_n * BLOCK_N - offset, 0) // BLOCK_M
        last = (n - 1) // BLOCK_M
    for qb in range(first, last + 1):
        rows = qb * BLOCK_M + tl.arange(0, BLOCK_M)
        lo, hi = _bounds(LO, HI, rows, n, S, offset, (bh // H) * lo_stride, HAS_BOUNDS)
        q = tl.load(Q + q_off + rows[:, None] * HS + dk[None, :],
                    mask=(rows[:, None] < n) & (dk[None, :] < HS), other=0.0)
        do = tl.load(DO + o_off + rows[:, None] * HV + dv[None, :],
                     mask=(rows[:, None] < n) & (dv[None, :] < HV), other=0.0)
        m, l, tau, jt, delta = _row_stats(STATS, JT, DELTA, bh, rows, n, UNIFORM)
        s = _dot(q, tl.trans(kt), PRECISION)
        sel, p = _weights(s, cols, lo, hi, m, l, tau, jt, beta, UNIFORM)
        acc_v += _dot(tl.trans(p.to(do.dtype)), do, PRODUCTS)
        if not UNIFORM:
            dp = _dot(do, tl.trans(vt), PRODUCTS)
            ds = p * (dp - delta[:, None]) * beta
            acc_k += _dot(tl.trans(ds.to(q.dtype)), q, PRODUCTS)
    tl.store(DV + v_off + cols[:, None] * HV + dv[None, :], acc_v.to(DV.dtype.element_ty),
             mask=(cols[:, None] < S) & (dv[None, :] < HV))
    if not UNIFORM:
        tl.store(DK + k_off + cols[:, None] * HS + dk[None, :], acc_k.to(DK.dtype.element_ty),
                 mask=(cols[:, None] < S) & (dk[None, :] < HS))


@triton.jit
def _knn_bwd_dq(Q, K, V, BETA, LO, HI, STATS, JT, DO, DELTA, DQ, DBETA,
                n, S, H, HS, HV, offset, lo_stride,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HS_PAD: tl.constexpr, HV_PAD: tl.constexpr,
                HAS_BOUNDS: tl.constexpr, PRECISION: tl.constexpr,
                  PRODUCTS: tl.constexpr):
    """Gaussian only: dQ = (beta dZ) K and the per-row bandwidth gradient sum_j dZ_ij s_ij."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the last rows (most keys) first
    bh = tl.program_id(1).to(tl.int64)
    beta = tl.load(BETA + bh % H)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dk = tl.arange(0, HS_PAD)
    dv = tl.arange(0, HV_PAD)
    q_off = bh * n * HS
    k_off = bh * S * HS
    v_off = bh * S * HV
    q = tl.load(Q + q_off + rows[:, None] * HS + dk[None, :],
                mask=(rows[:, None] < n) & (dk[None, :] < HS), other=0.0)
    do = tl.load(DO + bh * n * HV + rows[:, None] * HV + dv[None, :],
                 mask=(rows[:, None] < n) & (dv[None, :] < HV), other=0.0)
    m, l, tau, jt, delta = _row_stats(STATS, JT, DELTA, bh, rows, n, False)
    lo, hi = _bounds(LO, HI, rows, n, S, offset, (bh // H) * lo_stride, HAS_BOUNDS)
    start = (tl.maximum(tl.min(lo, 0), 0) // BLOCK_N) * BLOCK_N
    end = tl.minimum(tl.max(hi, 0) + 1, S)
    acc = tl.full([BLOCK_M, HS_PAD], 0, tl.float32)
    db = tl.full([BLOCK_M], 0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        s, kt = _scores(q, K, k_off, cols, S, HS, dk, PRECISION)
        vt = tl.load(V + v_off + cols[:, None] * HV + dv[None, :],
                     mask=(cols[:, None] < S) & (dv[None, :] < HV), other=0.0)
        sel, p = _weights(s, cols, lo, hi, m, l, tau, jt, beta, False)
        dp = _dot(do, tl.trans(vt), PRODUCTS)
        dz = p * (dp - delta[:, None])
        db += tl.sum(tl.where(sel, dz * s, 0.0), 1)
        acc += _dot((dz * beta).to(kt.dtype), kt, PRODUCTS)
    tl.store(DQ + q_off + rows[:, None] * HS + dk[None, :], acc.to(DQ.dtype.element_ty),
             mask=(rows[:, None] < n) & (dk[None, :] < HS))
    tl.store(DBETA + bh * n + rows, db, mask=rows < n)
