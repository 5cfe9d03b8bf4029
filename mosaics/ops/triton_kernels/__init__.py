"""Triton kernel sources (``@triton.jit`` functions at module level).

Never import these modules directly: :func:`mosaics.ops.triton_backend.triton_module` loads
each one compiled (CUDA) or under Triton's interpreter (CPU tensors), once per mode.
"""
