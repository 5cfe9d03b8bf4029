"""The fast paths of the model, each behind one function with its plain reference beside it.

=======================  ==============================  ======================================
op                       reference                       what it computes
=======================  ==============================  ======================================
``leaky_average``        ``leaky_average_reference``     kbar_t = g_t x_t + e^{-a_t} kbar_{t-1}
``unit_vectors``         ``unit_vectors_reference``      x / max(|x|, eps)
``lookahead_values``     ``lookahead_values_reference``  unit((1 - c) v~_{s+1} + c v~_s)
``causal_attention``     ``causal_attention_reference``  softmax(scale q k^T, s <= t) v
``bank_attention``       ``bank_attention_reference``    softmax(q M_k^T) M_v
``linear_cross_entropy`` ``linear_cross_entropy_ref..``  CE(h W^T, y) without the logits
``causal_linear_att..``  ``causal_linear_att.._ref..``   sum_{s<t} q_t.k_s [v_s, 1], normalised
``power_attention``      ``power_attention_reference``   [a (q.k - m) - s]_+^r / sum, j in lo..hi
``knn_attention``        ``knn_attention_reference``     softmax or 1/count on the top-k q.k
``sparsemax_row``        ``sparsemax_row_reference``     decoding: sparsemax(beta q.k) V, one row
``interval_linear_at..`` ``interval_linear_at.._ref..``  sum_j f_i.g_j [v_j, 1], j in lo..hi
``entmax``               ``entmax_reference``            [(alpha - 1)(z - max z) - tau]_+^r
``score_retrieval``      ``score_retrieval_reference``   normalizer(beta q.k, j <= i + d) v
``interval_score_r..``   ``score_retrieval_reference``   the same over lo_i <= j <= hi_i
``power_retrieval``      ``power_attention_reference``   power_attention in PyTorch tiles
``top_k_retrieval``      ``knn_attention_reference``     knn_attention in PyTorch tiles
``dense_top_k_retr..``   ``knn_attention_reference``     the same, dense (short memories)
=======================  ==============================  ======================================

Each op chooses its form inside (device, dtype, sizes, gradients, ``MOSAICS_CPU_EXTENSION``,
``MOSAICS_FUSED`` for the Triton kernels: :mod:`.triton_backend`),
so the model code (:mod:`mosaics.memory`) never names a fused kernel. The score retrievals
(:mod:`.score_retrieval`, :mod:`.topk_retrieval`) are the PyTorch forms the kernels of
:mod:`mosaics.kernels` take where the Triton kernels do not serve a call; they receive the
kernel whose normalizer they apply as an argument (nothing here imports the kernels). The
tests check every op against its reference, value and gradient, in float64
(``tests/test_ops.py`` and one file per op: ``test_leaky_average.py``,
``test_unit_vectors.py``, ``test_linear_cross_entropy.py``, ``test_fused_*.py``,
``test_fska.py``, ``test_entmax.py``, ``test_score_retrieval.py``).
"""

from .banks import bank_attention, bank_attention_reference
from .causal import causal_attention, causal_attention_reference
from .entmax import entmax, entmax_reference
from .feature_attention import interval_linear_attention, interval_linear_attention_reference
from .fused_loss import linear_cross_entropy, linear_cross_entropy_reference
from .knn_attention import knn_attention, knn_attention_reference
from .leaky import decay_rate, leaky_average, leaky_average_reference
from .linear_attention import causal_linear_attention, causal_linear_attention_reference
from .power_attention import power_attention, power_attention_reference
from .score_retrieval import (
    interval_score_retrieval,
    power_retrieval,
    score_retrieval,
    score_retrieval_reference,
)
from .sparse_rows import sparsemax_row, sparsemax_row_reference
from .topk_retrieval import dense_top_k_retrieval, top_k_retrieval
from .unit import (
    lookahead_values,
    lookahead_values_reference,
    unit_vectors,
    unit_vectors_reference,
)

__all__ = [
    "bank_attention",
    "bank_attention_reference",
    "causal_attention",
    "causal_attention_reference",
    "causal_linear_attention",
    "causal_linear_attention_reference",
    "decay_rate",
    "dense_top_k_retrieval",
    "entmax",
    "entmax_reference",
    "interval_linear_attention",
    "interval_linear_attention_reference",
    "interval_score_retrieval",
    "knn_attention",
    "knn_attention_reference",
    "leaky_average",
    "leaky_average_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "lookahead_values",
    "lookahead_values_reference",
    "power_attention",
    "power_attention_reference",
    "power_retrieval",
    "sparsemax_row",
    "sparsemax_row_reference",
    "score_retrieval",
    "score_retrieval_reference",
    "top_k_retrieval",
    "unit_vectors",
    "unit_vectors_reference",
]
