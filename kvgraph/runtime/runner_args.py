"""A ModelRunner's arguments, checked and completed when it is built: types, ranges, the memory
they need, and the defaults taken from the config or the model.

Every size is refused here, with a ConfigError naming it, rather than later by the allocator, a
capture or an int32 index that wraps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvgraph.attention.metadata import MAX_BLOCK_ID, MAX_SEQ_LEN
from kvgraph.config import DEFAULT_MAX_NUM_TOKENS, CompilationConfig
from kvgraph.config_checks import MAX_NUM_TOKENS, bounded_int
from kvgraph.devices import memory_bytes
from kvgraph.errors import ConfigError, PlatformError

# Per size: the largest value int32 block tables, sequence lengths and offsets can hold.
_UPPER = {"num_blocks": MAX_BLOCK_ID, "block_size": MAX_SEQ_LEN, "max_num_seqs": MAX_NUM_TOKENS,
          "max_model_len": MAX_SEQ_LEN, "vocab_size": MAX_BLOCK_ID}


def check_sizes(**sizes: Any) -> None:
    """Refuse a size that is not an int in [1, its bound]; None is allowed for optional ones."""
    for name, value in sizes.items():
        if value is None and name in ("max_model_len", "vocab_size"):
            continue
        bounded_int(name, value, _UPPER[name],
                    "block tables, sequence lengths and offsets are int32")


def check_fits(device: torch.device, kv_cache_bytes: int, buffer_bytes: int) -> None:
    """Refuse caches and step buffers larger than all of `device`'s memory."""
    capacity = memory_bytes(device)
    if capacity is None or kv_cache_bytes + buffer_bytes <= capacity:
        return
    field = "num_blocks" if kv_cache_bytes >= buffer_bytes else "max_num_seqs"
    raise ConfigError(field, f"the KV caches ({_gib(kv_cache_bytes)}: num_blocks x bytes per "
                      f"block) and step buffers ({_gib(buffer_bytes)}: max_num_tokens, "
                      f"max_num_seqs x max_model_len) need more than all of {device}'s memory "
                      f"({_gib(capacity)}); lower {field}")


def _gib(size: int) -> str:
    return f"{size / 2**30:.3g} GiB"


def check_device(device: torch.device | str) -> None:
    """Refuse an accelerator this process cannot use, naming what it has."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    available = module is not None and module.is_available()
    count = module.device_count() if available else 0
    if not available or (device.index is not None and device.index >= count):
        raise PlatformError(f"device {device}: this process sees {count} {device.type} "
                            f"device(s) (torch {torch.__version__}); use one of them or 'cpu'")


def check_dtype(dtype: Any) -> None:
    """Refuse a KV cache dtype that is not a floating torch.dtype."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError("dtype", f"dtype: expected a floating torch.dtype such as "
                          f"torch.bfloat16 (or None: the model's), got {dtype!r}")


def with_max_num_tokens(config: CompilationConfig, max_num_tokens: int | None
                         ) -> CompilationConfig:
    """`config` with the runner's token budget: the argument, else the config's, else the
    default; given both ways, they must agree."""
    if max_num_tokens is not None and config.max_num_tokens not in (None, max_num_tokens):
        raise ConfigError("max_num_tokens", f"max_num_tokens: the runner was given "
                          f"{max_num_tokens!r} but its config says {config.max_num_tokens!r}; "
                          "set it in one place (or make them equal)")
    chosen = max_num_tokens if max_num_tokens is not None else config.max_num_tokens
    return config.replace(max_num_tokens=DEFAULT_MAX_NUM_TOKENS if chosen is None else chosen)


def model_vocab_size(model: nn.Module) -> int | None:
    """The model's vocabulary size: `config.vocab_size`, else its first embedding's rows."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None


def rank_settings(runner: Any) -> tuple:
    """What must be equal on every tensor-parallel rank for their steps to match."""
    config = runner.config
    return (config.graph_mode.value, vars(runner.limits), runner.attn_backend,
            config.capture_size_list, config.compile_sizes, config.piece_compiler,
            config.splitting_ops, str(next(iter(runner.kv_caches.values()))[0].dtype)
            if runner.kv_caches else None)
