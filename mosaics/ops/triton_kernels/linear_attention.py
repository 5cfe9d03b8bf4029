"""Chunked strict-past linear attention: numerator and denominator in one pass.

    y_t = sum_{s<t} (q_t . k_s) v_s / (sum_{s<t} q_t . k_s + eps)

Loaded through :func:`mosaics.ops.triton_backend.triton_module` (never imported directly);
the autograd wrapper is :mod:`mosaics.ops.linear_attention`. Layout: features q, k (BH, T, F),
values v (BH, T, D), all contiguous and of one dtype; C rows per chunk, NC = ceil(T / C)
chunks. Chunk states are fp32, (BH, NC, F, D) and (BH, NC, F); every product accumulates in
fp32. Rows past T, features past F and value columns past D are masked (read as 0, never
written), so no size has to be a power of two.

Forward: ``chunk_states`` (the exclusive prefix states P_c = sum_{s in chunks < c} k_s v_s^T
and z_c = sum k_s, one program per (feature block, value block, bh) walking the chunks),
then ``chunk_forward`` (one program per (chunk, bh)): o = q P_c + A v, den = q z_c + A 1 with
A = strictly lower (q k^T) of the chunk, y = o / (den + eps) (0 where that is 0).
Backward: ``output_grad`` (dn = dy / den', dd = -(dn . y)), ``chunk_states`` reversed
for the suffix states R_c = sum_{t in chunks > c} q_t dn_t^T and r_c = sum q_t dd_t, then
``chunk_backward`` (one program per (chunk, bh)) with dA = strictly lower (dn v^T + dd 1^T):
dq = dA k + dn P_c^T + dd z_c^T, dk = dA^T q + v R_c^T + 1 r_c^T, dv = A^T dn + k R_c.
The ``elu1_*`` kernels are the same three with q = k = ELU(phi(x)) + 1 computed in the kernel
from FSKA's keys and frequencies (see their section below).
"""

import triton
import triton.language as tl


