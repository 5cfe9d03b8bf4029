"""The two memories of a Memory Mosaics block.

ContextualMemory (replaces self-attention), per head h, with x_t the LayerNorm'd input:

    kbar_t = W_k x_t + lambda_h kbar_{t-1},  lambda_h = exp(-10 |p_h|),   k_t = kbar_t / |kbar_t|
    vbar_t = (1 - c_h) W_v x_{t+1} + c_h W_v x_t,    v_t = e^{10 q_h} vbar_t / |vbar_t|
    y_t    = kernel({(k_s, v_s) : s < t}, query k_t, bandwidth beta_h = exp(2 min(10 b_h, 5)))

The memory at t holds s <= t - 1 only: v_{t-1} already contains x_t, so s = t would leak
x_{t+1}. Every kernel is linear in the values, so the memory stores unit values and the scale
e^{10 q_h} multiplies c_proj's columns of head h instead.

PersistentMemory (replaces the MLP) queries learned banks M_k, M_v (H, P, hs) with its own
leaky-averaged key: y_t = e^{10 q'_h} softmax(beta'_h k_t M_k^T) M_v, with beta'_h and
e^{10 q'_h} applied to the (H, P, hs) banks rather than to the per-token queries and outputs.

Decoding (``forward(x, state)`` with a non-empty state) continues from the running sums in
O(1) per token for the leaky parts; the functions of the parameters a step needs (stacked
projections, decays, bandwidths, scaled c_proj and banks) are computed once, at the prompt,
and kept in the state.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .configuration_mosaics import MosaicsConfig
from .cpu_extension import bank_extension
from .gated_leaky import gated_leaky_average
from .kernels import Kernel, get_kernel
from .kernels.base import append_along_time
from .kernels.causal_attention import blocked_attention_available
from .leaky import continue_leaky_sum, decay_rate, leaky_average
from .memory_v2 import AdaptiveBandwidth, GatedKeys, Positions, visible_interval
from .unit_norm import unit_forward, unit_vectors

LEVELS = ("all", "short", "long")
BANK_BLOCK = 448  # most bank slots per call of the fused CPU backward (see _BankAttention)
BANK_ROWS = 256  # queries per block of the compiled CPU bank kernel (see _StoredBankAttention)
# most bytes of probabilities one slot-bank call keeps for its backward on CPU (H N P floats;
# above it the backward recomputes them: _BankAttention)
STORED_PROBS_MAX_BYTES = 256 * 2**20
EXP_SCALE = 10.0  # per-head scalars are stored divided by this (the reference's exp_param_scale)
BETA_LOG_CAP = 5.0  # beta = exp(2 * min(10 b, 5)) <= e^10
NORM_EPS = 1e-6


def bandwidth(b: Tensor) -> Tensor:
    """beta_h = exp(2 * min(10 b_h, 5)), shape (H,)."""
    return torch.exp(2.0 * torch.clamp(b * EXP_SCALE, max=BETA_LOG_CAP))


def split_heads(x: Tensor, n_head: int) -> Tensor:
    """(B, T, d) -> (B, H, T, d / H)."""
    B, T, d = x.shape
    return x.view(B, T, n_head, d // n_head).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, hs) -> (B, T, H * hs)."""
    B, H, T, hs = x.shape
    return x.transpose(1, 2).reshape(B, T, H * hs)


