"""The Memory Mosaics block as maths: a contextual memory and a persistent memory.

Contextual memory (replaces self-attention), per head h, with x_t the LayerNorm'd input:

    k~_t = W_k x_t,  v~_t = W_v x_t
    kbar_t = g_t k~_t + lambda_t kbar_{t-1},      k_t = kbar_t / |kbar_t|        (keys = queries)
    v_t = e^{10 q_h} unit((1 - c_h) v~_{t+1} + c_h v~_t)                        (look-ahead value)
    y_t = sum_{s in S_t} w_ts v_s,   w_t. = kernel(beta_t k_t . k_s for s in S_t)

- v1: g_t = 1, lambda_t = exp(-10 |p_h|), beta_h = exp(2 min(10 b_h, 5)), S_t = {s < t}. The
  memory at t holds s <= t - 1 only: v_{t-1} already contains x_t, so s = t would leak x_{t+1}.
- Options of the same block (Memory Mosaics v2 turns them all on): gated keys
  g_t = exp(W_g x_t), lambda_t = exp(-|W_lambda x_t + b_h|); an adaptive bandwidth
  beta = beta1 n^alpha + beta0 of the n entries a query sees; a short-term memory
  (S_t = the last h - 1 entries) beside a long-term one (S_t = {s <= t - m}), summed; document
  masking (S_t and the leaky sums restart at each document). :mod:`mosaics.positions` gives S_t.
- ``alibi``: the scores become beta k_t . k_s - m_h (t - s) (:mod:`mosaics.kernels.position_bias`).

Persistent memory (replaces the MLP): the same leaky-averaged unit key queries learned banks,
y_t = e^{10 q'_h} softmax(beta'_h k_t M_k^T) M_v; or, as in v2, a SwiGLU W2 (SiLU(W1 x) * W3 x).

Every kernel is linear in the values, so the memory stores unit values and the scale e^{10 q_h}
multiplies c_proj's columns of head h; beta' and e^{10 q'} go on the (H, P, hs) banks. One
``forward`` serves training, the prompt and decoding: the state (:mod:`mosaics.cache`) carries
the running key sum, the last key and raw value, and the memory entries. The fast forms of the
maths live in :mod:`mosaics.ops`; :mod:`mosaics.reference` writes the model out position by
position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import ContextualWeights, MemoryState
from .configuration_mosaics import MosaicsConfig
from .kernels import Kernel, get_kernel
from .kernels.position_bias import alibi_slopes, supports_score_bias
from .ops import decay_rate, leaky_average, lookahead_values, unit_vectors
from .positions import Positions
from .recall import Visibility, recall

EXP_SCALE = 10.0  # per-head scalars are stored divided by this (the reference's exp_param_scale)
BETA_LOG_CAP = 5.0  # beta = exp(2 * min(10 b, 5)) <= e^10
THETA_CAP = 10.0  # adaptive bandwidth: beta0, beta1 <= e^10
NORM_EPS = 1e-6
LEVELS = ("all", "short", "long")
_STRICT_PAST = Visibility()


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


@torch.no_grad()
def init_head_scalars(leaky_p: Tensor | None, bandwidth_b: Tensor | None, value_q: Tensor) -> None:
    """Reference init: decays lambda_h = exp(-linspace(0.5, 5, H)), beta = e^2, scale e^-0.5."""
    if leaky_p is not None:
        leaky_p.copy_(torch.linspace(0.5, 5.0, leaky_p.numel()) / EXP_SCALE)
    if bandwidth_b is not None:
        bandwidth_b.fill_(1.0 / EXP_SCALE)
    value_q.fill_(-0.5 / EXP_SCALE)


def drop_padding(k_raw: Tensor, pos: Positions | None) -> Tensor:
    """Zero the key inputs k~_t (B, H, n, hs) of padding tokens (``pos.keep`` False), so a
    leaky sum passes over them as over nothing before a row's first real token."""
    if pos is None or pos.keep is None:
        return k_raw
    B, _, n, _ = k_raw.shape
    return k_raw * pos.keep.to(device=k_raw.device, dtype=k_raw.dtype).view(B, 1, n, 1)