@triton.jit
def _sum(x, axis: tl.constexpr):
    """``tl.sum`` over ``axis``, spelled out so that it also interprets when only this module
    (not Triton's standard library) is loaded under the interpreter."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _op(x, DT: tl.constexpr, DOT: tl.constexpr):
    """x rounded to the inputs' dtype DT, as a ``tl.dot`` operand of dtype DOT (DOT = DT when
    compiled; fp32 for bf16 under the interpreter, whose bf16 ``tl.dot`` multiplies the raw
    bit patterns: triton-lang/triton#11584). bf16 / fp16 products are exact in fp32, so the
    two agree up to the order of the fp32 sums."""
    return x.to(DT).to(DOT)


@triton.jit
def chunk_states(a_ptr, b_ptr, w_ptr, s_ptr, z_ptr, T, F, D, NC,
                 HAS_W: tl.constexpr, REVERSE: tl.constexpr, C: tl.constexpr,
                 BK: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                 DT: tl.constexpr, DOT: tl.constexpr):
    """S_c = sum over the chunks before c (after c when REVERSE) of a^T b (F, D) and
    z_c = sum of a^T w (F,) (w = 1 without HAS_W), for every chunk c: grid (F / BK, D / BD,
    BH). a (BH, T, F), b (BH, T, D), w (BH, T) fp32; S (BH, NC, F, D), z (BH, NC, F) fp32."""
    pf = tl.program_id(0)
    pd = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    f = pf * BK + tl.arange(0, BK)
    d = pd * BD + tl.arange(0, BD)
    r = tl.arange(0, C)
    fm = f < F
    zm = f < tl.where(pd == 0, F, 0)  # one value block writes z
    dm = d < D
    a_base = a_ptr + bh * T * F
    b_base = b_ptr + bh * T * D
    s_base = s_ptr + bh * NC * F * D
    z_base = z_ptr + bh * NC * F
    S = tl.full((BK, BD), 0.0, tl.float32)
    z = tl.full((BK,), 0.0, tl.float32)
    for i in range(NC):
        if REVERSE:
            c = NC - 1 - i
        else:
            c = i
        tl.store(s_base + c * F * D + f[:, None] * D + d[None, :], S,
                 mask=fm[:, None] & dm[None, :])
        tl.store(z_base + c * F + f, z, mask=zm)
        t = c * C + r
        tm = t < T
        a = tl.load(a_base + t[:, None] * F + f[None, :], mask=tm[:, None] & fm[None, :],
                    other=0.0)
        b = tl.load(b_base + t[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :],
                    other=0.0)
        S += tl.dot(tl.trans(_op(a, DT, DOT)), _op(b, DT, DOT), input_precision=PREC)
        if HAS_W:
            w = tl.load(w_ptr + bh * T + t, mask=tm, other=0.0)
        else:
            w = tm.to(tl.float32)
        z += _sum(a.to(tl.float32) * w[:, None], axis=0)


@triton.jit
def chunk_forward(q_ptr, k_ptr, v_ptr, s_ptr, z_ptr, y_ptr, den_ptr, T, F, D, NC, eps,
                  C: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                  DT: tl.constexpr, DOT: tl.constexpr):
    """y (BH, T, D) and den' = den + eps (BH, T) fp32 of one chunk: grid (NC, BH); BD >= D."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, C)
    t = c * C + r
    tm = t < T
    d = tl.arange(0, BD)
    dm = d < D
    q_base = q_ptr + bh * T * F
    k_base = k_ptr + bh * T * F
    s_base = s_ptr + (bh * NC + c) * F * D
    z_base = z_ptr + (bh * NC + c) * F
    A = tl.full((C, C), 0.0, tl.float32)
    o = tl.full((C, BD), 0.0, tl.float32)
    den = tl.full((C,), 0.0, tl.float32)
    for f0 in range(0, F, BK):
        f = f0 + tl.arange(0, BK)
        fm = f < F
        rows = tm[:, None] & fm[None, :]
        q = tl.load(q_base + t[:, None] * F + f[None, :], mask=rows, other=0.0)
        k = tl.load(k_base + t[:, None] * F + f[None, :], mask=rows, other=0.0)
        P = tl.load(s_base + f[:, None] * D + d[None, :], mask=fm[:, None] & dm[None, :],
                    other=0.0)
        z = tl.load(z_base + f, mask=fm, other=0.0)
        qo = _op(q, DT, DOT)
        A += tl.dot(qo, tl.trans(_op(k, DT, DOT)), input_precision=PREC)
        o += tl.dot(qo, _op(P, DT, DOT), input_precision=PREC)
        den += _sum(q.to(tl.float32) * z[None, :], axis=1)
    # A rounded to DT once, for the numerator and the denominator alike (a row whose past
    # is one key then returns that key's value exactly, in any dtype)
    A = _op(tl.where(r[:, None] > r[None, :], A, 0.0), DT, DOT)
    v = tl.load(v_ptr + bh * T * D + t[:, None] * D + d[None, :],
                mask=tm[:, None] & dm[None, :], other=0.0)
    o += tl.dot(A, _op(v, DT, DOT), input_precision=PREC)
    den += _sum(A.to(tl.float32), axis=1) + eps
    y = tl.where(den[:, None] > 0, o / tl.where(den > 0, den, 1.0)[:, None], 0.0)
    tl.store(y_ptr + bh * T * D + t[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty),
             mask=tm[:, None] & dm[None, :])
    tl.store(den_ptr + bh * T + t, den, mask=tm)


