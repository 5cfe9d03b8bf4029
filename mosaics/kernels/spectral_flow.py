"""Learned spectral densities for the FSKA kernel: a per-head RealNVP flow, the fixed
spectral-mixture prior it is regularised towards, and the random-feature maps.

A frequency pair (w1, w2) in R^hs x R^hs is one vector u = [w1; w2] in R^{2 hs}. Every head
h has its own flow f_h: z ~ N(0, I_{2hs}) -> u = f_h(z), a stack of affine couplings

    u_b = u_b * exp(s(u_a)) + t(u_a),   s = S tanh(s_raw / S)   (bounded log-scale),

that alternately update w2 from w1 and w1 from w2. The last layer of every coupling network
starts at zero, so the flow starts as the identity; the exact log-density is
log q(u) = log N(z; 0, I) - sum of log-scales. The flows of all heads run as one batched
matmul per coupling (per-head weights stacked on a leading head dimension).

The prior is a fixed nonstationary Gaussian spectral mixture: Q components, each a product
over dimensions i of bivariate normals on (w1_i, w2_i) with means (m1, m2), scales (s1, s2)
and correlation rho = tanh(r) in (-1, 1).

Features with M frequency pairs W1, W2 (M, hs) of input x (hs,):

    phi(x)  = (4M)^-1/2 [cos(W1 x) + cos(W2 x) ; sin(W1 x) + sin(W2 x)]        (2M,)
    phi(x).phi(y) = (4M)^-1 sum_m [cos(w1.(x-y)) + cos(w2.(x-y)) + cos(w1.x - w2.y)
                                   + cos(w2.x - w1.y)]
    elu1:   g(x) = ELU(phi(x)) + 1                                                (2M,)
    exp:    g(x) = (4M)^-1/2 [exp(W1 x) + exp(W2 x)]                               (M,)

The exp map is the positive (Performer-style) analogue of phi: g(x).g(y) sums
exp(w1.x + w1.y) + exp(w1.x + w2.y) + exp(w2.x + w1.y) + exp(w2.x + w2.y), whose expectation
for independent w1, w2 ~ N(0, beta I) on unit vectors is proportional to exp(beta cos) + 1,
the same form as phi's. Performer's exp(-beta |x|^2 / 2) factor is a constant on unit keys
and cancels in the attention normalisation, so it is left out. The exp map is computed in
log space, log g(x), and rescaled per key and per query before use.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.feature_attention import (  # noqa: F401  (the feature maps, re-exported)
    angle_cosine_features,
    angle_features,
    cosine_features,
    elu1_features,
    exp_log_features,
    projections,
)

LOG_SCALE_BOUND = 2.0  # |log-scale| of one coupling is below this
LOG_2PI = math.log(2.0 * math.pi)


class SpectralFlow(nn.Module):
    """Per-head RealNVP flow on R^{2 hs}, all heads evaluated together.

    Parameters per coupling l (stacked over l and heads h):
        w_in (L, H, hs, hidden), b_in (L, H, 1, hidden)        first layer
        w_out (L, H, hidden, 2 hs), b_out (L, H, 1, 2 hs)      last layer, zero at init
    """

    def __init__(self, n_head: int, head_size: int, layers: int, hidden: int,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.n_head, self.head_size, self.layers, self.hidden = n_head, head_size, layers, hidden
        L, H, hs = layers, n_head, head_size
        w_in = torch.randn(L, H, hs, hidden, generator=generator, device="cpu") / math.sqrt(hs)
        self.w_in = nn.Parameter(w_in)
        self.b_in = nn.Parameter(torch.zeros(L, H, 1, hidden, device="cpu"))
        self.w_out = nn.Parameter(torch.zeros(L, H, hidden, 2 * hs, device="cpu"))
        self.b_out = nn.Parameter(torch.zeros(L, H, 1, 2 * hs, device="cpu"))

    def _scale_shift(self, layer: int, cond: Tensor) -> tuple[Tensor, Tensor]:
        """Bounded log-scale and shift (H, N, hs) of coupling ``layer`` from (H, N, hs)."""
        h = F.gelu(torch.baddbmm(self.b_in[layer], cond, self.w_in[layer]))
        out = torch.baddbmm(self.b_out[layer], h, self.w_out[layer])
        s_raw, t = out.split(self.head_size, dim=-1)
        return LOG_SCALE_BOUND * torch.tanh(s_raw / LOG_SCALE_BOUND), t

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """u = f(z) and log|det df/dz|. z: (H, N, 2 hs) -> (H, N, 2 hs), (H, N)."""
        self._check(z)
        a, b = z.split(self.head_size, dim=-1)
        logdet = z.new_zeros(z.shape[:-1])
        for layer in range(self.layers):
            if layer % 2 == 0:  # update w2 from w1
                s, t = self._scale_shift(layer, a)
                b = b * torch.exp(s) + t
            else:  # update w1 from w2
                s, t = self._scale_shift(layer, b)
                a = a * torch.exp(s) + t
            logdet = logdet + s.sum(-1)
        return torch.cat([a, b], dim=-1), logdet

    def inverse(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """z = f^-1(u) and log|det df^-1/du|. u: (H, N, 2 hs) -> (H, N, 2 hs), (H, N)."""
        self._check(u)
        a, b = u.split(self.head_size, dim=-1)
        logdet = u.new_zeros(u.shape[:-1])
        for layer in reversed(range(self.layers)):
            if layer % 2 == 0:
                s, t = self._scale_shift(layer, a)
                b = (b - t) * torch.exp(-s)
            else:
                s, t = self._scale_shift(layer, b)
                a = (a - t) * torch.exp(-s)
            logdet = logdet - s.sum(-1)
        return torch.cat([a, b], dim=-1), logdet

    def sample(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Frequencies u = f(z) and their exact log-density log q(u), (H, N, 2hs), (H, N)."""
        u, logdet = self.forward(z)
        log_base = -0.5 * (z * z).sum(-1) - 0.5 * z.shape[-1] * LOG_2PI
        return u, log_base - logdet

    def _check(self, x: Tensor) -> None:
        if x.dim() != 3 or x.shape[0] != self.n_head or x.shape[-1] != 2 * self.head_size:
            raise ValueError(f"SpectralFlow expects (n_head={self.n_head}, N, "
                             f"2*head_size={2 * self.head_size}), got {tuple(x.shape)}")

    def extra_repr(self) -> str:
        return (f"n_head={self.n_head}, head_size={self.head_size}, layers={self.layers}, "
                f"hidden={self.hidden}")