class _LookaheadValues(torch.autograd.Function):
    """Unit values of a whole sequence, v_s = unit((1 - c) v~_{s+1} + c v~_s) for s < T with
    v~_T := 0, from raw values v~ (B, H, T, hs) and the (H,) mix c, in one function.

    The same numbers as padding v~, lerping its shifted views and normalising, without the
    padded copy, the slices' zero-filled gradients and their sum: backward is
    d vbar = (g - u <g, u>) / |vbar|, dv~_s = c d vbar_s + (1 - c) d vbar_{s-1} (one lerp),
    dc = sum_s <v~_s - v~_{s+1}, d vbar_s>. The contextual memory's forward + backward took
    1-2% less (1 thread, B 8, H 8, T 256, hs 32, four alternating runs).
    """

    @staticmethod
    def forward(ctx, v: Tensor, c: Tensor, eps: float) -> Tensor:
        w = c.view(1, -1, 1, 1).to(v.dtype)
        vbar = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        torch.lerp(v[:, :, 1:], v[:, :, :-1], w, out=vbar[:, :, :-1])
        last = v[:, :, -1:]
        torch.lerp(torch.zeros_like(last), last, w, out=vbar[:, :, -1:])
        u, inv, norm = unit_forward(vbar, eps)
        ctx.save_for_backward(v, c, u, inv, norm > eps)
        return u

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        v, c, u, inv, active = ctx.saved_tensors
        dot = (g * u).sum(-1, keepdim=True) * active  # no radial part where |vbar| < eps
        dvbar = torch.addcmul(g, u, dot, value=-1.0).mul_(inv)
        dv = dc = None
        if ctx.needs_input_grad[0]:
            w = c.view(1, -1, 1, 1).to(dvbar.dtype)
            dv = torch.empty_like(dvbar)
            torch.lerp(dvbar[:, :, :-1], dvbar[:, :, 1:], w, out=dv[:, :, 1:])
            first = dvbar[:, :, :1]
            torch.lerp(torch.zeros_like(first), first, w, out=dv[:, :, :1])
        if ctx.needs_input_grad[1]:
            acc = torch.promote_types(g.dtype, torch.float32)
            dc = ((v[:, :, :-1] - v[:, :, 1:]) * dvbar[:, :, :-1]).sum((0, 2, 3), dtype=acc)
            dc += (v[:, :, -1:] * dvbar[:, :, -1:]).sum((0, 2, 3), dtype=acc)
            dc = dc.to(c.dtype)
        return dv, dc, None


class ContextualWeights(NamedTuple):
    """What a decoding step of :class:`ContextualMemory` reuses: the stacked projection
    [W_k; W_v] (2d, d), the log-decay a (H,) and decay lambda = e^{-a} (H, 1), the bandwidth
    beta (H,), the value mix c (1, H, 1, 1) and c_proj with the value scale on its columns."""

    kv: Tensor
    log_decay: Tensor
    decay: Tensor
    beta: Tensor
    mix: Tensor
    out: Tensor


class PersistentWeights(NamedTuple):
    """What a decoding step of :class:`PersistentMemory` reuses: a (H,), lambda (H, 1), the
    transposed scaled key bank (beta' M_k)^T (H, hs, P) and the value bank e^{10 q'} M_v."""

    log_decay: Tensor
    decay: Tensor
    keys_t: Tensor
    values: Tensor


@torch.no_grad()
def init_head_scalars(leaky_p: Tensor, bandwidth_b: Tensor, value_q: Tensor) -> None:
    """Reference init: decays lambda_h = exp(-linspace(0.5, 5, H)), beta = e^2, scale e^-0.5."""
    H = leaky_p.numel()
    leaky_p.copy_(torch.linspace(0.5, 5.0, H) / EXP_SCALE)
    bandwidth_b.fill_(1.0 / EXP_SCALE)
    value_q.fill_(-0.5 / EXP_SCALE)


