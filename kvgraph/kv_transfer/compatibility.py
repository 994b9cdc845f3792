"""What two processes' KV caches must share for blocks to move between them, and the check.

A block of one layer's key (or value, or MLA's `kv_c` / `k_pe`) is one contiguous byte range
in both caches only when both hold the same layers, each with the same tuple arity, row shapes
and dtypes, in blocks of the same size, for the same model and tensor-parallel shard. A pair
whose fingerprints differ in any of these is refused, naming the difference, before a byte
moves.
"""

from __future__ import annotations

from typing import Any

from kvgraph.errors import ConfigError
from kvgraph.kv_cache.spec import KVCache
from kvgraph.version import __version__


def cache_layout(kv_caches: dict[str, KVCache]) -> list:
    """Each layer's name and its tensors' row shapes and dtypes (the tuple's arity is its
    length), in name order."""
    return [[name, [[list(t.shape[2:]), str(t.dtype)] for t in cache]]
            for name, cache in sorted(kv_caches.items())]


def kv_fingerprint(kv_caches: dict[str, KVCache], block_size: int, model_key: str,
                   tp_rank: int = 0, tp_size: int = 1) -> dict[str, Any]:
    """What a peer's caches must match (JSON-able, for a handshake)."""
    return {"kvgraph": __version__, "model_key": model_key, "block_size": block_size,
            "tp_rank": tp_rank, "tp_size": tp_size, "layers": cache_layout(kv_caches)}


def check_compatible(local: dict[str, Any], remote: dict[str, Any], peer: str) -> None:
    """A ConfigError naming each field in which `peer`'s fingerprint differs from ours."""
    differences = []
    for field in sorted(set(local) | set(remote)):
        mine, theirs = local.get(field), remote.get(field)
        if mine == theirs:
            continue
        if field == "layers" and isinstance(theirs, list):
            differences.append(_layer_difference(mine, theirs, peer))
        else:
            differences.append(f"{field}: {mine!r} here, {theirs!r} on {peer}")
    if differences:
        raise ConfigError("kv_transfer_config", f"kvgraph refuses to move KV blocks with {peer}: "
                          + "; ".join(differences))


def _layer_difference(mine: list, theirs: list, peer: str) -> str:
    """The first layer whose tensors differ, or the layers only one side has."""
    here, there = dict(map(tuple, mine)), dict(map(tuple, theirs))
    missing = sorted(set(here) ^ set(there))
    if missing:
        return (f"layers: {len(here)} here, {len(there)} on {peer} (only one side has "
                f"{missing[:3]}{'...' if len(missing) > 3 else ''})")
    name = next(n for n in sorted(here) if here[n] != there[n])
    return f"layer {name}: [row shape, dtype] per tensor {here[name]} here, {there[name]} on {peer}"
