"""What one step's attention reads: the request chunks a batch is made of, and its metadata.

Building metadata from chunks (validated, vectorised) lives in `kvgraph.attention.batch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

# Slot id of a token whose key/value must not be written (padding).
PADDING_SLOT = -1
# Block tables are int32 (what device kernels take).
MAX_BLOCK_ID = 2**31 - 1
# Sequence lengths are int32 too.
MAX_SEQ_LEN = 2**31 - 1


def cdiv(a: int, b: int) -> int:
    """`a / b` rounded up: how many blocks of `b` slots hold `a` tokens."""
    return -(-a // b)


@dataclass(frozen=True)
class RequestChunk:
    """The new tokens one request adds in this step.

    `num_computed_tokens` tokens of the request are already in the cache; the chunk's tokens
    take positions `num_computed_tokens ..  num_computed_tokens + len(token_ids) - 1`.
    `block_ids` is the request's block table: block `i` holds positions
    `i * block_size .. (i + 1) * block_size - 1`.
    `num_logits`: how many of the chunk's last tokens need logits, 1 to `len(token_ids)` (a
    speculative verify step asks for all its 1 + K tokens: the target's choice after each).
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_ids: Sequence[int]
    num_logits: int = 1

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.num_computed_tokens + len(self.token_ids)


@dataclass
class AttentionMetadata:
    """Paged-attention metadata for one step, all tensors on the model's device.

    Tokens are laid out request after request; `query_start_loc[r]:query_start_loc[r+1]` are
    request r's new tokens. Tensors may be longer than the real batch (padding): extra tokens
    carry slot `PADDING_SLOT`, and attention writes zeros for them.

    `max_query_len` and `max_seq_len` are host ints that fix the shapes attention computes with;
    a device graph freezes them, so a runner captures it with the largest values it will replay.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, PADDING_SLOT for padding
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, unused entries 0
    seq_lens: torch.Tensor  # [num_reqs] int32: cached + new tokens
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    block_size: int
    num_actual_tokens: int
    num_reqs: int
    num_decode_tokens: int  # tokens of requests that add exactly one token
    num_prefill_tokens: int
    max_query_len: int
    max_seq_len: int
    # fp32 device scratch a backend may use instead of allocating (split-KV's partial results);
    # the runner's never moves, so graphs may hold it. None: allocate.
    workspace: torch.Tensor | None = None
    # The attention backend's plan of this step (`AttentionBackend.plan`): made once, read by
    # every layer's op call.
    plan: Any = None
    # Host copies of `seq_lens` and `query_start_loc` (same rows), for kernels that take host
    # lengths (Ascend's fused attention): reading the device tensors would sync, and cannot be
    # captured. None: not kept (a backend that needs them copies the device tensors).
    host_seq_lens: np.ndarray | None = None
    host_query_start_loc: np.ndarray | None = None

    @property
    def uniform_decode(self) -> bool:
        return self.num_prefill_tokens == 0
