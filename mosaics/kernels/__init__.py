"""Pluggable kernels of the contextual memory.

``get_kernel(name, **kwargs)`` builds a registered kernel; ``register_kernel(name)`` adds
your own (see the README). Importing this package registers the built-in kernels.
"""

from .base import (
    Kernel,
    KernelState,
    available_kernels,
    extend_mask,
    get_kernel,
    register_kernel,
    strict_causal_mask,
)
from .biweight import BiweightKernel
from .entmax_kernel import EntmaxKernel
from .epanechnikov import EpanechnikovKernel
from .epanechnikov_fixed import EpanechnikovFixedKernel
from .fska import FSKAKernel as FSKAKernel
from .gaussian import GaussianKernel
from .knn import GaussianKNNKernel, UniformKNNKernel
from .relumax import ReLUMaxKernel
from .triweight import TriweightKernel

__all__ = [
    "BiweightKernel",
    "EntmaxKernel",
    "EpanechnikovFixedKernel",
    "EpanechnikovKernel",
    "GaussianKNNKernel",
    "ReLUMaxKernel",
    "TriweightKernel",
    "UniformKNNKernel",
    "GaussianKernel",
    "Kernel",
    "KernelState",
    "available_kernels",
    "extend_mask",
    "get_kernel",
    "register_kernel",
    "strict_causal_mask",
]
