"""`passes.split.split_module_tuple_return`: split_module's `tuple_return=True` on every torch.

torch < 2.13 has no `tuple_return` keyword, so the pass splits without it and rewrites the result.
Where the keyword exists, the pieces must be the ones the keyword builds; everywhere, the split
must compute what the original graph does, with every piece returning a tuple.
"""

from __future__ import annotations

import inspect
import operator

import pytest
import torch
from torch import fx
from torch.fx.passes.split_module import split_module

import passes
from passes.split import split_module_tuple_return
from tests.support.scenario import dynamo_capture

OP = "kvgraph_compat_test::scale_into"
HAS_TUPLE_RETURN = "tuple_return" in inspect.signature(split_module).parameters
needs_tuple_return = pytest.mark.skipif(
    not HAS_TUPLE_RETURN, reason=f"torch {torch.__version__} split_module has no tuple_return")


@torch.library.custom_op(OP, mutates_args=("out",))
def scale_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """Returns nothing: the piece that holds a call of it has no outputs."""
    out.copy_(x * 0.5)


@scale_into.register_fake
def _(x, out):
    return None


def chain(x, y, buf):
    a = x * 2 + y                                  # piece 0: one output, three users
    torch.ops.kvgraph_compat_test.scale_into(a, buf)   # piece 1: no outputs
    b = buf.sin() + 1                              # piece 2: two outputs (b, c)
    c = a.cos()
    torch.ops.kvgraph_compat_test.scale_into(b, buf)   # piece 3: no outputs
    return c * buf, a                              # piece 4: one output, straight to the result


def no_split(x, y, buf):
    return (x + y).relu() * buf


def many_outputs(x, y, buf):
    p, q, r = x + 1, y - 1, x * y                  # piece 0: three outputs
    torch.ops.kvgraph_compat_test.scale_into(r, buf)   # piece 1: no outputs
    return p, q, buf + 1                           # piece 2: one output


# (function, number of outputs of each piece in order)
CASES = {
    "chain": (chain, [1, 0, 2, 0, 1]),
    "no_split": (no_split, [1]),
    "many_outputs": (many_outputs, [3, 0, 1]),
}


def partitions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """A partition per op call, and one for the code between calls (as split_at_attention does)."""
    partition_of, partition = {}, 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if passes.is_op_call(node, [OP]):
            partition_of[node] = partition + 1
            partition += 2
        else:
            partition_of[node] = partition
    return partition_of


def callback_for(gm):
    partition_of = partitions(gm)
    return lambda node: partition_of[node]


def symbolic(fn) -> fx.GraphModule:
    return fx.symbolic_trace(fn)


def dynamo(fn) -> fx.GraphModule:
    torch._dynamo.reset()
    graph = dynamo_capture(fn, *make_inputs(0)).gm
    torch._dynamo.reset()
    return graph


TRACERS = {"symbolic_trace": symbolic, "dynamo": dynamo}


def make_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(4, 3, generator=generator) for _ in range(3))


def as_tuple(result):
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def piece_calls(split: fx.GraphModule) -> list[fx.Node]:
    return [n for n in split.graph.nodes if n.op == "call_module"]


def output_arg(gm: fx.GraphModule):
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    return output.args[0]


@pytest.fixture(params=list(CASES))
def case(request):
    return CASES[request.param]


@pytest.fixture(params=list(TRACERS))
def trace(request):
    return TRACERS[request.param]


def test_every_piece_returns_a_tuple_read_with_getitem(case, trace):
    fn, expected_counts = case
    gm = trace(fn)
    split = split_module_tuple_return(gm, callback_for(gm))

    calls = piece_calls(split)
    counts = []
    for call in calls:
        value = output_arg(split.get_submodule(call.target))
        assert isinstance(value, tuple), (call.target, value)
        counts.append(len(value))
        # the parent reads each output exactly once, by index, and uses the call for nothing else
        assert all(u.op == "call_function" and u.target is operator.getitem for u in call.users)
        assert sorted(u.args[1] for u in call.users) == list(range(len(value)))
    assert counts == expected_counts
    assert any(c == 1 for c in counts)  # the case the rewrite exists for


def test_split_computes_what_the_original_graph_does(case, trace):
    fn, expected_counts = case
    gm = trace(fn)
    original_code = gm.code
    split = split_module_tuple_return(gm, callback_for(gm))
    assert gm.code == original_code  # the input graph is left alone

    returned = {}
    for name, piece in split.named_children():
        piece.register_forward_hook(lambda m, args, out, name=name: returned.setdefault(name, out))
    for seed in range(3):
        inputs = make_inputs(seed)
        expected_inputs = tuple(t.clone() for t in inputs)
        expected = as_tuple(gm(*expected_inputs))
        returned.clear()
        result = as_tuple(split(*inputs))
        assert len(result) == len(expected)
        for got, want in zip(result, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for got, want in zip(inputs, expected_inputs):  # the mutated buffer too
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        # at run time each piece really returned a tuple of its outputs
        assert [name for name, _ in split.named_children()] == list(returned)
        for (name, out), count in zip(returned.items(), expected_counts):
            assert isinstance(out, tuple) and len(out) == count, (name, out)
            assert all(isinstance(t, torch.Tensor) for t in out)


@needs_tuple_return
def test_without_tuple_return_single_outputs_are_bare():
    """The difference the rewrite removes is real on this torch (else the tests are vacuous)."""
    gm = symbolic(chain)
    bare = split_module(gm, None, callback_for(gm), keep_original_order=True)
    assert not isinstance(output_arg(bare.submod_0), tuple)
    reference = split_module(gm, None, callback_for(gm), keep_original_order=True,
                             tuple_return=True)
    split = split_module_tuple_return(gm, callback_for(gm))
    for name, piece in reference.named_children():
        assert piece.code == split.get_submodule(name).code, name


def test_split_at_attention_pieces_return_tuples(trace):
    gm = trace(chain)
    split = passes.split_at_attention(gm, [OP])
    assert [p.is_splitting_op for p in split.pieces] == [False, True, False, True, False]
    assert [len(output_arg(p.graph_module)) for p in split.pieces] == [1, 0, 2, 0, 1]
    inputs = make_inputs(7)
    expected_inputs = tuple(t.clone() for t in inputs)
    expected = as_tuple(gm(*expected_inputs))
    result = as_tuple(split.split_module(*inputs))
    for got, want in zip(result + inputs, expected + expected_inputs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
