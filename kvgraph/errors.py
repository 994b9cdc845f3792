"""Exceptions kvgraph raises for input a caller can fix."""


class KVCacheError(ValueError):
    """A KV cache, spec or binding does not match the attention layer it is meant for."""


class ForwardContextError(RuntimeError):
    """Attention ran without the per-step forward context it reads its metadata from."""


class BatchError(ValueError):
    """A batch of request chunks cannot be turned into attention metadata."""
