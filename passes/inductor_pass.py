"""`inplace_attention` as an inductor post-grad pass.

A module of its own, imported only when a piece is compiled: inductor's `CustomGraphPass`
imports Dynamo (about a second), which `import kvgraph` and the scripts' flag checks do not
need.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Collection

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import passes.attention_inplace as attention_inplace


class InplaceAttentionPass(CustomGraphPass):
    """`inplace_attention` as an inductor post-grad pass (cache-safe: it has a stable uuid)."""

    def __init__(self, op_names: Collection[str]):
        self.op_names = tuple(sorted(op_names))
        self.rewritten = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.rewritten += attention_inplace.inplace_attention(graph, self.op_names)

    def uuid(self) -> str:
        # The rewrite's source and this wrapper's: an edit to either is a new compile-cache key.
        source = inspect.getsource(attention_inplace) + inspect.getsource(InplaceAttentionPass)
        return hashlib.sha256(f"{self.op_names}\n{source}".encode()).hexdigest()
