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
from .gaussian import GaussianKernel

__all__ = [
    "GaussianKernel",
    "Kernel",
    "KernelState",
    "available_kernels",
    "extend_mask",
    "get_kernel",
    "register_kernel",
    "strict_causal_mask",
]
