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

Paths of the strict-past retrieval (training and prompts): with the elu1 map, the fused
Triton scan of :mod:`mosaics.ops.linear_attention` where ``MOSAICS_FUSED`` allows it (CUDA by
default; :class:`FusedElu1Attention`), else the segmented PyTorch scan
(:class:`CosineFeatureAttention`); the exp map always takes its log-space chunked scan
(:func:`stable_causal_linear_attention`). ``mosaics.ops.triton_backend.PATHS["fska"]`` says
which ran last. Decoding steps keep their O(1) running sums.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..cache import FeatureSums, KernelMemory
from ..ops.feature_attention import (
    NO_MEMORY,
    CosineFeatureAttention,
    FusedElu1Attention,
    chunked_causal_linear_attention,
    fused_precision,
    interval_linear_attention,
    log_pairs,
    pair_weights,
    row_reference,
    stable_causal_linear_attention,
)
from ..ops.intervals import (
    attend_plan,
    bounds_mask,
    causal_offset,
    check_attend_args,
    interval_bounds,
    run_plan,
)
from ..ops.linear_attention import linear_attention_unsupported
from ..ops.triton_backend import fused_expected, fused_reason, note_path
from .base import Kernel, extend_mask, register_kernel
from .spectral_flow import (
    SpectralFlow,
    SpectralMixturePrior,
    angle_features,
    elu1_features,
    exp_log_features,
    projections,
    spectral_kl,
)

