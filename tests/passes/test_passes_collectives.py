"""Collective/wait pairs through the passes and the split: never dropped, never cut apart."""

import pytest
import torch
from torch import fx

import kvgraph  # noqa: F401  (registers the attention ops)
import passes
from passes.collectives import WAIT_TENSOR
from passes.op_match import is_op_call

ALL_REDUCE = "_c10d_functional::all_reduce"
ATTENTION = ("kvgraph::unified_attention",)


def reduce_attend_wait() -> fx.GraphModule:
    """x @ w, all-reduced; an attention call lies between the all-reduce and its wait (as a
    reordering could leave it); the wait's result is used after attention."""
    graph = fx.Graph()
    x, w, out = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("out")
    mm = graph.call_function(torch.ops.aten.mm.default, (x, w))
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (mm, "sum", "0"))
    graph.call_function(torch.ops.kvgraph.unified_attention.default,
                        (mm, mm, mm, [], out, 1.0, 0, "decoder"))
    waited = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
    total = graph.call_function(torch.ops.aten.add.Tensor, (waited, out))
    graph.output((total,))
    return fx.GraphModule(torch.nn.Module(), graph)


def piece_of(split: passes.SplitGraph, op: str) -> passes.Piece:
    (piece,) = [p for p in split.pieces
                if any(is_op_call(n, (op,)) for n in p.graph_module.graph.nodes)]
    return piece


def test_split_keeps_the_wait_with_its_collective():
    split = passes.split_at_attention(reduce_attend_wait(), ATTENTION)
    reduce_piece = piece_of(split, ALL_REDUCE)
    assert piece_of(split, WAIT_TENSOR) is reduce_piece
    assert not reduce_piece.is_splitting_op
    assert piece_of(split, ATTENTION[0]).is_splitting_op


def test_a_collective_as_splitting_op_takes_its_wait_along():
    split = passes.split_at_attention(reduce_attend_wait(), ATTENTION + (ALL_REDUCE,))
    reduce_piece = piece_of(split, ALL_REDUCE)
    assert reduce_piece.is_splitting_op
    assert piece_of(split, WAIT_TENSOR) is reduce_piece
    ops = [n for n in reduce_piece.graph_module.graph.nodes if n.op == "call_function"]
    assert len(ops) == 2  # the collective and its wait, nothing else


def drop_waits(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if is_op_call(node, (WAIT_TENSOR,)):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def test_a_pass_that_drops_a_wait_is_refused_naming_it():
    manager = passes.PassManager([passes.GraphPass("drop_waits", drop_waits)])
    with pytest.raises(passes.CollectiveWaitError, match="pass 'drop_waits'.*1 wait_tensor"):
        manager(reduce_attend_wait())


def test_registered_passes_keep_every_wait():
    gm = reduce_attend_wait()
    passes.PassManager(list(passes.REGISTERED_PASSES.values()))(gm)
    assert len([n for n in gm.graph.nodes if is_op_call(n, (WAIT_TENSOR,))]) == 1


def test_a_collective_is_a_valid_splitting_op_name():
    config = kvgraph.CompilationConfig(splitting_ops=ATTENTION + (ALL_REDUCE,))
    assert ALL_REDUCE in config.splitting_ops
