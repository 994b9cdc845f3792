"""kvgraph: a torch.compile backend and graph runtime for LLM inference with paged KV caches."""

from kvgraph import ops  # noqa: F401  (registers torch.ops.kvgraph.*)
from kvgraph.attention.layer import Attention, MLAAttention
from kvgraph.attention.metadata import (
    PADDING_SLOT,
    AttentionMetadata,
    RequestChunk,
    build_attention_metadata,
    build_model_inputs,
)
from kvgraph.binding import bind_kv_cache
from kvgraph.errors import BatchError, ForwardContextError, KVCacheError
from kvgraph.forward_context import (
    BatchDescriptor,
    ForwardContext,
    get_forward_context,
    set_forward_context,
)
from kvgraph.kv_cache import (
    AttentionSpec,
    KVCacheSpec,
    MLASpec,
    allocate_kv_caches,
    attention_layers,
    kv_cache_specs,
)

__version__ = "0.1.0"

__all__ = [
    "PADDING_SLOT",
    "Attention",
    "AttentionMetadata",
    "AttentionSpec",
    "BatchDescriptor",
    "BatchError",
    "ForwardContext",
    "ForwardContextError",
    "KVCacheError",
    "KVCacheSpec",
    "MLAAttention",
    "MLASpec",
    "RequestChunk",
    "allocate_kv_caches",
    "attention_layers",
    "bind_kv_cache",
    "build_attention_metadata",
    "build_model_inputs",
    "get_forward_context",
    "kv_cache_specs",
    "set_forward_context",
]
