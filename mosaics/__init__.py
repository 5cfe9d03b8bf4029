"""mosaics: Memory Mosaics language models with pluggable attention kernels."""

import os
import sys

if os.environ.get("MOSAICS_FUSED") == "1" and "triton" not in sys.modules:
    import torch

    if not torch.cuda.is_available():  # fused kernels on CPU: Triton's interpreter, chosen
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import MosaicsCache
from .configuration_mosaics import MosaicsConfig
from .kernels import available_kernels, get_kernel, register_kernel
from .modeling_mosaics import MosaicsForCausalLM, MosaicsModel, MosaicsPreTrainedModel

AutoConfig.register("mosaics", MosaicsConfig, exist_ok=True)
AutoModel.register(MosaicsConfig, MosaicsModel, exist_ok=True)
AutoModelForCausalLM.register(MosaicsConfig, MosaicsForCausalLM, exist_ok=True)

__version__ = "0.1.0"
__all__ = [
    "MosaicsCache",
    "MosaicsConfig",
    "MosaicsForCausalLM",
    "MosaicsModel",
    "MosaicsPreTrainedModel",
    "available_kernels",
    "get_kernel",
    "register_kernel",
]
