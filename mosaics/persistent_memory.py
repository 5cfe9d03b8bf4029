"""The persistent memory of a Memory Mosaics block (replaces the MLP).

The v1 form: the same leaky-averaged unit key as the contextual memory queries P learned
slots per head, y_t = e^{10 q'_h} softmax(beta'_h k_t M_k^T) M_v; beta' and e^{10 q'} go on
the (H, P, hs) banks. The v2 form: a SwiGLU W2 (SiLU(W1 x) * W3 x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import BankState, PersistentWeights
from .configuration_mosaics import MosaicsConfig
from .memory import EXP_SCALE, NORM_EPS, bandwidth, drop_padding, init_head_scalars, split_heads
from .ops import bank_attention, decay_rate, leaky_average, unit_vectors
from .positions import Positions


class PersistentMemory(nn.Module):
    """Persistent associative memory: a leaky-averaged unit key attends over P learned slots,
    y_t = softmax(k_t (beta' M_k)^T) (e^{10 q'} M_v)."""

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

    def weights(self) -> PersistentWeights:
        """The log-decay and the scaled banks (beta' M_k, e^{10 q'} M_v), each (H, P, hs): the
        scalars go on the banks, not on the (H, B T, hs) queries and outputs."""
        H = self.n_head
        a = decay_rate(self.leaky_p, EXP_SCALE)
        return PersistentWeights(
            log_decay=a, decay=torch.exp(-a).view(-1, 1),
            keys=self.mem_keys * bandwidth(self.bandwidth_b).view(H, 1, 1),
            values=self.mem_values * torch.exp(self.value_q * EXP_SCALE).view(H, 1, 1))

    def forward(self, x: Tensor, pos: Positions | None = None, state: BankState | None = None,
                use_cache: bool = False) -> tuple[Tensor, BankState | None]:
        """x: (B, n, d) -> (B, n, d); ``pos``, ``state``, ``use_cache`` as in
        :meth:`ContextualMemory.forward` (here the state is the running key sum)."""
        B, n, d = x.shape
        H = self.n_head
        w = state.weights if state is not None else self.weights()
        initial = None if state is None else state.kbar
        if initial is not None and pos is not None and pos.restart is not None:
            initial = initial * (~pos.restart).to(initial.dtype).view(B, 1, 1)
        k_raw = drop_padding(split_heads(F.linear(x, self.k_proj.weight), H), pos)
        kbar, last = leaky_average(k_raw, w.log_decay, initial=initial,
                                   documents=None if pos is None else pos.documents,
                                   chunk=self.chunk, decay=w.decay)
        # the banks are shared by every token: fold the batch into the query axis, (H, B n, hs)
        q = unit_vectors(kbar, NORM_EPS).transpose(0, 1).reshape(H, B * n, d // H)
        banks = (w.keys, w.values) if w.keys.dtype == q.dtype else (w.keys.to(q.dtype),
                                                                   w.values.to(q.dtype))
        y = bank_attention(q, *banks, self.dropout if self.training else 0.0)
        y = F.linear(y.view(H, B, n, d // H).permute(1, 2, 0, 3).reshape(B, n, d),
                     self.c_proj.weight)
        if self.training:
            y = self.resid_dropout(y)
        if not use_cache:
            return y, None
        if state is None:  # decoding multiplies by (beta' M_k)^T every step: store it that way
            w = w._replace(keys=w.keys.transpose(1, 2).contiguous().transpose(1, 2))
        elif last is state.kbar:  # a one-token step wrote the running sum in place
            return y, state
        return y, BankState(kbar=last, weights=w)


class SwiGLUMemory(nn.Module):
    """The v2 persistent memory, y = W2 (SiLU(W1 x) * W3 x), hidden width ``hidden``; a
    position-wise map, so it keeps no decoding state and documents change nothing."""

    def __init__(self, n_embd: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(n_embd, hidden, bias=False)
        self.w3 = nn.Linear(n_embd, hidden, bias=False)
        self.w2 = nn.Linear(hidden, n_embd, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, pos: Positions | None = None, state: None = None,
                use_cache: bool = False) -> tuple[Tensor, None]:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x))), None