def bivariate_normal_log_prob(a: Tensor, b: Tensor, mean_a: Tensor, mean_b: Tensor,
                              sigma_a: Tensor, sigma_b: Tensor, rho: Tensor) -> Tensor:
    """log N((a, b); (mean_a, mean_b), [[sa^2, rho sa sb], [rho sa sb, sb^2]]), elementwise.

    With x = (a - mean_a) / sigma_a and y = (b - mean_b) / sigma_b:
    -log(2 pi sigma_a sigma_b sqrt(1 - rho^2)) - (x^2 - 2 rho x y + y^2) / (2 (1 - rho^2)).
    """
    x = (a - mean_a) / sigma_a
    y = (b - mean_b) / sigma_b
    one_m = 1.0 - rho * rho
    quad = (x * x - 2.0 * rho * x * y + y * y) / one_m
    return -LOG_2PI - torch.log(sigma_a) - torch.log(sigma_b) - 0.5 * torch.log(one_m) - 0.5 * quad


class SpectralMixturePrior(nn.Module):
    """Fixed nonstationary Gaussian spectral mixture on u = [w1; w2] in R^{2 hs}.

    Buffers (saved with the model, never trained):
        weight_logits (Q,), mean (Q, 2, hs), log_scale (Q, 2, hs), rho_raw (Q, hs);
    p(u) = sum_q pi_q prod_i N2((w1_i, w2_i); mean_q[:, i], scale_q[:, i], tanh(rho_raw_qi)).
    The default draw (seeded) centres the components near the flow's initial N(0, I): means
    N(0, 0.5^2), scales exp(U(-0.5, 0.5)), correlations tanh(N(0, 1)), equal weights.
    """

    def __init__(self, head_size: int, components: int,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        Q, hs = components, head_size
        self.head_size, self.components = hs, Q
        kw = {"generator": generator, "device": "cpu"}
        self.register_buffer("weight_logits", torch.zeros(Q, device="cpu"))
        self.register_buffer("mean", 0.5 * torch.randn(Q, 2, hs, **kw))
        self.register_buffer("log_scale", torch.rand(Q, 2, hs, **kw) - 0.5)
        self.register_buffer("rho_raw", torch.randn(Q, hs, **kw))

    def log_prob(self, u: Tensor) -> Tensor:
        """log p(u) for u (..., 2 hs) -> (...)."""
        if u.shape[-1] != 2 * self.head_size:
            raise ValueError(f"prior expects frequency vectors of size 2*head_size="
                             f"{2 * self.head_size}, got {u.shape[-1]}")
        w1, w2 = u.unsqueeze(-2).split(self.head_size, dim=-1)  # (..., 1, hs) each
        mean, scale = self.mean.to(u.dtype), self.log_scale.to(u.dtype).exp()
        rho = torch.tanh(self.rho_raw.to(u.dtype))
        per_dim = bivariate_normal_log_prob(w1, w2, mean[:, 0], mean[:, 1], scale[:, 0],
                                            scale[:, 1], rho)  # (..., Q, hs)
        log_pi = torch.log_softmax(self.weight_logits.to(u.dtype), dim=0)
        return torch.logsumexp(log_pi + per_dim.sum(-1), dim=-1)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, components={self.components}"


def spectral_kl(log_q: Tensor, u: Tensor, prior: SpectralMixturePrior) -> Tensor:
    """Monte Carlo KL(q || p) on the flow's own samples, averaged over heads: 0-dim.

    log_q, u: (H, N), (H, N, 2 hs) from :meth:`SpectralFlow.sample`.
    """
    return (log_q - prior.log_prob(u)).mean()