POSITIVE_MAPS = ("elu1", "exp")


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
        linear_intervals: :meth:`attend` at one bandwidth per head with the elu1 map: None
            takes the cheaper of the dense chunks and the linear-time path, True / False
            always the one or the other.
    The per-head modules are created by :meth:`build` (the memory block calls it right after
    construction, so weights exist before a checkpoint is loaded).
    """

    def __init__(self, num_features: int = 96, flow_layers: int = 5, flow_hidden: int = 64,
                 prior_components: int = 10, lambda_spec: float = 1e-3,
                 positive: str = "elu1", chunk_size: int = 64, eps: float = 1e-20,
                 seed: int = 0, linear_intervals: bool | None = None) -> None:
        super().__init__()
        for key, value, low in (("num_features", num_features, 1), ("flow_layers", flow_layers, 0),
                                ("flow_hidden", flow_hidden, 1),
                                ("prior_components", prior_components, 1),
                                ("chunk_size", chunk_size, 1), ("seed", seed, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"fska kernel_kwargs: {key} must be an integer >= {low}, "
                                 f"got {value!r}")
        if linear_intervals not in (None, True, False):
            raise ValueError(f"fska kernel_kwargs: linear_intervals must be null, true or "
                             f"false, got {linear_intervals!r}")
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
        self._eval_cache: tuple[tuple, Tensor] | None = None
        self._freq_cache: tuple[Tensor, Tensor, tuple[Tensor, Tensor]] | None = None
        self.linear_intervals = linear_intervals

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
        w = self.unit_frequencies() * beta.float().sqrt().view(-1, 1, 1)
        return w[..., :self.head_size], w[..., self.head_size:]

    def unit_frequencies(self) -> Tensor:
        """u = f(z) (H, M, 2 hs) fp32 at unit bandwidth (see :meth:`frequencies`)."""
        if not self.training:
            return self._unit_frequencies_eval()
        z = torch.randn(self.eval_noise.shape, device=self.eval_noise.device,
                        dtype=self.flow.w_in.dtype)
        u, log_q = self.flow.sample(z)
        u = u.float()
        self._noise, self._kl = z, spectral_kl(log_q, u, self.prior)
        return u

    def features(self, x: Tensor, w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor | None]:
        """Features (B, H, T, M') fp32 and, for the exp map, log g (B, H, T, M).

        elu1: g = ELU(phi) + 1 (bounded) and None. exp: f = exp(log g - gamma) with
        gamma = max log g per position (so max f = 1), and log g itself.
        """
        if self.positive == "elu1":
            return elu1_features(x, w1, w2), None
        log_g = exp_log_features(x, w1, w2)
        gamma = log_g.detach().amax(-1, keepdim=True)
        return torch.exp(log_g - gamma), log_g

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
        precision = fused_precision(keys)  # bf16 products for half keys or a half autocast
        with torch.autocast(device_type=keys.device.type, enabled=False):
            w1, w2 = self.frequencies(beta)
            x = keys.float()
            reason = self._fused_reason(x, values.float())  # fp32, as the chunked paths
            note_path(self.name, reason, expected=fused_expected(x))
            if reason is None:
                return self._fused(x, values.float(), w1, w2, precision).to(values.dtype)
            if self.positive == "elu1":
                y = CosineFeatureAttention.apply(x, values.float(), w1, w2, self.chunk_size,
                                                  self.eps)
                return y.to(values.dtype)
            if torch.is_grad_enabled():  # recompute the features in backward: O(T M) less memory
                f, log_g = checkpoint(self.features, x, w1, w2, use_reentrant=False)
            else:
                f, log_g = self.features(x, w1, w2)
            v = values.float()
            if log_g is None:
                y = chunked_causal_linear_attention(f, f, v, self.chunk_size, self.eps)
            else:
                y = stable_causal_linear_attention(f, log_g, v, self.chunk_size, self.eps)
        return y.to(values.dtype)

    def _fused_reason(self, x: Tensor, values: Tensor) -> str | None:
        """None when :meth:`forward` takes the fused Triton scan, else why not: the switch
        and device (``MOSAICS_FUSED``, :func:`~mosaics.ops.triton_backend.fused_reason`),
        the shapes, or the exp map, whose log-space scan (per-feature running maxima of the
        state, a reference per row) the plain fp32 kernel does not do."""
        if self.positive != "elu1":
            return (f"positive={self.positive!r} keeps its features in log space; only the "
                    "elu1 map has a fused scan")
        return fused_reason(x, values) or linear_attention_unsupported(x, None, values)

    @torch.compiler.disable  # Triton launches from a module loaded by path: run them eagerly
    def _fused(self, x: Tensor, v: Tensor, w1: Tensor, w2: Tensor,
               precision: str | None = None) -> Tensor:
        """The strict-past retrieval through the fused kernels (:class:`FusedElu1Attention`),
        in chunks of ``chunk_size`` rows when that is a power of two from 16 to 128 (a
        ``tl.dot`` side; the per-chunk blocks stay in registers), else of 64; ``precision``
        from :func:`~mosaics.ops.feature_attention.fused_precision`."""
        c = self.chunk_size
        chunk = c if 16 <= c <= 128 and c & (c - 1) == 0 else 64
        return FusedElu1Attention.apply(x.contiguous(), v.contiguous(), w1, w2, self.eps, chunk,
                                        precision)

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, beta: Tensor,
               lo: Tensor, hi: Tensor) -> Tensor:
        """Retrieval over per-query intervals lo[i] <= j <= hi[i] (see :meth:`Kernel.attend`):

            y_i = sum_j k_ij v_j / (sum_j k_ij + eps),   k_ij = g(q_i) . g(k_j),

        Every interval and bandwidth is honoured exactly:

        - one bandwidth per head (H,): the features of all queries and keys once; the strict
          past (queries = keys) is :meth:`forward`; with the elu1 map, other intervals run in
          linear time (:func:`interval_linear_attention`: differences of chunk prefix states
          plus the two partial chunks at the ends) when that computes less than the dense
          form (``_linear_pays``), which is chunk by chunk of query rows over the columns each
          chunk sees, one (rows, columns) product each, cost O(n (h + chunk) M') for windows
          of h;
        - one per query (B or 1, H, n): the frequencies sqrt(beta_i) u differ per query, so
          the keys' features are recomputed for every (query, key) pair of a chunk: cost
          O(n (h + chunk) M) sines and cosines (elu1) or exponentials (exp), far more.

        The exp map works relative to each row's largest k_ij (as :meth:`forward` does, so
        eps acts on the rescaled sum); elu1 on k_ij itself. Frequencies as in
        :meth:`forward` (fresh in training, fixed in eval); each chunk is recomputed in
        backward (activation checkpointing).
        """
        self._check(queries)
        beta4 = check_attend_args(queries, keys, values, beta, lo, hi)
        B, H, n, _ = queries.shape
        per_query = beta.dim() == 3
        if not per_query and queries is keys and causal_offset(lo, hi) == -1:
            return self.forward(keys, values, beta)  # the strict past: the chunked scan
        features = self.feature_dim if per_query else 1
        plan = attend_plan(lo, hi, keys.shape[2], B * H * features, self.chunk_elements)
        with torch.autocast(device_type=queries.device.type, enabled=False):
            u = self.unit_frequencies()
            u1, u2 = u[..., :self.head_size], u[..., self.head_size:]
            q, k, v = queries.float(), keys.float(), values.float()
            if per_query:  # angles at unit bandwidth, scaled per query inside each chunk
                qa, ka = projections(q, u1, u2), projections(k, u1, u2)
                scale = beta4.float().sqrt()  # (B or 1, H, n, 1)
                chunk = self._pair_chunk
            else:
                root = beta.float().sqrt().view(-1, 1, 1)
                w1, w2 = u1 * root, u2 * root
                if self.positive == "elu1" and self._linear_pays(plan, n, k.shape[2],
                                                                 v.shape[-1]):
                    y = self._linear(q, k if queries is not keys else None, v, w1, w2, lo, hi)
                    return y.to(values.dtype)
                qa = self.features(q, w1, w2)
                ka = qa if queries is keys else self.features(k, w1, w2)
                scale = None
                chunk = self._feature_chunk
            def args(a: int, b: int, c0: int, c1: int) -> tuple:
                return ([x[:, :, a:b] for x in qa if x is not None],
                        [x[:, :, c0:c1] for x in ka if x is not None], v[:, :, c0:c1],
                        interval_bounds(lo, a, b, c0), interval_bounds(hi, a, b, c0),
                        None if scale is None else scale[:, :, a:b])

            y = run_plan(plan, n, lambda m: v.new_zeros(B, H, m, v.shape[-1]), chunk, args,
                         torch.is_grad_enabled())
        return y.to(values.dtype)

    def step(self, memory: KernelMemory, queries: Tensor, keys: Tensor, values: Tensor,
             beta: Tensor, lo: Tensor | None = None, hi: Tensor | None = None,
             base: int = 0) -> tuple[Tensor, KernelMemory]:
        """Decoding (:meth:`Kernel.step`). The strict past: O(1) features per token from the
        running sums of every entry (:meth:`_past_step`). Intervals: the entries are kept; one
        query at a time from running sums over its interval (:meth:`_interval_step`) when the
        map is elu1, the bandwidth one per head and nothing needs gradients (the sums exist
        already, or n = 1), else :meth:`attend` over the entries held."""
        if lo is None:
            return self._past_step(memory, queries, keys, values, beta)
        memory = memory.append(keys, values)
        run = memory.sums if memory.sums is not None and memory.sums.hi is not None else None
        n = queries.shape[2]
        if (not self.training and self.positive == "elu1" and beta.dim() == 1
                and self.linear_intervals is not False and not torch.is_grad_enabled()
                and (n == 1 or run is not None)):
            ys = []
            for i in range(n):
                y, memory = self._interval_step(memory, queries[:, :, i:i + 1], beta,
                                                lo[:, i:i + 1], hi[:, i:i + 1], base)
                ys.append(y)
            return torch.cat(ys, dim=2), memory
        if base > 0 and run is not None and bool((lo < base).any()):
            raise RuntimeError(
                "this decoding cache kept only the running sums of entries a query can still "
                "see, not the entries: continue it under torch.no_grad() with the model in "
                "eval mode (as generate does), or rebuild it from the prompt")
        return self.attend(queries, memory.keys, memory.values, beta,
                           (lo - base).clamp(min=0), hi - base), memory

    def _interval_step(self, memory: KernelMemory, query: Tensor, beta: Tensor, lo: Tensor,
                       hi: Tensor, base: int) -> tuple[Tensor, KernelMemory]:
        """One query over its visible interval in O(1) features per token (elu1 map, one
        bandwidth per head, eval frequencies).

        The memory keeps the running sums over the entries the last step saw, in float64
        (``memory.sums``): S = sum_j g(k_j) v_j^T (B, H, M', hv), z = sum_j g(k_j) (B, H, M'),
        and that interval's absolute bounds lo, hi (B,). The step adds the entries
        that entered (lo .. hi grows at hi) and subtracts those that left (a window's oldest),
        each entry once; a row whose new interval starts past the old one (a new document), or
        whose entries to subtract are no longer stored, restarts from its interval. Then
        y = g(q) S / (g(q) . z + eps), as :meth:`attend`."""
        self._check(query)
        keys, values = memory.keys, memory.values
        B, H, S, hv = values.shape
        # entries before base may be held by the sums alone (a windowless memory drops them)
        lo = lo.reshape(-1).expand(B)
        hi = hi.reshape(-1).expand(B).clamp(max=base + S - 1)
        hi = torch.maximum(hi, lo - 1)  # an empty interval: lo .. lo - 1
        f = self.feature_dim
        with torch.autocast(device_type=query.device.type, enabled=False):
            w1, w2 = self._eval_frequencies(beta)
            run = memory.sums
            if run is not None and run.hi is not None:  # updated in place below
                sums, zs, cur_lo, cur_hi = run.S.contiguous(), run.z, run.lo, run.hi
                # a row restarts when its interval starts past the sums, or when the entries
                # it should subtract are no longer stored
                restart = (lo > cur_hi) | ((lo > cur_lo) & (cur_lo < base))
                if bool(restart.any()):
                    keep = (~restart).to(sums.dtype)
                    sums, zs = sums * keep.view(B, 1, 1, 1), zs * keep.view(B, 1, 1)
                    cur_lo = torch.where(restart, lo, cur_lo)
                    cur_hi = torch.where(restart, lo - 1, cur_hi)
            else:
                sums = values.new_zeros(B, H, f, hv, dtype=torch.float64)
                zs = values.new_zeros(B, H, f, dtype=torch.float64)
                cur_lo, cur_hi = lo, lo - 1
            # the entries that enter (weight +1) and leave (-1), and the query: one feature call
            rows, signs, vals = [], [], []
            for start, stop, sign in ((cur_hi + 1, hi + 1, 1.0), (cur_lo, lo, -1.0)):
                moves = stop > start  # the rows with entries to add (or subtract)
                if not bool(moves.any()):
                    continue
                a, b = int(start[moves].min()), int(stop[moves].max())
                if a < base:
                    raise RuntimeError(f"fska step: entry {a} is needed but the memory "
                                       f"starts at {base}; rebuild the cache from the prompt")
                j = torch.arange(a, b, device=query.device)
                inside = (j >= start.view(B, 1)) & (j < stop.view(B, 1))  # (B, m)
                rows.append(keys[:, :, a - base:b - base])
                signs.append(inside.to(torch.float64) * sign)
                vals.append(values[:, :, a - base:b - base])
            x = torch.cat([*(r.to(query.dtype) for r in rows), query], 2) if rows else query
            g = elu1_features(x.float(), w1, w2).double()  # (B, H, m + 1, M')
            fq = g[:, :, -1:]
            if rows:
                fk = g[:, :, :-1] * torch.cat(signs, 1).view(B, 1, -1, 1)
                v = torch.cat(vals, 2).double()
                m = fk.shape[2]
                sums.view(B * H, f, hv).baddbmm_(fk.transpose(-1, -2).reshape(B * H, f, m),
                                                 v.reshape(B * H, m, hv))
                zs.add_(fk.sum(-2))
            den = (fq @ zs.unsqueeze(-1) + self.eps).clamp_min(torch.finfo(torch.float32).tiny)
            y = (fq @ sums) / den
        return y.to(values.dtype), replace(memory, sums=FeatureSums(sums, zs, lo=lo, hi=hi))

    def _linear(self, q: Tensor, k: Tensor | None, v: Tensor, w1: Tensor, w2: Tensor,
                lo: Tensor, hi: Tensor) -> Tensor:
        """:func:`interval_linear_attention` on the elu1 features of q and k (None: k = q),
        all of it recomputed in backward under autograd. Measured on v2 FSKA at T 4096
        (``bench/long_context.py``, one run each): the peak of a training step 1.14x GPT-2's
        at 0.46x its tokens/s; recomputing only the features, 1.36x at 0.50x; nothing,
        1.53x at 0.53x."""
        def run(q: Tensor, k: Tensor | None, v: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
            fq = elu1_features(q, w1, w2)
            fk = fq if k is None else elu1_features(k, w1, w2)
            return interval_linear_attention(fq, fk, v, lo, hi, self.chunk_size, self.eps,
                                             self.chunk_elements)

        if torch.is_grad_enabled():
            return checkpoint(run, q, k, v, w1, w2, use_reentrant=False)
        return run(q, k, v, w1, w2)

    def _linear_pays(self, plan: list[tuple[int, int, int, int]], n: int, S: int,
                     hv: int) -> bool:
        """Whether :func:`interval_linear_attention` is the faster, by multiply-adds: S F hv for
        the chunk states and n (4 F hv + 2 C (F + hv)) for the rows (float64 prefix products
        counted twice), against sum rows x columns x (F + hv) for the dense chunks of
        ``plan``, plus, under autograd, the whole-input zero gradient that each chunk's slices
        allocate, n F + S (F + hv) per chunk. ``bench/attend.py --kernels fska`` checks the
        choice (windows of 256 and gaps, T 1024-8192). ``linear_intervals`` forces either."""
        if self.linear_intervals is not None:
            return self.linear_intervals
        f, c = self.feature_dim, self.chunk_size
        dense = sum((b - a) * (c1 - c0) for a, b, c0, c1 in plan) * (f + hv)
        if torch.is_grad_enabled():
            dense += len(plan) * (n * f + S * (f + hv))
        return S * f * (hv + 1) + n * (4 * f * (hv + 1) + 2 * c * (f + hv)) < dense

    def _feature_chunk(self, q: list[Tensor], k: list[Tensor], v: Tensor, lo: Tensor,
                       hi: Tensor, scale: None) -> Tensor:
        """One chunk at a bandwidth per head: q = [features (B, H, rows, M')] plus, for the
        exp map, [log g], the same for the keys' columns; lo, hi (B or 1, rows) relative to
        the first column."""
        mask = bounds_mask(lo, hi, v.shape[2])
        pairs = q[0] @ k[0].transpose(-1, -2)
        if self.positive == "elu1":
            w = torch.where(mask, pairs, 0.0)
        else:  # k_ij = (f_i . f_j) e^{gamma_i + gamma_j}, relative to the row's largest
            gq, gk = q[1].detach().amax(-1), k[1].detach().amax(-1)
            nu = log_pairs(pairs, gq, gk, mask).amax(-1)
            w = pair_weights(pairs, gq, gk, torch.where(torch.isfinite(nu), nu, 0.0), mask)
        return self._normalized(w, v)

    def _pair_chunk(self, q: list[Tensor], k: list[Tensor], v: Tensor, lo: Tensor, hi: Tensor,
                    scale: Tensor) -> Tensor:
        """One chunk at a bandwidth per query: the angles (W_1 x, W_2 x) at unit bandwidth of
        the chunk's queries (B, H, rows, M) and keys (B, H, cols, M), scale = sqrt(beta_i)
        (B or 1, H, rows, 1); the keys' features are formed per (query, key) pair."""
        mask = bounds_mask(lo, hi, v.shape[2])
        q1, q2 = q[0] * scale, q[1] * scale
        s = scale.unsqueeze(-1)  # (., H, rows, 1, 1) against keys (B, H, 1, cols, M)
        k1, k2 = k[0].unsqueeze(2) * s, k[1].unsqueeze(2) * s
        fq, fk = angle_features(q1, q2, self.positive), angle_features(k1, k2, self.positive)
        if self.positive == "elu1":
            w = torch.where(mask, (fk @ fq.unsqueeze(-1)).squeeze(-1), 0.0)
        else:
            log_k = torch.logsumexp(fq.unsqueeze(-2) + fk, dim=-1).masked_fill(~mask,
                                                                               float("-inf"))
            nu = log_k.detach().amax(-1, keepdim=True)
            w = torch.exp(log_k - torch.where(torch.isfinite(nu), nu, 0.0))
        return self._normalized(w, v)

    def _normalized(self, w: Tensor, v: Tensor) -> Tensor:
        """(w V) / (sum_j w + eps), 0 on rows without weight."""
        den = (w.sum(-1, keepdim=True) + self.eps).clamp_min(torch.finfo(w.dtype).tiny)
        return (w @ v) / den

    def _eval_frequencies(self, beta: Tensor) -> tuple[Tensor, Tensor]:
        """(w1, w2) at the eval noise and bandwidth beta; outside autograd, kept while the
        flow's output and beta stay the same (a decoding step asks for them per memory)."""
        u = self._unit_frequencies_eval()
        tracked = torch.is_grad_enabled() and beta.requires_grad
        hit = self._freq_cache
        if (not tracked and hit is not None and hit[0] is u and hit[1].shape == beta.shape
                and hit[1].device == beta.device and torch.equal(hit[1], beta)):
            return hit[2]
        w = u * beta.float().sqrt().view(-1, 1, 1)
        out = (w[..., :self.head_size], w[..., self.head_size:])
        if not tracked and not u.requires_grad:
            self._freq_cache = (u, beta.detach().clone(), out)
        return out

    @staticmethod
    def _add_to_sums(sums: FeatureSums, f: Tensor, log_g: Tensor | None,
                     v: Tensor) -> FeatureSums:
        """Add keys (features f or log g, (B, H, m, M')) with values v (B, H, m, hs)."""
        if log_g is None:
            return FeatureSums(sums.S + f.transpose(-1, -2) @ v, sums.z + f.sum(-2))
        if log_g.shape[2] == 0:
            return replace(sums)
        r = torch.maximum(sums.r, log_g.amax(2))  # (B, H, M)
        keep = torch.exp(sums.r - r)
        fk = torch.exp(log_g - r.unsqueeze(2))
        return FeatureSums(sums.S * keep.unsqueeze(-1) + fk.transpose(-1, -2) @ v,
                           sums.z * keep + fk.sum(-2), r)

    def memory_of(self, keys: Tensor, values: Tensor, beta: Tensor) -> KernelMemory:
        """The running sums of (B, H, m, hs) entries, in fp32, at the eval frequencies and the
        bandwidth beta (H,): S = sum_j g(k_j) v_j^T (B, H, M', hs), z = sum_j g(k_j)
        (B, H, M'); the exp map keeps them relative to r (B, H, M), the per-feature running
        max of the keys' log g. No entry is stored."""
        self._check(keys)
        B, H, _, hv = values.shape
        f = self.feature_dim
        zeros = FeatureSums(keys.new_zeros(B, H, f, hv, dtype=torch.float32),
                            keys.new_zeros(B, H, f, dtype=torch.float32))
        if self.positive == "exp":
            zeros.r = torch.full((B, H, f), NO_MEMORY, device=keys.device, dtype=torch.float32)
        with torch.autocast(device_type=keys.device.type, enabled=False):
            w1, w2 = self._eval_frequencies(beta)
            fk, log_g = self.features(keys.float(), w1, w2)
            sums = self._add_to_sums(zeros, fk, log_g, values.float())
        return KernelMemory(keys[:, :, :0], values[:, :, :0], sums)

    def _past_step(self, state: KernelMemory, queries: Tensor, keys: Tensor, values: Tensor,
                   beta: Tensor) -> tuple[Tensor, KernelMemory]:
        """A strict-past decoding step in O(1) features per token, at the eval frequencies."""
        self._check(queries)
        sums = state.sums
        n, m = queries.shape[2], keys.shape[2]
        with torch.autocast(device_type=queries.device.type, enabled=False):
            w1, w2 = self._eval_frequencies(beta)
            fq, lq = self.features(queries.float(), w1, w2)
            fk, lk = self.features(keys.float(), w1, w2)
            v = values.float()
            mask = extend_mask(n, 0, m, queries.device)  # (n, m)
            pairs = fq @ fk.transpose(-1, -2)  # (B, H, n, m)
            if lq is None:
                w = pairs.masked_fill(~mask, 0.0)
                num, den = fq @ sums.S + w @ v, fq @ sums.z.unsqueeze(-1)
            else:  # relative to nu_i, as in stable_causal_linear_attention
                gq, gk = lq.amax(-1), lk.amax(-1)
                r = sums.r.unsqueeze(2)  # (B, H, 1, M)
                nu = row_reference((lq + r).amax(-1), log_pairs(pairs, gq, gk, mask))
                w = pair_weights(pairs, gq, gk, nu, mask)
                q_w = torch.exp(lq + r - nu.unsqueeze(-1))
                num, den = q_w @ sums.S + w @ v, q_w @ sums.z.unsqueeze(-1)
            den = den.squeeze(-1) + w.sum(-1)
            y = num / (den.unsqueeze(-1) + self.eps)
            new = replace(state, sums=self._add_to_sums(sums, fk, lk, v))
        return y.to(values.dtype), new

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, num_features={self.num_features}, positive="
                f"{self.positive!r}, flow_layers={self.flow_layers}, "
                f"lambda_spec={self.regularization_weight}, chunk_size={self.chunk_size}")