@triton.jit
def output_grad(dy_ptr, y_ptr, den_ptr, dn_ptr, dd_ptr, T, D,
                BT: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr):
    """dn = dy / den' (BH, T, D) in the inputs' dtype DT and dd = -(dn . y) (BH, T) fp32 from
    that rounded dn (so that dn . v_s + dd = dn . (v_s - y) cancels where v_s = y), 0 where
    den' = 0 and on row 0: grid (T / BT, BH); BD >= D."""
    pt = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    t = pt * BT + tl.arange(0, BT)
    d = tl.arange(0, BD)
    tm = t < T
    m = tm[:, None] & (d[None, :] < D)
    offs = bh * T * D + t[:, None] * D + d[None, :]
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
    den = tl.load(den_ptr + bh * T + t, mask=tm, other=0.0)
    # row 0 has no past: y_0 = 0 whatever the inputs, and 1 / eps must not reach an fp16 dn
    live = (den > 0) & (t > 0)
    inv = tl.where(live, 1.0 / tl.where(live, den, 1.0), 0.0)
    dn = (dy * inv[:, None]).to(DT).to(tl.float32)
    tl.store(dn_ptr + offs, dn, mask=m)
    tl.store(dd_ptr + bh * T + t, -_sum(dn * y, axis=1), mask=tm)


