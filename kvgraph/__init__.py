"""kvgraph: a torch.compile backend and graph runtime for LLM inference with paged KV caches."""

from kvgraph.attention import ops  # noqa: F401  (registers torch.ops.kvgraph.*)
from kvgraph.attention.layer import Attention, MLAAttention
from kvgraph.attention.metadata import (
    PADDING_SLOT,
    AttentionMetadata,
    RequestChunk,
    build_attention_metadata,
    build_model_inputs,
)
from kvgraph.compilation.backend import KVGraphBackend, kvgraph_backend
from kvgraph.kv_cache.binding import bind_kv_cache
from kvgraph.compilation.trace import CompiledModel, compile_model, mark_token_dims
from kvgraph.config import CompilationConfig, GraphMode, add_cli_args
from kvgraph.compilation.counters import CompileCounters, GraphCounters, compile_counters, graph_counters
from kvgraph.runtime.dispatcher import Dispatcher, GraphSupport
from kvgraph.errors import BatchError, ForwardContextError, KVCacheError
from kvgraph.forward_context import (
    BatchDescriptor,
    ForwardContext,
    get_forward_context,
    set_forward_context,
)
from kvgraph.runtime.runner import ModelRunner
from kvgraph.version import __version__
from kvgraph.kv_cache.spec import (
    AttentionSpec,
    KVCacheSpec,
    MLASpec,
    allocate_kv_caches,
    attention_layers,
    kv_cache_specs,
)


__all__ = [
    "__version__",
    "CompilationConfig",
    "CompileCounters",
    "Dispatcher",
    "GraphCounters",
    "GraphSupport",
    "ModelRunner",
    "graph_counters",
    "CompiledModel",
    "GraphMode",
    "KVGraphBackend",
    "add_cli_args",
    "compile_counters",
    "compile_model",
    "kvgraph_backend",
    "mark_token_dims",
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


def _register_backend_without_entry_point() -> None:
    """Register `backend="kvgraph"` when running from a source tree that was never installed.

    An installed kvgraph is found through its `torch_dynamo_backends` entry point; registering
    it a second time here would make Dynamo's lookup fail with "duplicate name".
    """
    from importlib.metadata import entry_points

    if not any(ep.name == "kvgraph" for ep in entry_points(group="torch_dynamo_backends")):
        from torch._dynamo import register_backend

        register_backend(kvgraph_backend, name="kvgraph")


_register_backend_without_entry_point()
