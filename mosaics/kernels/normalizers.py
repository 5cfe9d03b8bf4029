"""Sparse normalizers of score rows: sparsemax, 1.5-entmax and alpha-entmax.

The maths lives in :mod:`mosaics.ops.entmax` (the threshold solver, the custom backward and
the plain reference); this module keeps its names importable from here.
"""

from ..ops.entmax import (
    BLOCK,
    LOWER_BOUND_STEPS,
    _bisect_tau,
    _EntmaxFunction,
    block_max,
    candidate_blocks,
    check_alpha,
    entmax,
    entmax15,
    entmax_backward,
    entmax_exponent,
    entmax_forward,
    entmax_power,
    entmax_reference,
    entmax_tau,
    newton_tau,
    pad_to_block,
    power_sums,
    row_max,
    shifted_scores,
    sparsemax,
    work_dtype,
)

__all__ = [
    "BLOCK",
    "LOWER_BOUND_STEPS",
    "_EntmaxFunction",
    "_bisect_tau",
    "block_max",
    "candidate_blocks",
    "check_alpha",
    "entmax",
    "entmax15",
    "entmax_backward",
    "entmax_exponent",
    "entmax_forward",
    "entmax_power",
    "entmax_reference",
    "entmax_tau",
    "newton_tau",
    "pad_to_block",
    "power_sums",
    "row_max",
    "shifted_scores",
    "sparsemax",
    "work_dtype",
]
