"""Pluggable kernels of the contextual memory.

``get_kernel(name, **kwargs)`` builds a registered kernel; ``register_kernel(name)`` adds
your own (see the README). Importing this package registers the built-in kernels.
"""

from ..cache import FeatureSums, KernelMemory
from .base import (
    Kernel,
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
    "FeatureSums",
    "Kernel",
    "KernelMemory",
    "available_kernels",
    "extend_mask",
    "get_kernel",
    "register_kernel",
    "strict_causal_mask",
]
