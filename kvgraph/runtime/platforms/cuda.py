"""The CUDA platform: `torch.cuda.CUDAGraph`, captured into one memory pool per runner."""

from __future__ import annotations

import torch

from kvgraph.runtime.platforms.base import StreamPlatform


def cuda_platform() -> StreamPlatform:
    return StreamPlatform("cuda", torch.cuda, torch.cuda.CUDAGraph)
