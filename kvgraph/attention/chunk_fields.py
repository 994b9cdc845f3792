"""Reading a batch's request chunks into flat int64 arrays, refusing any field that is not what a
`RequestChunk` holds.

A chunk's `token_ids` and `block_ids` are flat sequences of ints (a list, tuple or range, or a
1-D integer array or tensor) and its `num_computed_tokens` one int in [0, MAX_SEQ_LEN]. Bools,
floats, None, nested lists and ints beyond int64 are refused with a BatchError naming the chunk,
the field and what it must be. The common case (lists of Python ints) is checked by the dtype
NumPy infers, not by a Python loop per token; only a batch that fails is looked at chunk by
chunk, to say where.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from kvgraph.attention.metadata import MAX_SEQ_LEN, RequestChunk
from kvgraph.errors import BatchError

_SEQUENCES = (list, tuple, range)
_REPR_LIMIT = 80
# Up to this many elements, checking each one's type costs less than NumPy's calls.
_SHORT = 128


@dataclass(frozen=True)
class ChunkFields:
    """A batch's chunks as flat arrays: every token, every block id, per-chunk counts."""

    token_ids: np.ndarray  # [T] int64
    query_lens: np.ndarray  # [R] int64
    num_computed_tokens: np.ndarray  # [R] int64, each in [0, MAX_SEQ_LEN]
    block_ids: np.ndarray  # every chunk's block ids, chunk after chunk, int64
    block_counts: np.ndarray  # [R] int64
    num_logits: np.ndarray  # [R] int64, each in [1, the chunk's query length]


def read_chunks(chunks: Sequence[RequestChunk]) -> ChunkFields:
    """The fields of `chunks` as int64 arrays, or a BatchError naming the first bad field."""
    if not isinstance(chunks, (list, tuple)):
        raise BatchError(f"chunks must be a list of RequestChunk, got {_shown(chunks)}")
    if len(chunks) == 0:
        raise BatchError("a batch needs at least one RequestChunk, got none")
    bad = next((i for i, c in enumerate(chunks) if not isinstance(c, RequestChunk)), None)
    if bad is not None:
        raise BatchError(f"chunk {bad}: expected a RequestChunk(token_ids, num_computed_tokens, "
                         f"block_ids), got {_shown(chunks[bad])}")
    tokens = _sequences([c.token_ids for c in chunks], "token_ids")
    blocks = _sequences([c.block_ids for c in chunks], "block_ids")
    computed = _flat_ints([[c.num_computed_tokens] for c in chunks], "num_computed_tokens")
    if computed.min() < 0 or computed.max() > MAX_SEQ_LEN:
        i = int(np.argmax((computed < 0) | (computed > MAX_SEQ_LEN)))
        raise BatchError(f"chunk {i}: num_computed_tokens must lie in [0, {MAX_SEQ_LEN}], got "
                         f"{computed[i]}")
    query_lens = np.fromiter(map(len, tokens), np.int64, len(tokens))
    num_logits = _flat_ints([[c.num_logits] for c in chunks], "num_logits")
    bad_logits = (num_logits < 1) | (num_logits > np.maximum(query_lens, 1))
    if bad_logits.any():
        i = int(np.argmax(bad_logits))
        raise BatchError(f"chunk {i}: num_logits must lie in [1, len(token_ids)={query_lens[i]}] "
                         f"(logits of the chunk's last tokens), got {num_logits[i]}")
    return ChunkFields(
        token_ids=_flat_ints(tokens, "token_ids"),
        query_lens=query_lens,
        num_computed_tokens=computed,
        block_ids=_flat_ints(blocks, "block_ids"),
        block_counts=np.fromiter(map(len, blocks), np.int64, len(blocks)),
        num_logits=num_logits,
    )


def _sequences(values: list[Any], field: str) -> list[Sequence[int]]:
    """`values` (one per chunk) as flat sequences, arrays and tensors turned into lists."""
    if all(type(v) in _SEQUENCES for v in values):
        return values
    return [_sequence(i, v, field) for i, v in enumerate(values)]


def _sequence(i: int, value: Any, field: str) -> Sequence[int]:
    if isinstance(value, _SEQUENCES):
        return value
    if isinstance(value, (np.ndarray, torch.Tensor)):
        integer = (value.dtype.kind in "iu" if isinstance(value, np.ndarray)
                   else not value.dtype.is_floating_point and not value.dtype.is_complex
                   and value.dtype != torch.bool)
        if value.ndim == 1 and integer:
            return value.tolist()
        raise BatchError(f"chunk {i}: {field} must be a 1-D integer array, got one of shape "
                         f"{tuple(value.shape)} and dtype {value.dtype}")
    raise BatchError(f"chunk {i}: {field} must be a list of ints, got {_shown(value)}")


def _flat_ints(lists: list[Sequence[int]], field: str) -> np.ndarray:
    """The concatenation of `lists` as int64, or a BatchError naming the first bad chunk."""
    flat = list(itertools.chain.from_iterable(lists))
    array = _int64_array(flat)
    if array is not None:
        return array
    for i, values in enumerate(lists):
        if not _all_ints(values) or any(not -2**63 <= v < 2**63 for v in values):
            one = field in ("num_computed_tokens", "num_logits")  # one int per chunk
            shown = values[0] if one else values
            what = "an int" if one else "a list of ints"
            raise BatchError(f"chunk {i}: {field} must be {what} (not bools, floats, None or "
                             f"nested lists; within int64), got {_shown(shown)}")
    # Every value is an int within int64, but NumPy inferred no int64 for them together (it
    # mixes uint64 with signed ints as float64): convert them one by one.
    return np.fromiter(flat, np.int64, len(flat))


def _int64_array(flat: list[Any]) -> np.ndarray | None:
    """`flat` as int64 if it holds ints (not bools) within int64 only, else None.

    Floats, None, nested lists and ints past int64 show in the dtype NumPy infers; bools mixed
    with ints do not (they become 0 and 1). A short list's element types are checked directly;
    in a long one, only the elements at most 1 are looked at.
    """
    if len(flat) <= _SHORT and not _all_ints(flat):
        return None
    try:
        array = np.asarray(flat)
    except ValueError:  # ragged nesting
        return None
    if array.ndim != 1 or array.dtype.kind not in "iu" or array.dtype == np.uint64:
        return None if len(flat) else np.zeros(0, np.int64)
    if len(flat) > _SHORT and array.min() <= 1 and any(
            type(flat[i]) is bool for i in np.flatnonzero(array <= 1)):
        return None
    return array.astype(np.int64, copy=False)


def _all_ints(values: Sequence[Any]) -> bool:
    """Whether every value is an int (a Python or NumPy integer; bools are not)."""
    return all(t is int or (t is not bool and issubclass(t, (int, np.integer)))
               for t in set(map(type, values)))


def _shown(value: Any) -> str:
    text = repr(value)
    if len(text) > _REPR_LIMIT:
        text = text[:_REPR_LIMIT] + "..."
    if value is None or isinstance(value, _SEQUENCES):
        return text
    return f"{type(value).__name__} {text}"
