"""FX graph passes for kvgraph: pure FX -> FX functions that know op names and nothing else."""

from typing import Any

from passes.attention_inplace import inplace_attention
from passes.collectives import CollectiveWaitError
from passes.noop_elimination import noop_elimination
from passes.op_match import is_op_call, op_name
from passes.pass_manager import GraphPass, PassManager
from passes.split import Piece, SplitGraph, split_at_attention

# Passes a config can enable by name, in the order they run.
REGISTERED_PASSES = {"noop_elimination": GraphPass("noop_elimination", noop_elimination)}



def __getattr__(name: str) -> Any:
    # InplaceAttentionPass subclasses inductor's CustomGraphPass, whose import imports Dynamo:
    # loaded when first asked for (a compile), not with the package.
    if name == "InplaceAttentionPass":
        from passes.inductor_pass import InplaceAttentionPass

        return InplaceAttentionPass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REGISTERED_PASSES",
    "CollectiveWaitError",
    "GraphPass",
    "InplaceAttentionPass",
    "PassManager",
    "Piece",
    "SplitGraph",
    "inplace_attention",
    "is_op_call",
    "noop_elimination",
    "op_name",
    "split_at_attention",
]
