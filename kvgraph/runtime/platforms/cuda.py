"""The CUDA platform: `torch.cuda.CUDAGraph`, captured into one memory pool per runner."""

from __future__ import annotations

import importlib.util
import logging

import torch

from kvgraph.runtime.platforms.stream import StreamPlatform

logger = logging.getLogger(__name__)


def default_attention_backend() -> str:
    """`triton` (fused kernels, any batch in a full graph) where Triton is installed.

    torch's CUDA wheels bring Triton on Linux x86-64; elsewhere the portable `torch_native`
    serves, with a note saying why.
    """
    if importlib.util.find_spec("triton") is not None:
        return "triton"
    logger.warning("kvgraph: Triton is not installed, so CUDA attention uses the portable "
                   "torch_native backend (pip install triton for the fused kernels)")
    return "torch_native"


def cuda_platform() -> StreamPlatform:
    return StreamPlatform("cuda", torch.cuda, torch.cuda.CUDAGraph, distributed_backend="nccl",
                          attention_backend=default_attention_backend())
