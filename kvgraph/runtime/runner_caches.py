"""The KV caches a runner gives its model: checked to fit the device beside the input buffers,
allocated, and bound to the model's attention layers once the runner holds them."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from kvgraph.attention.layer_base import attention_layers, kv_cache_specs
from kvgraph.kv_cache.binding import bind_kv_cache
from kvgraph.kv_cache.spec import KVCache, allocate_kv_caches
from kvgraph.runtime import model_claim
from kvgraph.runtime.input_buffers import buffer_bytes
from kvgraph.runtime.runner_args import check_fits
from kvgraph.runtime.step import StepLimits


def bind_new_caches(model: nn.Module, limits: StepLimits, device: torch.device,
                    dtype: torch.dtype, runner: Any) -> tuple[dict[str, KVCache], weakref.ref]:
    """New caches of `limits.num_blocks` blocks for every attention layer of `model`, bound to
    it for `runner`; with the claim that `model_claim.release` lets go of."""
    layers = attention_layers(model)
    specs = kv_cache_specs(model, limits.block_size, dtype)
    check_fits(device, sum(s.bytes_per_block for s in specs.values()) * limits.num_blocks,
               buffer_bytes(limits, device))
    caches = allocate_kv_caches(specs, limits.num_blocks, device)
    claim = model_claim.claim(layers, runner)  # before binding: never clobber another's
    try:
        bind_kv_cache(layers, caches, device=device, dtype=dtype)
    except BaseException:
        model_claim.release(layers.values(), claim)
        raise
    return caches, claim
