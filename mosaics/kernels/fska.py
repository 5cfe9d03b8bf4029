"""FSKA: flow-based spectral kernel attention in linear time.

The kernel is k(k_t, k_s) = g(k_t)^T g(k_s) with positive random features g built on
frequency pairs (w1, w2) drawn from a learned per-head spectral density (see
:mod:`.spectral_flow`). Retrieval over the strict past, with fp32 prefix state:

    S_t = sum_{s<t} g(k_s) v_s^T,   z_t = sum_{s<t} g(k_s),
    y_t = g(k_t)^T S_t / (g(k_t)^T z_t + eps),          y_0 = 0.

Bandwidth: the flow models the spectral density at unit bandwidth, u = f_h(z); the head's
learned bandwidth beta_h (from the memory block) scales it at run time, w = sqrt(beta_h) u.
At initialisation the flow is the identity, so w1, w2 ~ N(0, beta_h I) independently and the
expected kernel on unit keys is proportional to exp(beta_h cos) + 1 (the reference Gaussian
kernel plus a uniform floor). The KL regulariser acts on u only, so it shapes the density
without pulling on the bandwidth.

Frequencies are redrawn (reparameterised) on every training forward; in eval mode and for
decoding they come from a fixed seeded noise buffer ``eval_noise`` that is saved with the
model.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .base import Kernel, KernelState, extend_mask, register_kernel
from .spectral_flow import (
    SpectralFlow,
    SpectralMixturePrior,
    elu1_features,
    exp_log_features,
    spectral_kl,
)

POSITIVE_MAPS = ("elu1", "exp")


def causal_linear_attention(q_feat: Tensor, k_feat: Tensor, values: Tensor, chunk: int,
                            eps: float) -> Tensor:
    """Strict-past linear attention, chunked.

    Args:
        q_feat, k_feat: (B, H, T, F) non-negative query / key features.
        values: (B, H, T, D).
        chunk: chunk length C.
        eps: added to the denominator (a row with no memory gives 0).
    Returns:
        (B, H, T, D) with y_t = q_t^T S_t / (q_t^T z_t + eps), S_t = sum_{s<t} k_s v_s^T.
    Within a chunk the (C, C) strictly-lower weights are used directly; across chunks the
    per-chunk sums k^T v (B, H, T/C, F, D) are turned into exclusive prefix sums. Cost
    O(T (C + D) F); nothing of size T x F x D is formed.
    """
    B, H, T, Fd = q_feat.shape
    D = values.shape[-1]
    C = max(1, min(chunk, T))
    n = -(-T // C)
    pad = n * C - T
    if pad:
        q_feat, k_feat, values = (torch.nn.functional.pad(x, (0, 0, 0, pad))
                                  for x in (q_feat, k_feat, values))
    q = q_feat.view(B, H, n, C, Fd)
    k = k_feat.view(B, H, n, C, Fd)
    v = values.view(B, H, n, C, D)
    mask = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, 0.0)  # (B, H, n, C, C), s < t
    num = scores @ v
    den = scores.sum(-1)
    if n > 1:
        chunk_s = k.transpose(-1, -2) @ v  # (B, H, n, F, D)
        chunk_z = k.sum(-2)  # (B, H, n, F)
        prev_s = torch.nn.functional.pad(chunk_s[:, :, :-1].cumsum(2), (0, 0, 0, 0, 1, 0))
        prev_z = torch.nn.functional.pad(chunk_z[:, :, :-1].cumsum(2), (0, 0, 1, 0))
        num = num + q @ prev_s
        den = den + (q @ prev_z.unsqueeze(-1)).squeeze(-1)
    y = num / (den.unsqueeze(-1) + eps)
    return y.reshape(B, H, n * C, D)[:, :, :T]


NO_MEMORY = -1e30  # log-scale of an empty memory (finite, so differences stay defined)


def stable_causal_linear_attention(feat: Tensor, log_scale: Tensor, values: Tensor, chunk: int,
                                   eps: float) -> Tensor:
    """Strict-past linear attention with features exp(log_scale_s) feat_s of any magnitude.

    Args:
        feat: (B, H, T, F) features rescaled to max 1 per position (the query features are
            the same vectors; a per-query factor cancels in the normalisation).
        log_scale: (B, H, T) per-position log-factor gamma_s (no gradient needed).
        values: (B, H, T, D).
        chunk, eps: as in :func:`causal_linear_attention`.
    Returns:
        (B, H, T, D): y_t = sum_{s<t} e^{gamma_s} (f_t.f_s) v_s / (sum_{s<t} e^{gamma_s} f_t.f_s
        + eps'), computed relative to mu_t = max_{s<t} gamma_s, so every factor is at most 1
        and the best key keeps weight e^0 (eps' = eps e^{mu_t}). Chunk sums are carried across
        chunks relative to the running max (a scan over T / C chunks); no future position
        enters any row's arithmetic, so the result is exactly causal.
    """
    B, H, T, Fd = feat.shape
    D = values.shape[-1]
    C = max(1, min(chunk, T))
    n = -(-T // C)
    pad = n * C - T
    gam = log_scale.detach()
    if pad:
        feat, values = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (feat, values))
        gam = torch.nn.functional.pad(gam, (0, pad), value=NO_MEMORY)
    f = feat.view(B, H, n, C, Fd)
    v = values.view(B, H, n, C, D)
    gam = gam.view(B, H, n, C)
    chunk_max = gam.amax(-1)  # (B, H, n)
    before = torch.cat([torch.full_like(chunk_max[..., :1], NO_MEMORY),
                        chunk_max.cummax(-1).values[..., :-1]], dim=-1)  # max over chunks < c
    within = torch.cat([torch.full_like(gam[..., :1], NO_MEMORY),
                        gam.cummax(-1).values[..., :-1]], dim=-1)  # max over s < t in chunk
    mu = torch.maximum(within, before.unsqueeze(-1))  # (B, H, n, C)
    mask = torch.ones(C, C, dtype=torch.bool, device=feat.device).tril(-1)
    rel = torch.where(mask, gam.unsqueeze(-2) - mu.unsqueeze(-1), float("-inf"))
    scores = (f @ f.transpose(-1, -2)) * torch.exp(rel)  # (B, H, n, C, C), s < t
    num, den = scores @ v, scores.sum(-1)
    if n > 1:
        fk = f * torch.exp(gam - chunk_max.unsqueeze(-1)).unsqueeze(-1)
        chunk_s, chunk_z = fk.transpose(-1, -2) @ v, fk.sum(-2)  # relative to chunk_max
        S, z = torch.zeros_like(chunk_s[:, :, 0]), torch.zeros_like(chunk_z[:, :, 0])
        prev_s, prev_z = [], []
        for c in range(n):  # S_c = sum over chunks < c, relative to before[c]
            prev_s.append(S)
            prev_z.append(z)
            if c + 1 < n:
                keep = torch.exp(before[:, :, c] - before[:, :, c + 1]).view(B, H, 1)
                add = torch.exp(chunk_max[:, :, c] - before[:, :, c + 1]).view(B, H, 1)
                S = S * keep.unsqueeze(-1) + chunk_s[:, :, c] * add.unsqueeze(-1)
                z = z * keep + chunk_z[:, :, c] * add
        carry = torch.exp(before.unsqueeze(-1) - mu)  # (B, H, n, C) <= 1
        num = num + (f @ torch.stack(prev_s, 2)) * carry.unsqueeze(-1)
        den = den + (f @ torch.stack(prev_z, 2).unsqueeze(-1)).squeeze(-1) * carry
    y = num / (den.unsqueeze(-1) + eps)
    return y.reshape(B, H, n * C, D)[:, :, :T]


@register_kernel("fska")
class FSKAKernel(Kernel):
    """Flow-based spectral kernel attention (linear time, strict past).

    Args:
        num_features: M frequency pairs per head.
        flow_layers: affine couplings per head (0: fixed Gaussian random features).
        flow_hidden: hidden width of each coupling network.
        prior_components: Q components of the fixed spectral-mixture prior.
        lambda_spec: weight of the KL(flow || prior) term in the training loss.
        positive: ``"elu1"`` (the paper's ELU(phi) + 1, 2M features) or ``"exp"``
            (positive exponential features on the same frequencies, M features; sharper).
        chunk_size: chunk length C of the linear-attention scan.
        eps: denominator guard.
        seed: seed of the initial weights, the prior and the eval-time frequencies.
    The per-head modules are created by :meth:`build` (the memory block calls it right after
    construction, so weights exist before a checkpoint is loaded).
    """

    def __init__(self, num_features: int = 96, flow_layers: int = 5, flow_hidden: int = 64,
                 prior_components: int = 10, lambda_spec: float = 1e-3,
                 positive: str = "elu1", chunk_size: int = 64, eps: float = 1e-20,
                 seed: int = 0) -> None:
        super().__init__()
        for key, value, low in (("num_features", num_features, 1), ("flow_layers", flow_layers, 0),
                                ("flow_hidden", flow_hidden, 1),
                                ("prior_components", prior_components, 1),
                                ("chunk_size", chunk_size, 1), ("seed", seed, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"fska kernel_kwargs: {key} must be an integer >= {low}, "
                                 f"got {value!r}")
        if positive not in POSITIVE_MAPS:
            raise ValueError(f"fska kernel_kwargs: positive must be one of {POSITIVE_MAPS}, "
                             f"got {positive!r}")
        for key, value in (("lambda_spec", lambda_spec), ("eps", eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"fska kernel_kwargs: {key} must be a number >= 0, "
                                 f"got {value!r}")
        self.num_features, self.flow_layers = num_features, flow_layers
        self.flow_hidden, self.prior_components = flow_hidden, prior_components
        self.positive, self.chunk_size = positive, chunk_size
        self.eps, self.seed = float(eps), seed
        self.regularization_weight = float(lambda_spec)
        self.n_head = self.head_size = 0
        self.flow: SpectralFlow | None = None
        self.prior: SpectralMixturePrior | None = None
        self._noise: Tensor | None = None  # training draw of the last forward
        self._kl: Tensor | None = None
        self._beta: Tensor | None = None  # bandwidth of the last forward (for prefill_state)
        self._eval_cache: tuple[tuple, Tensor] | None = None

    # -- construction -------------------------------------------------------------------
    def build(self, n_head: int, head_size: int) -> None:
        """Create the per-head flow, the prior and the eval-time noise (H, M, 2 hs)."""
        if self.flow is not None:
            if (n_head, head_size) != (self.n_head, self.head_size):
                raise ValueError(f"fska kernel already built for n_head={self.n_head}, "
                                 f"head_size={self.head_size}; make a new kernel instead")
            return
        g = torch.Generator().manual_seed(self.seed)
        self.n_head, self.head_size = n_head, head_size
        self.flow = SpectralFlow(n_head, head_size, self.flow_layers, self.flow_hidden, g)
        self.prior = SpectralMixturePrior(head_size, self.prior_components, g)
        noise = torch.randn(n_head, self.num_features, 2 * head_size, generator=g, device="cpu")
        self.register_buffer("eval_noise", noise)

    @property
    def feature_dim(self) -> int:
        """M' = size of g(x): 2M for elu1, M for exp."""
        return 2 * self.num_features if self.positive == "elu1" else self.num_features

    def _check(self, x: Tensor) -> None:
        if self.flow is None:
            raise RuntimeError("fska kernel is not built: call kernel.build(n_head, head_size) "
                               "after get_kernel (ContextualMemory does this)")
        if x.shape[1] != self.n_head or x.shape[-1] != self.head_size:
            raise ValueError(f"fska kernel built for n_head={self.n_head}, head_size="
                             f"{self.head_size}; got keys of shape {tuple(x.shape)}")

    # -- frequencies ---------------------------------------------------------------------
    def _unit_frequencies_eval(self) -> Tensor:
        """Flow output on the fixed eval noise (H, M, 2hs); cached while nothing changes."""
        tensors = [*self.flow.parameters(), self.eval_noise]
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return self.flow(self.eval_noise.to(self.flow.w_in.dtype))[0].float()
        if self._eval_cache is not None and self._eval_cache[0] == key:
            return self._eval_cache[1]
        u = self.flow(self.eval_noise.to(self.flow.w_in.dtype))[0].float()
        self._eval_cache = (key, u)
        return u

    def frequencies(self, beta: Tensor) -> tuple[Tensor, Tensor]:
        """(w1, w2), each (H, M, hs) fp32, at bandwidth beta (H,): w = sqrt(beta) f(z).

        Training: fresh z ~ N(0, I) and the KL estimate on these samples is stored for
        :meth:`regularization`. Eval: the fixed ``eval_noise`` draw.
        """
        if self.training:
            z = torch.randn(self.eval_noise.shape, device=self.eval_noise.device,
                            dtype=self.flow.w_in.dtype)
            u, log_q = self.flow.sample(z)
            u = u.float()
            self._noise, self._kl = z, spectral_kl(log_q, u, self.prior)
        else:
            u = self._unit_frequencies_eval()
        w = u * beta.float().sqrt().view(-1, 1, 1)
        return w[..., :self.head_size], w[..., self.head_size:]

    def features(self, x: Tensor, w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor | None]:
        """g(x) = e^{gamma} f(x): features f (B, H, T, M') fp32 and log-scale gamma (B, H, T).

        elu1: f = ELU(phi) + 1 and gamma = None (bounded, no rescaling). exp: f = exp(log g -
        gamma) with gamma = max log g (so max f = 1), computed in log space.
        """
        if self.positive == "elu1":
            return elu1_features(x, w1, w2), None
        log_g = exp_log_features(x, w1, w2)
        gamma = log_g.amax(-1).detach()
        return torch.exp(log_g - gamma.unsqueeze(-1)), gamma

    def regularization(self) -> Tensor | None:
        """KL(flow || prior), Monte Carlo on the last training draw, mean over heads."""
        if not self.training or self._noise is None:
            return None
        kl = self._kl
        flow_trains = any(p.requires_grad for p in self.flow.parameters())
        if torch.is_grad_enabled() and flow_trains and not kl.requires_grad:
            # the forward ran without autograd (e.g. re-entrant checkpointing): recompute
            u, log_q = self.flow.sample(self._noise)
            kl = spectral_kl(log_q, u, self.prior)
        return kl

    # -- retrieval -----------------------------------------------------------------------
    def forward(self, keys: Tensor, values: Tensor, beta: Tensor) -> Tensor:
        self._check(keys)
        self._beta = beta.detach()
        with torch.autocast(device_type=keys.device.type, enabled=False):
            w1, w2 = self.frequencies(beta)
            x = keys.float()
            if torch.is_grad_enabled():  # recompute the features in backward: O(T M) less memory
                f, gamma = checkpoint(self.features, x, w1, w2, use_reentrant=False)
            else:
                f, gamma = self.features(x, w1, w2)
            v = values.float()
            if gamma is None:
                y = causal_linear_attention(f, f, v, self.chunk_size, self.eps)
            else:
                y = stable_causal_linear_attention(f, gamma, v, self.chunk_size, self.eps)
        return y.to(values.dtype)

    def init_state(self, batch: int, heads: int, head_size: int, device: torch.device,
                   dtype: torch.dtype) -> KernelState:
        """{"S": (B, H, M', hs), "z": (B, H, M')} fp32 zeros; the exp map adds "r": (B, H),
        the running max of the keys' log-scales, relative to which S and z are stored."""
        f = self.feature_dim
        state = {"S": torch.zeros(batch, heads, f, head_size, device=device, dtype=torch.float32),
                 "z": torch.zeros(batch, heads, f, device=device, dtype=torch.float32)}
        if self.positive == "exp":
            state["r"] = torch.full((batch, heads), NO_MEMORY, device=device, dtype=torch.float32)
        return state

    def _eval_frequencies(self, beta: Tensor) -> tuple[Tensor, Tensor]:
        w = self._unit_frequencies_eval() * beta.float().sqrt().view(-1, 1, 1)
        return w[..., :self.head_size], w[..., self.head_size:]

    @staticmethod
    def _add_to_state(state: KernelState, f: Tensor, gamma: Tensor | None,
                      v: Tensor) -> KernelState:
        """Add keys with features e^{gamma} f (B, H, m, M') and values v (B, H, m, hs)."""
        if gamma is None:
            return {"S": state["S"] + f.transpose(-1, -2) @ v, "z": state["z"] + f.sum(-2)}
        if f.shape[2] == 0:
            return dict(state)
        r = torch.maximum(state["r"], gamma.amax(-1))  # (B, H)
        keep = torch.exp(state["r"] - r)
        fk = f * torch.exp(gamma - r.unsqueeze(-1)).unsqueeze(-1)
        return {"S": state["S"] * keep.view(*keep.shape, 1, 1) + fk.transpose(-1, -2) @ v,
                "z": state["z"] * keep.unsqueeze(-1) + fk.sum(-2), "r": r}

    def prefill_state(self, state: KernelState, keys: Tensor, values: Tensor) -> KernelState:
        """Add entries using the eval frequencies at the bandwidth of the last forward."""
        self._check(keys)
        if self._beta is None:
            raise RuntimeError("fska prefill_state needs the bandwidth of a preceding forward "
                               "call; run the kernel's forward on the prompt first")
        with torch.autocast(device_type=keys.device.type, enabled=False):
            w1, w2 = self._eval_frequencies(self._beta)
            f, gamma = self.features(keys.float(), w1, w2)
            return self._add_to_state(state, f, gamma, values.float())

    def extend(self, state: KernelState, queries: Tensor, keys: Tensor, values: Tensor,
               beta: Tensor) -> tuple[Tensor, KernelState]:
        """O(1)-per-token decoding step with the fixed eval frequencies."""
        self._check(queries)
        self._beta = beta.detach()
        n, m = queries.shape[2], keys.shape[2]
        with torch.autocast(device_type=queries.device.type, enabled=False):
            w1, w2 = self._eval_frequencies(beta)
            fq, _ = self.features(queries.float(), w1, w2)
            fk, gamma = self.features(keys.float(), w1, w2)
            v = values.float()
            mask = extend_mask(n, 0, m, queries.device)  # (n, m)
            scores = (fq @ fk.transpose(-1, -2)).masked_fill(~mask, 0.0)  # (B, H, n, m)
            carry = None
            if gamma is not None:  # rescale relative to mu_i = max visible log-scale
                seen = torch.where(mask, gamma.unsqueeze(-2), NO_MEMORY)  # (B, H, n, m)
                mu = torch.maximum(seen.amax(-1) if m else state["r"].unsqueeze(-1),
                                   state["r"].unsqueeze(-1))  # (B, H, n)
                rel = torch.where(mask, gamma.unsqueeze(-2) - mu.unsqueeze(-1), float("-inf"))
                scores = scores * torch.exp(rel)
                carry = torch.exp(state["r"].unsqueeze(-1) - mu)  # (B, H, n)
            num_mem = fq @ state["S"]
            den_mem = (fq @ state["z"].unsqueeze(-1)).squeeze(-1)
            if carry is not None:
                num_mem, den_mem = num_mem * carry.unsqueeze(-1), den_mem * carry
            num = num_mem + scores @ v
            den = den_mem + scores.sum(-1)
            y = num / (den.unsqueeze(-1) + self.eps)
            new = self._add_to_state(state, fk, gamma, v)
        return y.to(values.dtype), new

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, num_features={self.num_features}, positive="
                f"{self.positive!r}, flow_layers={self.flow_layers}, "
                f"lambda_spec={self.regularization_weight}, chunk_size={self.chunk_size}")