def orthogonal_value_matrix(d: int, seed: int) -> Tensor:
    """A fixed random (d, d) orthogonal matrix; head h uses its column block h."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


class ContextualMemory(nn.Module):
    """In-context associative memory with a pluggable retrieval kernel."""

    def __init__(self, config: MosaicsConfig, layer_idx: int = 0, level: str = "all") -> None:
        super().__init__()
        d, H = config.n_embd, config.n_head
        self.n_head, self.chunk = H, config.leaky_chunk_size
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        # which memory entries a query sees: all of the past, the last h - 1 keys (short) or
        # the keys at least m back (long); see ``visible_interval``
        self.level = level
        self.window = config.short_term_window if level == "short" else None
        self.general = config.uses_visibility  # per-query intervals through Kernel.attend
        self.adaptive = AdaptiveBandwidth(H) if config.adaptive_bandwidth else None
        self.k_proj = nn.Linear(d, d, bias=False) if config.key_projection else None
        if config.fixed_value_projection:
            self.v_proj = None
            seed = config.initializer_seed * 1000 + layer_idx
            self.register_buffer("v_fixed", orthogonal_value_matrix(d, seed))
        else:
            self.v_proj = nn.Linear(d, d, bias=False)
        self.leaky_p = nn.Parameter(torch.empty(H))  # key decay, lambda = exp(-10 |p|)
        # v2: input-dependent gain and decay per step replace the fixed decay lambda_h
        self.gated = GatedKeys(d, H, config.leaky_chunk_size) if config.gated_keys else None
        if self.gated is not None:
            del self.leaky_p
            self.register_parameter("leaky_p", None)
        # beta = exp(2 min(10 b, 5)); v2's adaptive bandwidth replaces it
        self.bandwidth_b = nn.Parameter(torch.empty(H)) if self.adaptive is None else None
        self.lookahead_c = nn.Parameter(torch.empty(H))  # value mix of x_t and x_{t+1}
        self.value_q = nn.Parameter(torch.empty(H))  # value scale exp(10 q)
        self.kernel: Kernel = get_kernel(config.kernel, **config.kernel_kwargs)
        self.kernel.build(H, config.head_size)
        self.kernel.dropout = config.attn_dropout
        self.c_proj = nn.Linear(d, d, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.reset_scalars()

    @torch.no_grad()
    def reset_scalars(self) -> None:
        leaky_p = self.leaky_p if self.leaky_p is not None else torch.empty(self.n_head)
        b = self.bandwidth_b if self.bandwidth_b is not None else torch.empty(self.n_head)
        init_head_scalars(leaky_p, b, self.value_q)
        self.lookahead_c.uniform_(0.0, 1.0)
        if self.gated is not None:
            self.gated.reset_parameters()
        if self.adaptive is not None:
            self.adaptive.reset_parameters()

    def keys(self, x: Tensor, k_raw: Tensor, state: Tensor | None = None,
             documents: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Unit keys (B, H, T, hs), the un-normalised averages and the last one (B, H, hs),
        from inputs x (B, T, d) and key features k_raw, continuing ``state``; with
        ``documents`` (B, T) ids the averages restart where the id changes."""
        if self.gated is not None:
            kbar, last = self.gated.averages(x, k_raw, state, documents)
        elif documents is not None:
            a = decay_rate(self.leaky_p, EXP_SCALE).to(k_raw.dtype)
            B, H, T, _ = k_raw.shape
            kbar, last = gated_leaky_average(k_raw, k_raw.new_ones(B, H, T),
                                             a.view(1, H, 1).expand(B, H, T), self.chunk,
                                             state, documents)
        elif state is None:
            kbar = leaky_average(k_raw, decay_rate(self.leaky_p, EXP_SCALE), None, self.chunk)
            last = kbar[:, :, -1].clone()
        else:
            a = decay_rate(self.leaky_p, EXP_SCALE)
            kbar, last = continue_leaky_sum(state, k_raw, a, torch.exp(-a).view(-1, 1),
                                            self.chunk)
        return unit_vectors(kbar, NORM_EPS), kbar, last

    def project(self, x: Tensor, kv: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Raw key and value features W_k x, W_v x as (B, H, T, hs); ``kv``: the stacked
        weight of :meth:`stacked_projection`, when already at hand."""
        if kv is None and self.k_proj is not None and self.v_proj is not None:
            kv = self.stacked_projection()
        if kv is not None:  # one GEMM for both
            k, v = F.linear(x, kv).chunk(2, dim=-1)
            return split_heads(k, self.n_head), split_heads(v, self.n_head)
        k = self.k_proj(x) if self.k_proj is not None else x
        v = self.v_proj(x) if self.v_proj is not None else x @ self.v_fixed.to(x.dtype)
        return split_heads(k, self.n_head), split_heads(v, self.n_head)

    def stacked_projection(self) -> Tensor:
        """[W_k; W_v], (2d, d): W_k = I without a key projection, W_v = the fixed orthogonal
        matrix's transpose without a value projection."""
        d = self.c_proj.weight.shape[1]
        wk = self.k_proj.weight if self.k_proj is not None else torch.eye(
            d, device=self.c_proj.weight.device, dtype=self.c_proj.weight.dtype)
        wv = self.v_proj.weight if self.v_proj is not None else self.v_fixed.T
        return torch.cat([wk, wv.to(wk.dtype)])

    def decode_weights(self) -> ContextualWeights:
        if self.leaky_p is not None:
            a = decay_rate(self.leaky_p, EXP_SCALE)
        else:  # gated keys: the decay comes from each token (see ``keys``)
            a = torch.zeros_like(self.value_q)
        # adaptive bandwidth: beta is computed per query (``forward_intervals``)
        beta = (bandwidth(self.bandwidth_b) if self.bandwidth_b is not None
                else torch.ones_like(self.value_q))
        return ContextualWeights(kv=self.stacked_projection(), log_decay=a,
                                 decay=torch.exp(-a).view(-1, 1), beta=beta,
                                 mix=self.lookahead_c.view(1, -1, 1, 1),
                                 out=self.c_proj.weight * self.value_scale())

    def finish_values(self, v_raw: Tensor) -> Tensor:
        """Unit values vbar_s / |vbar_s| from consecutive raw values (v~_s, v~_{s+1}):
        (B, H, n+1, hs) -> (B, H, n, hs). Their scale e^{10 q_h} is applied in ``output``."""
        c = self.lookahead_c.view(1, -1, 1, 1).to(v_raw.dtype)
        vbar = torch.lerp(v_raw[:, :, 1:], v_raw[:, :, :-1], c)  # (1 - c) v~_{s+1} + c v~_s
        return unit_vectors(vbar, NORM_EPS)

    def output(self, y: Tensor) -> Tensor:
        """c_proj of the merged heads, (B, H, T, hs) -> (B, T, d), with the value scale.

        A kernel's retrieval is linear in the values (y_t = sum_s w_ts v_s), so the per-head
        scale e^{10 q_h} of every value goes on the matching c_proj columns, a d x d product,
        instead of on the (B, H, T, hs) values.
        """
        return F.linear(merge_heads(y), self.c_proj.weight * self.value_scale().to(y.dtype))

    def value_scale(self) -> Tensor:
        """e^{10 q_h} repeated over each head's hs columns of c_proj, (d,)."""
        hs = self.c_proj.weight.shape[1] // self.n_head
        return torch.exp(self.value_q * EXP_SCALE).repeat_interleave(hs)

    def forward(self, x: Tensor, state: dict | None = None,
                pos: Positions | None = None) -> tuple[Tensor, dict | None]:
        """x: (B, T, d). ``state``: this layer's decoding state; ``None`` for training, ``{}``
        to start one (prefill), else it is continued (see :meth:`extend`). ``pos``: where
        the tokens sit (documents, long-term gap), used by the v2 memory options."""
        if self.general:
            return self.forward_intervals(x, state, pos)
        if state:
            if x.shape[1] == 1 and not (torch.is_grad_enabled() or self.training):
                return self._step(x, state)
            return self.extend(x, state)
        k_raw, v_raw = self.project(x)
        keys, kbar, last = self.keys(x, k_raw)
        # full sequence: v~_T := 0 past the end (v_{T-1} is never retrieved in-window)
        values = _LookaheadValues.apply(v_raw, self.lookahead_c, NORM_EPS)
        y = self.resid_dropout(self.output(self.kernel(keys, values, bandwidth(self.bandwidth_b))))
        if state is None:
            return y, None
        # prefill: the memory holds (k_s, v_s) for s < T - 1; v_{T-1} waits for x_T
        kstate = self.kernel.init_state(x.shape[0], self.n_head, keys.shape[-1], x.device,
                                        values.dtype)
        kstate = self.kernel.prefill_state(kstate, keys[:, :, :-1], values[:, :, :-1])
        return y, {"kbar": last, "key": keys[:, :, -1:],
                   "v_raw": v_raw[:, :, -1:], "kernel": kstate, "weights": self.decode_weights()}

    def _step(self, x: Tensor, state: dict) -> tuple[Tensor, dict]:
        """:meth:`extend` for one token per row without gradients (the decoding hot path):
        the same maths in a dozen ops on (B, H, hs) tensors, the running sum in place."""
        w: ContextualWeights = state["weights"]
        B, _, d = x.shape
        kv = F.linear(x.view(B, d), w.kv).view(B, 2, self.n_head, d // self.n_head)
        if self.gated is not None:
            gain, log_decay = self.gated.rates(x)  # (B, H, 1)
            kbar = torch.addcmul(kv[:, 0] * gain, state["kbar"], torch.exp(-log_decay),
                                 out=state["kbar"])
        else:
            kbar = torch.addcmul(kv[:, 0], state["kbar"], w.decay, out=state["kbar"])
        key = unit_vectors(kbar, NORM_EPS).unsqueeze(2)  # (B, H, 1, hs)
        v_raw = kv[:, 1].unsqueeze(2)
        mix = w.mix if w.mix.dtype == v_raw.dtype else w.mix.to(v_raw.dtype)
        value = unit_vectors(torch.lerp(v_raw, state["v_raw"], mix), NORM_EPS)  # v_{t-1}
        y, kstate = self.kernel.extend(state["kernel"], key, state["key"], value, w.beta)
        y = F.linear(y.reshape(B, d), w.out)  # (B, H, 1, hs) is (B, H hs) in memory
        return y.view(B, 1, d), {"kbar": kbar, "key": key, "v_raw": v_raw, "kernel": kstate,
                                 "weights": w}

    def extend(self, x: Tensor, state: dict) -> tuple[Tensor, dict]:
        """Decoding: n new positions x (B, n, d) continue ``state``. Each x_t finishes the value
        v_{t-1} = unit((1 - c) v~_t + c v~_{t-1}), (k_{t-1}, v_{t-1}) joins the memory, and k_t
        queries it. Returns the (B, n, d) output and the new state (the running key sum and the
        kernel's buffers are updated in place)."""
        w: ContextualWeights = state["weights"]
        k_raw, v_raw = self.project(x, w.kv)
        keys, _, total = self.keys(x, k_raw, state["kbar"])
        if x.shape[1] == 1:  # one token: its query k_t, the memory gains (k_{t-1}, v_{t-1})
            mem_keys = state["key"]
            vbar = torch.lerp(v_raw, state["v_raw"], w.mix.to(v_raw.dtype))
        else:
            mem_keys = torch.cat([state["key"], keys[:, :, :-1]], dim=2)
            pending = torch.cat([state["v_raw"], v_raw], dim=2)
            vbar = torch.lerp(pending[:, :, 1:], pending[:, :, :-1], w.mix.to(v_raw.dtype))
        y, kstate = self.kernel.extend(state["kernel"], keys, mem_keys,
                                       unit_vectors(vbar, NORM_EPS), w.beta)
        y = F.linear(merge_heads(y), w.out)
        new_state = {"kbar": total, "key": keys[:, :, -1:], "v_raw": v_raw[:, :, -1:],
                     "kernel": kstate, "weights": w}
        return (self.resid_dropout(y) if self.training else y), new_state

    def gap(self, pos: Positions | None) -> int:
        """Newest visible entry is p - gap: 1 (strict past) except for the long-term memory."""
        return pos.gap if self.level == "long" and pos is not None else 1

    def forward_intervals(self, x: Tensor, state: dict | None,
                          pos: Positions | None) -> tuple[Tensor, dict | None]:
        """Training, prefill and decoding when queries see per-query intervals of the memory
        (windows, gaps, documents) or carry their own bandwidth: every query goes through
        ``Kernel.attend``.

        The memory holds (k_s, v_s) at absolute positions base .. base + len - 1; the query at
        p sees lo <= s <= hi (``visible_interval``). Decoding appends to buffers that grow in
        place; the short-term memory drops the entries no later query can see once they fill
        half of its buffer, so it keeps at most 2 (h - 1) + n entries.
        """
        B, n, _ = x.shape
        w: ContextualWeights | None = state.get("weights") if state else None
        k_raw, v_raw = self.project(x, None if w is None else w.kv)
        docs = None if pos is None else pos.documents
        prev = None if not state else state["kbar"]
        if prev is not None and pos is not None and pos.restart is not None:
            prev = prev * (~pos.restart).to(prev.dtype).view(B, 1, 1)  # a new document
        if prev is not None and docs is None and self.gated is None:
            a = decay_rate(self.leaky_p, EXP_SCALE)
            kbar, last = continue_leaky_sum(prev.clone(), k_raw, a, torch.exp(-a).view(-1, 1),
                                            self.chunk)
            keys = unit_vectors(kbar, NORM_EPS)
        else:
            keys, kbar, last = self.keys(x, k_raw, prev, docs)
        if not state:  # training or prefill: entries 0 .. n - 1, v~_n := 0
            values = self.finish_values(F.pad(v_raw, (0, 0, 0, 1)))
            mem_keys, mem_values, base = keys, values, 0
        else:  # x_t finishes v_{t-1}: entries p0 - 1 .. p0 + n - 2 join the memory
            pending = torch.cat([state["v_raw"], v_raw], dim=2)
            mix = self.lookahead_c.view(1, -1, 1, 1).to(v_raw.dtype)
            new_values = unit_vectors(torch.lerp(pending[:, :, 1:], pending[:, :, :-1], mix),
                                      NORM_EPS)
            new_keys = torch.cat([state["key"], keys[:, :, :-1]], dim=2)
            mem_keys = append_along_time(state["mem_keys"], new_keys)
            mem_values = append_along_time(state["mem_values"], new_values)
            base = state["base"]
        lo, hi = visible_interval(n, pos, self.window, self.gap(pos), x.device)
        if self.adaptive is not None:
            beta = self.adaptive((hi - lo + 1).clamp(min=0))  # (B or 1, H, n)
        else:
            beta = bandwidth(self.bandwidth_b)
        y = self.kernel.attend(keys, mem_keys, mem_values, beta, (lo - base).clamp(min=0),
                               hi - base)
        y = self.resid_dropout(self.output(y))
        if state is None:
            return y, None
        if not state:  # prefill: v_{n-1} waits for x_n
            mem_keys, mem_values = mem_keys[:, :, :-1], mem_values[:, :, :-1]
            w = self.decode_weights()
        start = n + (0 if pos is None else pos.start)  # absolute position of the next token
        mem_keys, mem_values, base = self._trim(mem_keys, mem_values, base, start)
        return y, {"kbar": last, "key": keys[:, :, -1:], "v_raw": v_raw[:, :, -1:],
                   "mem_keys": mem_keys, "mem_values": mem_values, "base": base, "weights": w}

    def _trim(self, keys: Tensor, values: Tensor, base: int,
              next_pos: int) -> tuple[Tensor, Tensor, int]:
        """Short-term memory: drop the entries older than the next query's window (the query at
        p sees s >= p - h + 1) once they are as many as the window itself."""
        if self.window is None:
            return keys, values, base
        first = next_pos - self.window + 1  # oldest entry a later query can see
        drop = first - base
        if drop < self.window:
            return keys, values, base
        # views of the kept entries: the next append moves them to a fresh buffer
        return keys[:, :, drop:], values[:, :, drop:], first

    def extra_repr(self) -> str:
        return f"n_head={self.n_head}, leaky_chunk={self.chunk}, level={self.level!r}"


_FLASH_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _BankAttention(torch.autograd.Function):
    """softmax(q k^T) v for (1, H, N, hs) queries and (1, H, P, hs) banks on CPU: the fused
    forward in one call, the fused backward in blocks of at most ``BANK_BLOCK`` bank slots
    (where the compiled :class:`_StoredBankAttention` does not apply).

    A flash backward needs only P = exp(S - lse) and rowsum(dO * O) of the whole row, so each
    block of slots yields its own dK, dV and a share of dq (exact, as in
    :mod:`.kernels.causal_attention`). PyTorch's CPU kernel cuts keys into blocks of 512, and
    its backward costs 8-18% more per slot at 512 than at 448: forward + backward at N 2048
    (1 thread) took 91.3 instead of 95.9 ms at H 8, P 896, hs 32, 695 instead of 741 ms at
    H 12, P 2688, hs 64. Measured and not kept (N 2048, H 8, P 896, hs 32, 1 thread): the
    forward as two 448-slot calls merged through their lse (1.15x the single call), the
    backward as explicit batched GEMMs over rows of 128-512 queries (1.5-1.8x), and keeping
    the probabilities instead of recomputing them as PyTorch ops (0.95-1.06x;
    ``bench/bank_bound.py``). :class:`_StoredBankAttention` keeps them in compiled code.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out, lse = _FLASH_FWD(q, k, v, 0.0, False, scale=1.0)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, out, lse = ctx.saved_tensors
        P = k.shape[2]
        width = -(-P // -(-P // BANK_BLOCK))  # even blocks of at most BANK_BLOCK slots
        dq, dk, dv = None, torch.empty_like(k), torch.empty_like(v)
        for s in range(0, P, width):
            blk = slice(s, min(s + width, P))
            gq, gk, gv = _FLASH_BWD(grad, q, k[:, :, blk], v[:, :, blk], out, lse, 0.0, False,
                                    scale=1.0)
            dk[:, :, blk], dv[:, :, blk] = gk, gv
            dq = gq if dq is None else dq.add_(gq)
        return dq, dk, dv


class _StoredBankAttention(torch.autograd.Function):
    """softmax(q k^T) v for (H, N, hs) fp32 queries and (H, P, hs) banks on CPU through the
    compiled kernel (``mosaics/csrc/bank_attention.cpp``): the forward keeps the probabilities
    (H N P floats), the backward reads them instead of recomputing q k^T and its exp, and every
    product runs in oneDNN's batch-reduce GEMM. ``bench/bank_bound.py`` compares it with
    :class:`_BankAttention`."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        y, *probs = bank_extension().forward(q, k, v, BANK_ROWS)
        ctx.save_for_backward(q, k, v, y, *probs)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, y, *probs = ctx.saved_tensors
        dq, dk, dv = bank_extension().backward(grad.contiguous(), q, k, v, y, probs, BANK_ROWS)
        return dq, dk, dv


def stored_bank_applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :class:`_StoredBankAttention` takes (1, H, N, hs) fp32 CPU queries and banks:
    their probabilities fit ``STORED_PROBS_MAX_BYTES`` and the kernel builds here."""
    return (q.shape[0] == 1 and q.shape[2] > 0 and q.device.type == "cpu"
            and all(t.dtype == torch.float32 for t in (q, k, v))
            and 4 * q.shape[1] * q.shape[2] * k.shape[2] <= STORED_PROBS_MAX_BYTES
            and bank_extension() is not None)


def bank_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
    """softmax(q k^T) v, unscaled, for (1, H, N, hs) queries and (1, H, P, hs) banks. Training
    on CPU without dropout: :class:`_StoredBankAttention` where it applies (fp32, the
    probabilities within ``STORED_PROBS_MAX_BYTES``), else :class:`_BankAttention` above
    ``BANK_BLOCK`` slots; otherwise, and for inference, the fused call."""
    training_cpu = (q.device.type == "cpu" and dropout_p == 0.0 and torch.is_grad_enabled()
                    and (q.requires_grad or k.requires_grad or v.requires_grad))
    if not training_cpu:
        return F.scaled_dot_product_attention(q, k, v, scale=1.0, dropout_p=dropout_p)
    if torch.is_autocast_enabled("cpu"):  # as F.scaled_dot_product_attention under autocast
        dtype = torch.get_autocast_dtype("cpu")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.autocast("cpu", enabled=False):
        if stored_bank_applies(q, k, v):
            return _StoredBankAttention.apply(q[0].contiguous(), k[0].contiguous(),
                                              v[0].contiguous())[None]
        if k.shape[2] > BANK_BLOCK and blocked_attention_available():
            return _BankAttention.apply(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, scale=1.0)


class PersistentMemory(nn.Module):
    """Persistent associative memory: attention of a leaky-averaged key over P learned slots."""

    def __init__(self, config: MosaicsConfig) -> None:
        super().__init__()
        d, H, P = config.n_embd, config.n_head, config.pmem_size
        self.n_head, self.chunk, self.dropout = H, config.leaky_chunk_size, config.attn_dropout
        self.k_proj = nn.Linear(d, d, bias=False)
        self.leaky_p = nn.Parameter(torch.empty(H))
        self.bandwidth_b = nn.Parameter(torch.empty(H))
        self.value_q = nn.Parameter(torch.empty(H))
        self.mem_keys = nn.Parameter(torch.empty(H, P, config.head_size))
        self.mem_values = nn.Parameter(torch.empty(H, P, config.head_size))
        self.c_proj = nn.Linear(d, d, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.reset_scalars()
        self.reset_banks()

    @torch.no_grad()
    def reset_scalars(self) -> None:
        init_head_scalars(self.leaky_p, self.bandwidth_b, self.value_q)

    @torch.no_grad()
    def reset_banks(self) -> None:
        """Reference init of the slot banks: N(0, 1 / hs)."""
        std = self.mem_keys.shape[-1] ** -0.5
        nn.init.normal_(self.mem_keys, mean=0.0, std=std)
        nn.init.normal_(self.mem_values, mean=0.0, std=std)

    def decode_weights(self) -> PersistentWeights:
        a = decay_rate(self.leaky_p, EXP_SCALE)
        keys, values = self.scaled_banks()
        return PersistentWeights(log_decay=a, decay=torch.exp(-a).view(-1, 1),
                                 keys_t=keys.transpose(-1, -2).contiguous(), values=values)

    def _step(self, x: Tensor, state: dict) -> tuple[Tensor, dict]:
        """One token per row without gradients (the decoding hot path): the running sum in
        place, then softmax(q (beta' M_k)^T) e^{10 q'} M_v as two batched GEMVs (2.7x faster
        than the fused kernel at one row, as fast at eight)."""
        w: PersistentWeights = state["weights"]
        B, _, d = x.shape
        k = F.linear(x.view(B, d), self.k_proj.weight).view(B, self.n_head, d // self.n_head)
        kbar = torch.addcmul(k, state["kbar"], w.decay, out=state["kbar"])
        q = unit_vectors(kbar, NORM_EPS).transpose(0, 1)  # (H, B, hs)
        # banks and queries share a dtype (the model's), or autocast casts for bmm
        y = torch.bmm(torch.softmax(torch.bmm(q, w.keys_t), dim=-1), w.values)  # (H, B, hs)
        return F.linear(y.transpose(0, 1).reshape(B, d), self.c_proj.weight).view(B, 1, d), state

    def scaled_banks(self) -> tuple[Tensor, Tensor]:
        """(beta' M_k, e^{10 q'} M_v), each (H, P, hs). The bandwidth and the output scale go
        on the banks, not on the (H, B T, hs) queries and outputs: same products, smaller
        tensors when B T > P."""
        H = self.n_head
        return (self.mem_keys * bandwidth(self.bandwidth_b).view(H, 1, 1),
                self.mem_values * torch.exp(self.value_q * EXP_SCALE).view(H, 1, 1))

    def forward(self, x: Tensor, state: dict | None = None,
                pos: Positions | None = None) -> tuple[Tensor, dict | None]:
        """x: (B, T, d); ``state``: as in :meth:`ContextualMemory.forward`, here the running
        key sum and the :class:`PersistentWeights`; ``pos``: with documents, the key average
        restarts at each new document."""
        docs = None if pos is None else pos.documents
        if state and pos is not None and pos.restart is not None:
            keep = (~pos.restart).to(state["kbar"].dtype).view(-1, 1, 1)
            state = {**state, "kbar": state["kbar"] * keep}  # a new document: forget the keys
        if (state and x.shape[1] == 1 and not (torch.is_grad_enabled() or self.training)):
            return self._step(x, state)
        B, T, d = x.shape
        H = self.n_head
        k_raw = split_heads(self.k_proj(x), H)
        w = state["weights"] if state else None
        if docs is not None:
            a = decay_rate(self.leaky_p, EXP_SCALE).to(k_raw.dtype).view(1, H, 1)
            kbar, total = gated_leaky_average(k_raw, k_raw.new_ones(B, H, T), a.expand(B, H, T),
                                              self.chunk, state["kbar"] if state else None,
                                              docs)
        elif state:  # decoding: continue the running key sum
            kbar, total = continue_leaky_sum(state["kbar"], k_raw, w.log_decay, w.decay,
                                             self.chunk)
        else:
            kbar = leaky_average(k_raw, decay_rate(self.leaky_p, EXP_SCALE), None, self.chunk)
            total = None
        # The banks are shared by every token: fold the batch into the query axis, (H, B T, hs),
        # so each bank is streamed once (7% faster than expanding them B times).
        q = unit_vectors(kbar, NORM_EPS).transpose(0, 1).reshape(H, B * T, d // H)
        keys, values = self.scaled_banks() if w is None else (w.keys_t.transpose(-1, -2), w.values)
        y = bank_attention(q[None], keys[None].to(q.dtype), values[None].to(q.dtype),
                           self.dropout if self.training else 0.0)[0]
        y = self.c_proj(y.view(H, B, T, d // H).permute(1, 2, 0, 3).reshape(B, T, d))
        if self.training:
            y = self.resid_dropout(y)
        if state is None:
            return y, None
        if w is None:  # prefill
            last = kbar[:, :, -1].clone() if total is None else total
            return y, {"kbar": last, "weights": self.decode_weights()}
        return y, {"kbar": total, "weights": w}


class ThreeLevelMemory(nn.Module):
    """The v2 contextual memory: a short-term memory over the last h - 1 keys and a long-term
    memory over the keys at least m back, each a :class:`ContextualMemory` with its own
    parameters. Concatenating their heads and projecting with W_o = [W_o^s W_o^l] is the sum
    of the two memories' own output projections, which is what is computed."""

    def __init__(self, config: MosaicsConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.short = ContextualMemory(config, layer_idx, level="short")
        self.long = ContextualMemory(config, layer_idx, level="long")

    def forward(self, x: Tensor, state: dict | None = None,
                pos: Positions | None = None) -> tuple[Tensor, dict | None]:
        ys, ss = self.short(x, None if state is None else state.get("short", {}), pos)
        yl, sl = self.long(x, None if state is None else state.get("long", {}), pos)
        return ys + yl, (None if state is None else {"short": ss, "long": sl})
