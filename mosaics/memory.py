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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .configuration_mosaics import MosaicsConfig
from .kernels import Kernel, KernelState, get_kernel
from .leaky import decay_rate, leaky_average
from .unit_norm import unit_vectors

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

    def __init__(self, config: MosaicsConfig, layer_idx: int = 0) -> None:
        super().__init__()
        d, H = config.n_embd, config.n_head
        self.n_head, self.chunk = H, config.leaky_chunk_size
        self.k_proj = nn.Linear(d, d, bias=False) if config.key_projection else None
        if config.fixed_value_projection:
            self.v_proj = None
            seed = config.initializer_seed * 1000 + layer_idx
            self.register_buffer("v_fixed", orthogonal_value_matrix(d, seed))
        else:
            self.v_proj = nn.Linear(d, d, bias=False)
        self.leaky_p = nn.Parameter(torch.empty(H))  # key decay, lambda = exp(-10 |p|)
        self.bandwidth_b = nn.Parameter(torch.empty(H))  # beta = exp(2 min(10 b, 5))
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
        init_head_scalars(self.leaky_p, self.bandwidth_b, self.value_q)
        self.lookahead_c.uniform_(0.0, 1.0)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Raw key and value features W_k x, W_v x as (B, H, T, hs)."""
        if self.k_proj is not None and self.v_proj is not None:  # one GEMM for both
            w = torch.cat([self.k_proj.weight, self.v_proj.weight])
            k, v = F.linear(x, w).chunk(2, dim=-1)
            return split_heads(k, self.n_head), split_heads(v, self.n_head)
        k = self.k_proj(x) if self.k_proj is not None else x
        v = self.v_proj(x) if self.v_proj is not None else x @ self.v_fixed.to(x.dtype)
        return split_heads(k, self.n_head), split_heads(v, self.n_head)

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
        hs = y.shape[-1]
        scale = torch.exp(self.value_q * EXP_SCALE).repeat_interleave(hs).to(y.dtype)
        return F.linear(merge_heads(y), self.c_proj.weight * scale)

    def forward(self, x: Tensor, state: dict | None = None) -> tuple[Tensor, dict | None]:
        """x: (B, T, d). ``state`` is this layer's decoding cache (``None`` for training)."""
        k_raw, v_raw = self.project(x)
        a = decay_rate(self.leaky_p, EXP_SCALE)
        beta = bandwidth(self.bandwidth_b)
        kbar = leaky_average(k_raw, a, None if not state else state["kbar"], self.chunk)
        keys = unit_vectors(kbar, NORM_EPS)
        if not state:
            # full sequence: v~_T := 0 past the end (v_{T-1} is never retrieved in-window)
            values = self.finish_values(F.pad(v_raw, (0, 0, 0, 1)))
            y = self.kernel(keys, values, beta)
            new_state = None
            if state is not None:  # empty dict: prefill of a decoding cache
                kstate = self.kernel.init_state(x.shape[0], self.n_head, keys.shape[-1],
                                                x.device, values.dtype)
                kstate = self.kernel.prefill_state(kstate, keys[:, :, :-1], values[:, :, :-1])
                new_state = self._new_state(kbar, keys, v_raw, kstate)
        else:
            pending_v = torch.cat([state["v_raw"], v_raw], dim=2)
            mem_keys = torch.cat([state["key"], keys[:, :, :-1]], dim=2)
            y, kstate = self.kernel.extend(state["kernel"], keys, mem_keys,
                                           self.finish_values(pending_v), beta)
            new_state = self._new_state(kbar, keys, v_raw, kstate)
        return self.resid_dropout(self.output(y)), new_state

    @staticmethod
    def _new_state(kbar: Tensor, keys: Tensor, v_raw: Tensor, kstate: KernelState) -> dict:
        return {"kbar": kbar[:, :, -1], "key": keys[:, :, -1:], "v_raw": v_raw[:, :, -1:],
                "kernel": kstate}

    def extra_repr(self) -> str:
        return f"n_head={self.n_head}, leaky_chunk={self.chunk}"


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

    def forward(self, x: Tensor, state: dict | None = None) -> tuple[Tensor, dict | None]:
        """x: (B, T, d); ``state`` holds the running key sum during decoding."""
        B, T, d = x.shape
        H = self.n_head
        k_raw = split_heads(self.k_proj(x), H)
        a = decay_rate(self.leaky_p, EXP_SCALE)
        kbar = leaky_average(k_raw, a, None if not state else state["kbar"], self.chunk)
        q = unit_vectors(kbar, NORM_EPS)
        # The banks are shared by every token: fold the batch into the query axis, (1, H, B T, hs),
        # so the fused kernel streams each bank once (7% faster than expanding them B times).
        q = q.transpose(0, 1).reshape(1, H, B * T, d // H)
        # the bandwidth beta' and the output scale e^{10 q'} go on the (H, P, hs) banks, not on
        # the (H, B T, hs) queries and outputs: same products, smaller tensors
        keys = self.mem_keys * bandwidth(self.bandwidth_b).view(H, 1, 1)
        values = self.mem_values * torch.exp(self.value_q * EXP_SCALE).view(H, 1, 1)
        y = F.scaled_dot_product_attention(q, keys[None].to(q.dtype), values[None].to(q.dtype),
                                           scale=1.0,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y[0].view(H, B, T, d // H).permute(1, 2, 0, 3).reshape(B, T, d)
        y = self.resid_dropout(self.c_proj(y))
        return y, (None if state is None else {"kbar": kbar[:, :, -1]})