@triton.jit
def chunk_backward(q_ptr, k_ptr, v_ptr, dn_ptr, dd_ptr, s_ptr, z_ptr, rs_ptr, rz_ptr,
                   dq_ptr, dk_ptr, dv_ptr, T, F, D, NC, SHARED: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                   DT: tl.constexpr, DOT: tl.constexpr):
    """dq, dk (BH, T, F) and dv (BH, T, D) of one chunk: grid (NC, BH); BD >= D. (P, z) are
    the forward's prefix states, (R, r) = (rs, rz) the suffix states of (dn, dd). SHARED
    (q and k one tensor): dq + dk is written to dq_ptr."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, C)
    t = c * C + r
    tm = t < T
    d = tl.arange(0, BD)
    dm = d < D
    td = tm[:, None] & dm[None, :]
    q_base = q_ptr + bh * T * F
    k_base = k_ptr + bh * T * F
    state = (bh * NC + c) * F
    strict = r[:, None] > r[None, :]
    A = tl.full((C, C), 0.0, tl.float32)
    for f0 in range(0, F, BK):
        f = f0 + tl.arange(0, BK)
        rows = tm[:, None] & (f[None, :] < F)
        q = tl.load(q_base + t[:, None] * F + f[None, :], mask=rows, other=0.0)
        k = tl.load(k_base + t[:, None] * F + f[None, :], mask=rows, other=0.0)
        A += tl.dot(_op(q, DT, DOT), tl.trans(_op(k, DT, DOT)), input_precision=PREC)
    A = _op(tl.where(strict, A, 0.0), DT, DOT)
    v = _op(tl.load(v_ptr + bh * T * D + t[:, None] * D + d[None, :], mask=td, other=0.0),
            DT, DOT)
    dn = _op(tl.load(dn_ptr + bh * T * D + t[:, None] * D + d[None, :], mask=td, other=0.0),
             DT, DOT)
    dd = tl.load(dd_ptr + bh * T + t, mask=tm, other=0.0)
    dA = tl.dot(dn, tl.trans(v), input_precision=PREC) + dd[:, None]
    dA = _op(tl.where(strict, dA, 0.0), DT, DOT)
    dv = tl.dot(tl.trans(A), dn, input_precision=PREC)
    for f0 in range(0, F, BK):
        f = f0 + tl.arange(0, BK)
        fm = f < F
        rows = tm[:, None] & fm[None, :]
        fd = fm[:, None] & dm[None, :]
        q = _op(tl.load(q_base + t[:, None] * F + f[None, :], mask=rows, other=0.0), DT, DOT)
        k = _op(tl.load(k_base + t[:, None] * F + f[None, :], mask=rows, other=0.0), DT, DOT)
        P = _op(tl.load(s_ptr + state * D + f[:, None] * D + d[None, :], mask=fd, other=0.0),
                DT, DOT)
        R = _op(tl.load(rs_ptr + state * D + f[:, None] * D + d[None, :], mask=fd, other=0.0),
                DT, DOT)
        z = tl.load(z_ptr + state + f, mask=fm, other=0.0)
        rz = tl.load(rz_ptr + state + f, mask=fm, other=0.0)
        dq = tl.dot(dA, k, input_precision=PREC)
        dq += tl.dot(dn, tl.trans(P), input_precision=PREC)
        dq += dd[:, None] * z[None, :]
        dk = tl.dot(tl.trans(dA), q, input_precision=PREC)
        dk += tl.dot(v, tl.trans(R), input_precision=PREC)
        dk += rz[None, :]
        dv += tl.dot(k, R, input_precision=PREC)
        offs = bh * T * F + t[:, None] * F + f[None, :]
        if SHARED:
            tl.store(dq_ptr + offs, (dq + dk).to(dq_ptr.dtype.element_ty), mask=rows)
        else:
            tl.store(dq_ptr + offs, dq.to(dq_ptr.dtype.element_ty), mask=rows)
            tl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=rows)
    tl.store(dv_ptr + bh * T * D + t[:, None] * D + d[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=td)


# -- the ELU+1 feature map inside the chunk kernels ----------------------------------------
# Features g(x) = ELU(phi(x)) + 1 of FSKA's keys x (BH, T, HS) fp32 with its frequency pairs
# w1, w2 (H, M, HS) fp32, phi = scale [cos a1 + cos a2 ; sin a1 + sin a2], a_i = x w_i^T,
# scale = (4M)^-1/2: feature m (cos part) and M + m (sin part), F = 2M. The angles are fp32
# products (APREC: "ieee", or "tf32x3" on tensor cores); the features are rounded to DT where
# they enter the attention products, as the inputs of the kernels above.


@triton.jit
def _angles(x, w_base, m, s, M, HS, APREC: tl.constexpr):
    """x (C, BS) fp32 times the frequencies w_base[m] (BM, HS) transposed: (C, BM) fp32, and
    that block of frequencies (BM, BS) fp32 (masked rows and columns read as 0)."""
    w = tl.load(w_base + m[:, None] * HS + s[None, :], mask=(m < M)[:, None] & (s < HS)[None, :],
                other=0.0)
    return tl.dot(x, tl.trans(w), input_precision=APREC), w


@triton.jit
def _elu1(c1, s1, c2, s2, live, scale):
    """(g_cos, g_sin) = ELU(phi) + 1 of both halves from the angles' cosines and sines, 0
    where not ``live`` (rows past T, frequencies past M)."""
    pc = (c1 + c2) * scale
    ps = (s1 + s2) * scale
    gc = tl.where(pc > 0, pc + 1.0, tl.exp(tl.minimum(pc, 0.0)))
    gs = tl.where(ps > 0, ps + 1.0, tl.exp(tl.minimum(ps, 0.0)))
    return tl.where(live, gc, 0.0), tl.where(live, gs, 0.0)


@triton.jit
def _features(x, w1_base, w2_base, m, s, M, HS, live, scale, APREC: tl.constexpr):
    """(g_cos, g_sin) (C, BM) of the keys x (C, BS) for the frequencies m of both sets."""
    a1, _ = _angles(x, w1_base, m, s, M, HS, APREC)
    a2, _ = _angles(x, w2_base, m, s, M, HS, APREC)
    return _elu1(tl.cos(a1), tl.sin(a1), tl.cos(a2), tl.sin(a2), live, scale)


@triton.jit
def elu1_chunk_states(x_ptr, w1_ptr, w2_ptr, b_ptr, w_ptr, s_ptr, z_ptr, T, M, HS, D, NC, H,
                      scale, HAS_W: tl.constexpr, REVERSE: tl.constexpr, C: tl.constexpr,
                      BM: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
                      PREC: tl.constexpr, APREC: tl.constexpr, DT: tl.constexpr,
                      DOT: tl.constexpr):
    """``chunk_states`` with a = g(x) computed here: grid (M / BM, D / BD, BH); S (BH, NC,
    2M, D), z (BH, NC, 2M) fp32, rows m and M + m of each frequency block."""
    pm = tl.program_id(0)
    pd = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    h = bh % H
    m = pm * BM + tl.arange(0, BM)
    s = tl.arange(0, BS)
    d = pd * BD + tl.arange(0, BD)
    r = tl.arange(0, C)
    F = 2 * M
    mm = m < M
    zm = m < tl.where(pd == 0, M, 0)  # one value block writes z
    dm = d < D
    x_base = x_ptr + bh * T * HS
    b_base = b_ptr + bh * T * D
    s_base = s_ptr + bh * NC * F * D
    z_base = z_ptr + bh * NC * F
    w1_base = w1_ptr + h * M * HS
    w2_base = w2_ptr + h * M * HS
    Sc = tl.full((BM, BD), 0.0, tl.float32)
    Ss = tl.full((BM, BD), 0.0, tl.float32)
    zc = tl.full((BM,), 0.0, tl.float32)
    zs = tl.full((BM,), 0.0, tl.float32)
    for i in range(NC):
        if REVERSE:
            c = NC - 1 - i
        else:
            c = i
        sm = mm[:, None] & dm[None, :]
        tl.store(s_base + c * F * D + m[:, None] * D + d[None, :], Sc, mask=sm)
        tl.store(s_base + c * F * D + (M + m)[:, None] * D + d[None, :], Ss, mask=sm)
        tl.store(z_base + c * F + m, zc, mask=zm)
        tl.store(z_base + c * F + M + m, zs, mask=zm)
        t = c * C + r
        tm = t < T
        x = tl.load(x_base + t[:, None] * HS + s[None, :], mask=tm[:, None] & (s < HS)[None, :],
                    other=0.0)
        gc, gs = _features(x, w1_base, w2_base, m, s, M, HS, tm[:, None] & mm[None, :], scale,
                           APREC)
        b = _op(tl.load(b_base + t[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :],
                        other=0.0), DT, DOT)
        Sc += tl.dot(tl.trans(_op(gc, DT, DOT)), b, input_precision=PREC)
        Ss += tl.dot(tl.trans(_op(gs, DT, DOT)), b, input_precision=PREC)
        if HAS_W:
            w = tl.load(w_ptr + bh * T + t, mask=tm, other=0.0)
        else:
            w = tm.to(tl.float32)
        zc += _sum(gc * w[:, None], axis=0)
        zs += _sum(gs * w[:, None], axis=0)


@triton.jit
def elu1_chunk_forward(x_ptr, w1_ptr, w2_ptr, v_ptr, s_ptr, z_ptr, y_ptr, den_ptr, T, M, HS,
                       D, NC, H, scale, eps, C: tl.constexpr, BM: tl.constexpr,
                       BS: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                       APREC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr):
    """``chunk_forward`` with q = k = g(x) computed here: grid (NC, BH); BS >= HS, BD >= D."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    h = bh % H
    r = tl.arange(0, C)
    t = c * C + r
    tm = t < T
    s = tl.arange(0, BS)
    d = tl.arange(0, BD)
    dm = d < D
    F = 2 * M
    x = tl.load(x_ptr + bh * T * HS + t[:, None] * HS + s[None, :],
                mask=tm[:, None] & (s < HS)[None, :], other=0.0)
    s_base = s_ptr + (bh * NC + c) * F * D
    z_base = z_ptr + (bh * NC + c) * F
    w1_base = w1_ptr + h * M * HS
    w2_base = w2_ptr + h * M * HS
    A = tl.full((C, C), 0.0, tl.float32)
    o = tl.full((C, BD), 0.0, tl.float32)
    den = tl.full((C,), 0.0, tl.float32)
    for m0 in range(0, M, BM):
        m = m0 + tl.arange(0, BM)
        mm = m < M
        gc, gs = _features(x, w1_base, w2_base, m, s, M, HS, tm[:, None] & mm[None, :], scale,
                           APREC)
        sm = mm[:, None] & dm[None, :]
        Pc = tl.load(s_base + m[:, None] * D + d[None, :], mask=sm, other=0.0)
        Ps = tl.load(s_base + (M + m)[:, None] * D + d[None, :], mask=sm, other=0.0)
        zc = tl.load(z_base + m, mask=mm, other=0.0)
        zs = tl.load(z_base + M + m, mask=mm, other=0.0)
        gco = _op(gc, DT, DOT)
        gso = _op(gs, DT, DOT)
        A += tl.dot(gco, tl.trans(gco), input_precision=PREC)
        A += tl.dot(gso, tl.trans(gso), input_precision=PREC)
        o += tl.dot(gco, _op(Pc, DT, DOT), input_precision=PREC)
        o += tl.dot(gso, _op(Ps, DT, DOT), input_precision=PREC)
        den += _sum(gc * zc[None, :] + gs * zs[None, :], axis=1)
    A = _op(tl.where(r[:, None] > r[None, :], A, 0.0), DT, DOT)
    v = tl.load(v_ptr + bh * T * D + t[:, None] * D + d[None, :],
                mask=tm[:, None] & dm[None, :], other=0.0)
    o += tl.dot(A, _op(v, DT, DOT), input_precision=PREC)
    den += _sum(A.to(tl.float32), axis=1) + eps
    y = tl.where(den[:, None] > 0, o / tl.where(den > 0, den, 1.0)[:, None], 0.0)
    tl.store(y_ptr + bh * T * D + t[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty),
             mask=tm[:, None] & dm[None, :])
    tl.store(den_ptr + bh * T + t, den, mask=tm)


