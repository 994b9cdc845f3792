"""kvgraph: a torch.compile backend and graph runtime for LLM inference with paged KV caches."""

from kvgraph.attention import ops  # noqa: F401  (registers torch.ops.kvgraph.*)
from kvgraph.attention.layer import Attention, MLAAttention
from kvgraph.attention.batch import build_attention_metadata, build_model_inputs
from kvgraph.attention.metadata import AttentionMetadata, RequestChunk
from kvgraph.compilation.backend import kvgraph_backend
from kvgraph.compilation.trace import compile_model, mark_token_dims
from kvgraph.config import CompilationConfig, GraphMode
from kvgraph.config_flags import add_cli_args
from kvgraph.errors import (
    BatchError,
    CompileError,
    ConfigError,
    ForwardContextError,
    GraphError,
    KVCacheError,
    PlatformError,
    RunnerError,
    VerifyError,
)
from kvgraph.forward_context import BatchDescriptor, set_forward_context
from kvgraph.kv_cache.binding import bind_kv_cache
from kvgraph.attention.layer_base import attention_layers, kv_cache_specs
from kvgraph.kv_cache.spec import AttentionSpec, MLASpec, allocate_kv_caches
from kvgraph.runtime.runner import ModelRunner
from kvgraph.version import __version__

# What model, server and backend authors use; everything else is importable from its module
# (counters from kvgraph.compilation.counters, attention backends from kvgraph.attention.backends,
# the CPU kernels and the weight layouts, huge pages and malloc policy around them from
# kvgraph.cpu).
__all__ = [
    "__version__",
    # models: attention layers and their caches
    "Attention",
    "MLAAttention",
    "AttentionSpec",
    "MLASpec",
    "kv_cache_specs",
    "allocate_kv_caches",
    "attention_layers",
    "bind_kv_cache",
    # one step's batch, metadata and context
    "RequestChunk",
    "AttentionMetadata",
    "build_attention_metadata",
    "build_model_inputs",
    "BatchDescriptor",
    "set_forward_context",
    # compile, capture, run
    "GraphMode",
    "CompilationConfig",
    "add_cli_args",
    "compile_model",
    "mark_token_dims",
    "ModelRunner",
    # errors
    "BatchError",
    "CompileError",
    "ConfigError",
    "ForwardContextError",
    "GraphError",
    "KVCacheError",
    "PlatformError",
    "RunnerError",
    "VerifyError",
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