def orthogonal_value_matrix(d: int, seed: int) -> Tensor:
    """A fixed random (d, d) orthogonal matrix; head h uses its column block h."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


class GatedKeys(nn.Module):
    """Per-step gain and log-decay of the key sum: g_t = exp(W_g x_t), a_t = |W_lambda x_t + b|.
    W_g = W_lambda = 0 and b = linspace(0.5, 5, H) at init: exactly the v1 average."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.gate = nn.Linear(n_embd, n_head, bias=False)
        self.decay = nn.Linear(n_embd, n_head, bias=False)
        self.decay_offset = nn.Parameter(torch.empty(n_head))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.decay.weight)
        self.decay_offset.copy_(torch.linspace(0.5, 5.0, self.n_head))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T, d) inputs -> gains g_t and log-decays a_t, each (B, H, T)."""
        gain = torch.exp(self.gate(x)).transpose(1, 2)
        log_decay = (self.decay(x) + self.decay_offset).abs().transpose(1, 2)
        return gain, log_decay


class AdaptiveBandwidth(nn.Module):
    """beta_h(n) = beta1_h n^alpha_h + beta0_h for a query that sees n entries;
    beta0 = e^{min(theta0, 10)}, beta1 = e^{min(theta1, 10)}, alpha = min(|theta2|, 1)."""

    def __init__(self, n_head: int) -> None:
        super().__init__()
        self.theta0 = nn.Parameter(torch.empty(n_head))
        self.theta1 = nn.Parameter(torch.empty(n_head))
        self.theta2 = nn.Parameter(torch.empty(n_head))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """thetas 1.5, 1.5 and alpha = 1/3."""
        self.theta0.fill_(1.5)
        self.theta1.fill_(1.5)
        self.theta2.fill_(1.0 / 3.0)

    def forward(self, visible: Tensor) -> Tensor:
        """(..., T) counts of visible entries -> (..., H, T) bandwidths."""
        beta0 = torch.exp(self.theta0.clamp(max=THETA_CAP)).view(-1, 1)
        beta1 = torch.exp(self.theta1.clamp(max=THETA_CAP)).view(-1, 1)
        alpha = self.theta2.abs().clamp(max=1.0).view(-1, 1)
        return beta1 * visible.to(beta0.dtype).unsqueeze(-2).pow(alpha) + beta0


class ContextualMemory(nn.Module):
    """In-context associative memory with a pluggable retrieval kernel (module docstring).

    ``level``: "all" (every past entry), "short" (the last ``short_term_window`` - 1) or
    "long" (entries at least the long-term gap back)."""

    def __init__(self, config: MosaicsConfig, layer_idx: int = 0, level: str = "all") -> None:
        super().__init__()
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        d, H = config.n_embd, config.n_head
        self.n_head, self.chunk, self.level = H, config.leaky_chunk_size, level
        self.window = config.short_term_window if level == "short" else None
        self.intervals = config.uses_visibility  # per-query intervals through Kernel.attend
        # (modules in the order of earlier releases: optimizer states in checkpoints follow it)
        self.adaptive = AdaptiveBandwidth(H) if config.adaptive_bandwidth else None
        self.k_proj = nn.Linear(d, d, bias=False) if config.key_projection else None
        if config.fixed_value_projection:
            self.v_proj = None
            seed = config.initializer_seed * 1000 + layer_idx
            self.register_buffer("v_fixed", orthogonal_value_matrix(d, seed))
        else:
            self.v_proj = nn.Linear(d, d, bias=False)
        self.gated = GatedKeys(d, H) if config.gated_keys else None
        # key decay lambda = exp(-10 |p|), unless gated keys give one per step
        self.leaky_p = nn.Parameter(torch.empty(H)) if self.gated is None else None
        # beta = exp(2 min(10 b, 5)), unless the adaptive bandwidth gives one per query
        self.bandwidth_b = nn.Parameter(torch.empty(H)) if self.adaptive is None else None
        self.lookahead_c = nn.Parameter(torch.empty(H))  # value mix of x_t and x_{t+1}
        self.value_q = nn.Parameter(torch.empty(H))  # value scale exp(10 q)
        self.kernel: Kernel = get_kernel(config.kernel, **config.kernel_kwargs)
        self.kernel.build(H, config.head_size)
        self.kernel.dropout = config.attn_dropout
        if config.alibi and not supports_score_bias(self.kernel):
            raise ValueError(f"MosaicsConfig.alibi needs a kernel with a score normalizer "
                             f"(weights / weights_backward); kernel {config.kernel!r} has "
                             f"none. Use a score kernel (e.g. gaussian, epanechnikov) or "
                             f"alibi=False.")
        self.alibi = config.alibi
        self.c_proj = nn.Linear(d, d, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.reset_scalars()

    @torch.no_grad()
    def reset_scalars(self) -> None:
        init_head_scalars(self.leaky_p, self.bandwidth_b, self.value_q)
        self.lookahead_c.uniform_(0.0, 1.0)
        for part in (self.gated, self.adaptive):
            if part is not None:
                part.reset_parameters()

    def weights(self) -> ContextualWeights:
        """The parameters in the form the forward uses (kept in the decoding state): W_k = I
        without a key projection, W_v = the fixed orthogonal matrix without a value one."""
        wc = self.c_proj.weight
        d = wc.shape[1]
        wk = self.k_proj.weight if self.k_proj is not None else torch.eye(
            d, device=wc.device, dtype=wc.dtype)
        wv = self.v_proj.weight if self.v_proj is not None else self.v_fixed.T.to(wk.dtype)
        ones = torch.ones_like(self.value_q)
        scale = torch.exp(self.value_q * EXP_SCALE).repeat_interleave(d // self.n_head)
        a = decay_rate(self.leaky_p, EXP_SCALE) if self.gated is None else ones
        return ContextualWeights(
            kv=torch.cat([wk, wv]), log_decay=a, decay=torch.exp(-a).view(-1, 1),
            beta=self.kernel.bandwidth(bandwidth(self.bandwidth_b)) if self.adaptive is None
            else ones,
            mix=self.lookahead_c,
            out=wc * scale)

    def forward(self, x: Tensor, pos: Positions | None = None, state: MemoryState | None = None,
                use_cache: bool = False) -> tuple[Tensor, MemoryState | None]:
        """x: (B, n, d) -> (B, n, d). ``state``: continue decoding from it; ``use_cache``: return
        the state after these tokens (the prompt, or decoding). ``pos``: where the tokens sit
        (documents, long-term gap) when the memory uses visible intervals."""
        B, n, d = x.shape
        w = state.weights if state is not None else self.weights()
        kv = F.linear(x.reshape(B * n, d), w.kv).view(B, n, 2, self.n_head, d // self.n_head)
        k_raw, v_raw = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (B, H, n, hs)
        keys, last = self.unit_keys(x, k_raw, w, pos, state)
        # values: each x_t finishes v_{t-1}; a whole sequence ends with v~_n := 0
        if state is None:  # entries 0 .. n - 1
            values = lookahead_values(v_raw, w.mix, eps=NORM_EPS)
            entry_keys = keys
        else:  # entries p0 - 1 .. p0 + n - 2
            values = lookahead_values(v_raw, w.mix, state.v_raw, NORM_EPS)
            entry_keys = state.key if n == 1 else torch.cat([state.key, keys[:, :, :-1]], 2)
        y, memory, base = recall(self.kernel, keys, entry_keys, values, w.beta,
                                 self.visibility(), pos, None if state is None else state.memory,
                                 0 if state is None else state.base, use_cache)
        y = F.linear(merge_heads(y).view(B * n, d), w.out).view(B, n, d)
        if self.training:
            y = self.resid_dropout(y)
        if not use_cache:
            return y, None
        last_key, last_v = (keys, v_raw) if n == 1 else (keys[:, :, -1:], v_raw[:, :, -1:])
        if state is None:  # every decoding step mixes values with c: keep it shaped for that
            w = w._replace(mix=w.mix.view(1, -1, 1, 1))
        return y, MemoryState(kbar=last, key=last_key, v_raw=last_v, memory=memory, base=base,
                              weights=w)

    def unit_keys(self, x: Tensor, k_raw: Tensor, w: ContextualWeights,
                  pos: Positions | None = None,
                  state: MemoryState | None = None) -> tuple[Tensor, Tensor]:
        """Unit keys k_t = kbar_t / |kbar_t| of the leaky sums kbar_t = g_t k~_t + lambda_t
        kbar_{t-1}, continuing ``state`` (restarted by a new document): k_raw (B, H, n, hs) ->
        (keys (B, H, n, hs), the last leaky sum (B, H, 1, hs))."""
        initial = None if state is None else state.kbar
        if initial is not None and pos is not None and pos.restart is not None:
            initial = initial * (~pos.restart).to(initial.dtype).view(x.shape[0], 1, 1)
        k_raw = drop_padding(k_raw, pos)
        gain, log_decay = self.gated(x) if self.gated is not None else (None, w.log_decay)
        kbar, last = leaky_average(k_raw, log_decay, gain=gain, initial=initial,
                                   documents=None if pos is None else pos.documents,
                                   chunk=self.chunk, decay=w.decay)
        return unit_vectors(kbar, NORM_EPS), last

    def no_retrieval_weights(self) -> str | None:
        """Why :meth:`retrieval_weights` cannot map this memory, or None when it can."""
        if self.intervals:
            return ("this memory uses visible intervals (windows, document masking or an "
                    "adaptive bandwidth: v2 options); it covers the v1 memory only")
        if not supports_score_bias(self.kernel):
            return (f"kernel {self.kernel.name!r} has no score normalizer (weights(cos, beta, "
                    "mask)), so its weights are not one row of scores; use a score kernel")
        return None

    @torch.no_grad()
    def retrieval_weights(self, x: Tensor, rows: Tensor | None = None) -> Tensor:
        """The weights the kernel gives each query over the strict past of a whole sequence,
        the contextual memory's "attention map": x (B, T, d), the memory's (LayerNorm'd) input
        -> w (B, H, n, T) fp32 for the query positions ``rows`` (n,) (all T by default), with
        y_t = sum_s w_ts v_s and w_ts = 0 for s >= t (row 0 sees nothing: all 0).

        The kernel's normalizer applied to the scores beta cos(k_t, k_s) (minus the ALiBi
        bias m_h (t - s) when the config has it). Score kernels (every built-in one but FSKA)
        of a memory without visible intervals (the v1 block) only."""
        reason = self.no_retrieval_weights()
        if reason:
            raise ValueError(f"retrieval_weights: {reason}")
        B, T, d = x.shape
        w = self.weights()
        k_raw = F.linear(x, w.kv[:d]).view(B, T, self.n_head, -1).transpose(1, 2)
        keys = self.unit_keys(x, k_raw, w)[0].float()
        rows = torch.arange(T, device=x.device) if rows is None else rows.to(x.device)
        cos = keys[:, :, rows] @ keys.transpose(-1, -2)  # (B, H, n, T)
        lag = rows.view(-1, 1) - torch.arange(T, device=x.device).view(1, -1)  # t - s
        mask = lag > 0
        beta = w.beta.float().view(1, -1, 1, 1)
        if self.alibi:  # beta cos - m (t - s) = beta (cos - m (t - s) / beta)
            cos = cos - self.slopes().float().view(1, -1, 1, 1) * lag.clamp(min=0) / beta
        weights = self.kernel.weights(cos, beta, mask)
        return torch.nan_to_num(weights).masked_fill(~mask, 0.0)  # a row with no entry: 0

    def slopes(self) -> Tensor:
        """The ALiBi slopes m_h (H,): fixed by n_head, so neither trained nor saved."""
        return alibi_slopes(self.n_head).to(self.lookahead_c)

    def visibility(self) -> Visibility:
        """What this memory's queries see (:mod:`mosaics.recall`)."""
        if not self.intervals and not self.alibi:
            return _STRICT_PAST
        return Visibility(
            self.intervals, self.window, self.level == "long",
            self.slopes() if self.alibi else None,
            None if self.adaptive is None else lambda n: self.kernel.bandwidth(self.adaptive(n)))

    def extra_repr(self) -> str:
        return f"n_head={self.n_head}, leaky_chunk={self.chunk}, level={self.level!r}"


class ShortLongMemory(nn.Module):
    """A short-term memory over the last h - 1 entries beside a long-term memory over the
    entries at least m back, each a :class:`ContextualMemory` with its own parameters.
    Concatenating their heads and projecting with W_o = [W_o^s W_o^l] is the sum of the two
    memories' own output projections, which is what is computed."""

    def __init__(self, config: MosaicsConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.short = ContextualMemory(config, layer_idx, level="short")
        self.long = ContextualMemory(config, layer_idx, level="long")

    def forward(self, x: Tensor, pos: Positions | None = None,
                state: tuple[MemoryState, MemoryState] | None = None,
                use_cache: bool = False) -> tuple[Tensor, tuple[MemoryState, ...] | None]:
        short, long = (None, None) if state is None else state
        ys, ss = self.short(x, pos, short, use_cache)
        yl, sl = self.long(x, pos, long, use_cache)
        return ys + yl, ((ss, sl) if use_cache else None)