@triton.jit
def elu1_chunk_backward(x_ptr, w1_ptr, w2_ptr, v_ptr, dn_ptr, dd_ptr, s_ptr, z_ptr, rs_ptr,
                        rz_ptr, dx_ptr, dw1_ptr, dw2_ptr, dv_ptr, T, M, HS, D, NC, H, scale,
                        C: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
                        BD: tl.constexpr, PREC: tl.constexpr, APREC: tl.constexpr,
                        DT: tl.constexpr, DOT: tl.constexpr):
    """``chunk_backward`` (SHARED) with q = k = g(x) computed here, its gradient dg taken on
    to the angles (ELU' = min(g, 1)) and from there to x (dx (BH, T, HS), written) and to the
    frequencies (dw1, dw2 (H, M, HS) fp32, added atomically over chunks and batch): grid
    (NC, BH); BS >= HS, BD >= D."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    h = bh % H
    r = tl.arange(0, C)
    t = c * C + r
    tm = t < T
    s = tl.arange(0, BS)
    sk = s < HS
    d = tl.arange(0, BD)
    dm = d < D
    td = tm[:, None] & dm[None, :]
    F = 2 * M
    x = tl.load(x_ptr + bh * T * HS + t[:, None] * HS + s[None, :], mask=tm[:, None] & sk[None, :],
                other=0.0)
    state = (bh * NC + c) * F
    w1_base = w1_ptr + h * M * HS
    w2_base = w2_ptr + h * M * HS
    strict = r[:, None] > r[None, :]
    A = tl.full((C, C), 0.0, tl.float32)
    for m0 in range(0, M, BM):
        m = m0 + tl.arange(0, BM)
        gc, gs = _features(x, w1_base, w2_base, m, s, M, HS, tm[:, None] & (m < M)[None, :], scale,
                           APREC)
        gco = _op(gc, DT, DOT)
        gso = _op(gs, DT, DOT)
        A += tl.dot(gco, tl.trans(gco), input_precision=PREC)
        A += tl.dot(gso, tl.trans(gso), input_precision=PREC)
    A = _op(tl.where(strict, A, 0.0), DT, DOT)
    v = _op(tl.load(v_ptr + bh * T * D + t[:, None] * D + d[None, :], mask=td, other=0.0),
            DT, DOT)
    dn = _op(tl.load(dn_ptr + bh * T * D + t[:, None] * D + d[None, :], mask=td, other=0.0),
             DT, DOT)
    dd = tl.load(dd_ptr + bh * T + t, mask=tm, other=0.0)
    dA = tl.dot(dn, tl.trans(v), input_precision=PREC) + dd[:, None]
    dA = _op(tl.where(strict, dA, 0.0), DT, DOT)
    dAt = tl.trans(dA)
    dv = tl.dot(tl.trans(A), dn, input_precision=PREC)
    dx = tl.full((C, BS), 0.0, tl.float32)
    for m0 in range(0, M, BM):
        m = m0 + tl.arange(0, BM)
        mm = m < M
        a1, w1 = _angles(x, w1_base, m, s, M, HS, APREC)
        a2, w2 = _angles(x, w2_base, m, s, M, HS, APREC)
        c1, s1, c2, s2 = tl.cos(a1), tl.sin(a1), tl.cos(a2), tl.sin(a2)
        gc, gs = _elu1(c1, s1, c2, s2, tm[:, None] & mm[None, :], scale)
        gco = _op(gc, DT, DOT)
        gso = _op(gs, DT, DOT)
        sm = mm[:, None] & dm[None, :]
        Pc = _op(tl.load(s_ptr + state * D + m[:, None] * D + d[None, :], mask=sm, other=0.0),
                 DT, DOT)
        Ps = _op(tl.load(s_ptr + state * D + (M + m)[:, None] * D + d[None, :], mask=sm,
                         other=0.0), DT, DOT)
        Rc = _op(tl.load(rs_ptr + state * D + m[:, None] * D + d[None, :], mask=sm, other=0.0),
                 DT, DOT)
        Rs = _op(tl.load(rs_ptr + state * D + (M + m)[:, None] * D + d[None, :], mask=sm,
                         other=0.0), DT, DOT)
        zc = tl.load(z_ptr + state + m, mask=mm, other=0.0)
        zs = tl.load(z_ptr + state + M + m, mask=mm, other=0.0)
        rzc = tl.load(rz_ptr + state + m, mask=mm, other=0.0)
        rzs = tl.load(rz_ptr + state + M + m, mask=mm, other=0.0)
        # dg = dq + dk of the shared features, per half
        dgc = tl.dot(dA, gco, input_precision=PREC) + tl.dot(dAt, gco, input_precision=PREC)
        dgc += tl.dot(dn, tl.trans(Pc), input_precision=PREC)
        dgc += tl.dot(v, tl.trans(Rc), input_precision=PREC)
        dgc += dd[:, None] * zc[None, :] + rzc[None, :]
        dgs = tl.dot(dA, gso, input_precision=PREC) + tl.dot(dAt, gso, input_precision=PREC)
        dgs += tl.dot(dn, tl.trans(Ps), input_precision=PREC)
        dgs += tl.dot(v, tl.trans(Rs), input_precision=PREC)
        dgs += dd[:, None] * zs[None, :] + rzs[None, :]
        dv += tl.dot(gco, Rc, input_precision=PREC)
        dv += tl.dot(gso, Rs, input_precision=PREC)
        # to the angles: dphi = dg ELU'(phi) scale, ELU' = min(g, 1) (0 where masked)
        dpc = dgc * tl.minimum(gc, 1.0) * scale
        dps = dgs * tl.minimum(gs, 1.0) * scale
        da1 = c1 * dps - s1 * dpc
        da2 = c2 * dps - s2 * dpc
        dx += tl.dot(da1, w1, input_precision=APREC)
        dx += tl.dot(da2, w2, input_precision=APREC)
        ms = mm[:, None] & sk[None, :]
        wo = h * M * HS + m[:, None] * HS + s[None, :]
        tl.atomic_add(dw1_ptr + wo, tl.dot(tl.trans(da1), x, input_precision=APREC), mask=ms)
        tl.atomic_add(dw2_ptr + wo, tl.dot(tl.trans(da2), x, input_precision=APREC), mask=ms)
    tl.store(dx_ptr + bh * T * HS + t[:, None] * HS + s[None, :], dx,
             mask=tm[:, None] & sk[None, :])
    tl.store(dv_ptr + bh * T * D + t[:, None] * D + d[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=td)
