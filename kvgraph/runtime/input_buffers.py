"""The runner's persistent step inputs, and writing one step's plan into them.

Graphs record addresses, so a step never allocates its inputs: `InputBuffers.fill` writes the
plan's values into the first rows of buffers sized for `max_num_tokens` / `max_num_seqs`, pads
the rest of the descriptor's rows, and hands out views of them (one host-to-device copy a
step). Padding rules: padded tokens get id 0, position 0 and slot -1 (nothing is written to the
cache). Padded requests (full graphs) each own the descriptor's `query_len` padded tokens
(one, or a verify step's 1 + K) while there are any, and have sequence length 0, so attention
sees no key and returns zeros: never NaN.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvgraph.attention.metadata import PADDING_SLOT, AttentionMetadata, cdiv
from kvgraph.runtime.step import StepLimits, StepPlan

WORKSPACE_BYTES = 32 * 2**20

# The persistent inputs, in the order they sit in the packed buffer: name, dtype, rows per
# token (T), per request (R), per request + 1, or per request x blocks (the block table, last so
# that a step copies only the rows it uses).
_FIELDS = (
    ("input_ids", torch.int64, "T"),
    ("positions", torch.int64, "T"),
    ("slot_mapping", torch.int64, "T"),
    ("logits_indices", torch.int64, "T"),  # up to every token (a verify step's num_logits)
    ("seq_lens", torch.int32, "R"),
    ("query_start_loc", torch.int32, "R+1"),
    ("block_table", torch.int32, "RxB"),
)


def _layout(limits: StepLimits) -> tuple[dict, dict, int]:
    """Each field's rows and byte offset in the packed buffer, and the buffer's size."""
    blocks = cdiv(limits.max_model_len, limits.block_size)
    rows = {"T": (limits.max_num_tokens,), "R": (limits.max_num_seqs,),
            "R+1": (limits.max_num_seqs + 1,), "RxB": (limits.max_num_seqs, blocks)}
    offsets, total = {}, 0
    for name, dtype, kind in _FIELDS:
        offsets[name] = total
        total += -(-(math.prod(rows[kind]) * dtype.itemsize) // 8) * 8  # 8-byte aligned
    return rows, offsets, total


def buffer_bytes(limits: StepLimits, device: torch.device) -> int:
    """What the persistent inputs of `limits` take on `device` (its workspace included)."""
    return _layout(limits)[2] + (WORKSPACE_BYTES if device.type != "cpu" else 0)


class InputBuffers:
    """Persistent step inputs on one device, written each step by one host-to-device copy.

    All of them are views of one byte buffer on the device; a step writes the values into the
    same layout in (pinned) host memory and copies the bytes it uses in one transfer, with no
    allocation and no sync. On the CPU the host buffer is the device buffer. Before the next
    step overwrites the host buffer it waits for the previous copy, which a non-blocking copy
    from pinned memory may still be reading.
    """

    def __init__(self, limits: StepLimits, device: torch.device):
        self.block_size = limits.block_size
        blocks = cdiv(limits.max_model_len, limits.block_size)
        rows, offsets, total = _layout(limits)
        on_device = device.type != "cpu"
        self.device_bytes = torch.zeros(total, dtype=torch.uint8, device=device)
        self.host_bytes = (torch.zeros(total, dtype=torch.uint8, pin_memory=True) if on_device
                           else self.device_bytes)
        self._copied = torch.Event(device=device) if on_device else None

        def view(buffer: torch.Tensor, name: str, dtype: torch.dtype, kind: str) -> torch.Tensor:
            size = math.prod(rows[kind]) * dtype.itemsize
            return buffer[offsets[name]:offsets[name] + size].view(dtype).view(rows[kind])

        self.host = {name: view(self.host_bytes, name, dtype, kind).numpy()
                     for name, dtype, kind in _FIELDS}
        for name, dtype, kind in _FIELDS:  # the device tensors graphs read: self.input_ids, ...
            setattr(self, name, view(self.device_bytes, name, dtype, kind))
        # Attention's scratch on a device (the CPU's kernels need none): 32 MiB hold split-KV's
        # partial results for any batch of heads up to 128 wide; a backend needing more
        # allocates, so this bounds speed, never correctness.
        self.workspace = (torch.empty(WORKSPACE_BYTES // 4, dtype=torch.float32, device=device)
                          if on_device else None)
        self._block_table_offset = offsets["block_table"]
        self._block_row_bytes = blocks * torch.int32.itemsize

    def fill(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Write one step into the buffers; the model inputs and metadata as views of them."""
        batch = plan.batch
        n, r, t, padded_r = batch.num_tokens, batch.num_reqs, plan.padded_tokens, plan.padded_reqs
        if self._copied is not None:
            self._copied.synchronize()
        self._write_host(plan)
        if self._copied is not None:
            used = self._block_table_offset + padded_r * self._block_row_bytes
            self.device_bytes[:used].copy_(self.host_bytes[:used], non_blocking=True)
            self._copied.record()
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:t],
            block_table=self.block_table[:padded_r],
            seq_lens=self.seq_lens[:padded_r],
            query_start_loc=self.query_start_loc[:padded_r + 1],
            block_size=self.block_size,
            num_actual_tokens=n,
            num_reqs=r,
            num_decode_tokens=batch.num_decode_tokens,
            num_prefill_tokens=n - batch.num_decode_tokens,
            max_query_len=plan.max_query_len,
            max_seq_len=plan.max_seq_len,
            workspace=self.workspace,
            host_seq_lens=self.host["seq_lens"][:padded_r],
            host_query_start_loc=self.host["query_start_loc"][:padded_r + 1],
        )
        return self.input_ids[:t], self.positions[:t], metadata

    def _write_host(self, plan: StepPlan) -> None:
        batch, host = plan.batch, self.host
        n, r, t, padded_r = batch.num_tokens, batch.num_reqs, plan.padded_tokens, plan.padded_reqs
        for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", PADDING_SLOT)):
            host[name][:n] = getattr(batch, name)
            host[name][n:t] = pad
        if not plan.writes_cache:
            host["slot_mapping"][:t] = PADDING_SLOT
        host["seq_lens"][:r] = batch.seq_lens
        host["seq_lens"][r:padded_r] = 0
        # Padded requests own query_len padded tokens each (a uniform descriptor's shape), in
        # order, while padded tokens last.
        q = plan.descriptor.query_len
        query_start_loc = host["query_start_loc"]
        query_start_loc[:r + 1] = batch.query_start_loc
        query_start_loc[r + 1:padded_r + 1] = np.minimum(
            n + q * np.arange(1, 1 + padded_r - r), t)
        host["logits_indices"][:len(batch.logits_indices)] = batch.logits_indices
        block_table = host["block_table"]
        block_table[:padded_r] = 0
        block_table[:r, : batch.block_table.shape[1]] = batch.block_table
