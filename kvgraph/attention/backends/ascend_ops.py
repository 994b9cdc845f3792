"""torch_npu, imported on first use, and the constants of its fused attention ops.

Shared by the `ascend` backend's modules (standard attention in ascend.py, MLA and
encoder-only in ascend_mla.py); nothing here imports torch_npu until it is called.
"""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
CAUSAL = 3  # FIA sparse_mode: causal, each request's queries aligned to its last keys
BAND = 4  # FIA sparse_mode: causal within `pre_tokens` keys back (a sliding window)
MASK_SIZE = 2048  # FIA's compressed mask for sparse modes 3 and 4
NO_LIMIT = 2147483647  # FIA's pre_tokens/next_tokens default: no band


def torch_npu():
    """torch_npu, imported only when an ascend kernel runs (see kvgraph/runtime/platforms/npu.py)."""
    import torch_npu as module

    return module
