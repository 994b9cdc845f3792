"""FX passes: no-op elimination, splitting at attention ops, op matching, the pass manager and
the in-place rewrite of functionalized attention calls."""

from __future__ import annotations

import importlib.util
import operator
import sys
import textwrap

import pytest
import torch
from torch import fx
from torch._functorch.aot_autograd import aot_function

import kvgraph
import passes
from tests.support import scenario

ATTN = "kvgraph::unified_attention"
BLOCK_SIZE = 4
NUM_BLOCKS = 6
HEADS, KV_HEADS, HEAD_SIZE = 4, 2, 8


# --- helpers -----------------------------------------------------------------------------------


class Captured:
    """A Dynamo graph and the exact arguments Dynamo called it with, by input name."""

    def __init__(self, gm: fx.GraphModule, layout: list):
        self.gm = gm
        self.layout = layout  # each entry: ("input", name) or a plain value (a SymInt's size)

    def args(self, inputs: dict[str, torch.Tensor]) -> list:
        """The graph's arguments for `inputs` (each tensor cloned, so runs do not interfere)."""
        return [inputs[e[1]].clone() if isinstance(e, tuple) else e for e in self.layout]

    def run(self, inputs: dict[str, torch.Tensor]) -> tuple[object, dict[str, torch.Tensor]]:
        """Run the graph on clones of `inputs`; return its result and the (mutated) clones."""
        clones = {name: t.clone() for name, t in inputs.items()}
        args = [clones[e[1]] if isinstance(e, tuple) else e for e in self.layout]
        return self.gm(*args), clones


def capture_named(fn, inputs: dict[str, torch.Tensor], unbacked: tuple[str, ...] = ()) -> Captured:
    """Trace `fn(**inputs)` with Dynamo (tests.support.scenario.dynamo_capture), by input name."""
    passed = {name: t.clone() for name, t in inputs.items()}
    traced = scenario.dynamo_capture(fn, unbacked=[passed[name] for name in unbacked], **passed)
    by_id = {id(t): name for name, t in passed.items()}
    layout = [("input", by_id[id(a)]) if isinstance(a, torch.Tensor) else a for a in traced.args]
    return Captured(traced.gm, layout)


def call_nodes(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def method_nodes(gm: fx.GraphModule, name: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_method" and n.target == name]


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def attention_batch(num_tokens_per_request=(3, 2), computed=(0, 3)):
    """Metadata for requests with the given new/computed token counts, distinct blocks each."""
    chunks, next_block = [], 0
    for new, done in zip(num_tokens_per_request, computed):
        blocks_needed = -(-(new + done) // BLOCK_SIZE)
        chunks.append(kvgraph.RequestChunk(list(range(new)), done,
                                           list(range(next_block, next_block + blocks_needed))))
        next_block += blocks_needed
    assert next_block <= NUM_BLOCKS
    return kvgraph.build_attention_metadata(chunks, BLOCK_SIZE, "cpu"), sum(num_tokens_per_request)


def random_caches(generator) -> tuple[torch.Tensor, torch.Tensor]:
    key_cache, value_cache = kvgraph.AttentionSpec(
        BLOCK_SIZE, KV_HEADS, HEAD_SIZE, torch.float32).allocate(NUM_BLOCKS, "cpu")
    key_cache.normal_(generator=generator)
    value_cache.normal_(generator=generator)
    return key_cache, value_cache


def qkv(num_tokens: int, generator) -> dict[str, torch.Tensor]:
    return {
        "q": torch.randn(num_tokens, HEADS, HEAD_SIZE, generator=generator),
        "k": torch.randn(num_tokens, KV_HEADS, HEAD_SIZE, generator=generator),
        "v": torch.randn(num_tokens, KV_HEADS, HEAD_SIZE, generator=generator),
    }


def assert_same(result, expected):
    if isinstance(expected, (tuple, list)):
        assert len(result) == len(expected)
        for r, e in zip(result, expected):
            assert_same(r, e)
    else:
        torch.testing.assert_close(result, expected, rtol=0, atol=0)


pytestmark = pytest.mark.usefixtures("fresh_compile_state")


# --- noop_elimination --------------------------------------------------------------------------


def noop_fn(x, w):
    a = x.view(x.shape[0], 4)  # same shape: removed
    b = a.reshape(-1, 4)  # same shape: removed
    c = b.view(-1, 2)  # new shape: kept
    e = torch.reshape(c, (-1, 2))  # same shape: removed
    d = w.t().contiguous()  # non-contiguous input: kept
    f = x.contiguous()  # contiguous input: removed
    return e * 2, d + 1, f - 1


def test_noop_elimination_symbolic_shapes():
    inputs = {"x": torch.randn(5, 4), "w": torch.randn(3, 4)}
    captured = capture_named(noop_fn, inputs, unbacked=("x",))
    gm = captured.gm
    x_value = next(n for n in gm.graph.nodes if n.target == "L_x_").meta["example_value"]
    assert isinstance(x_value.shape[0], torch.SymInt)  # the test really is symbolic
    assert len(method_nodes(gm, "view")) == 2
    assert len(method_nodes(gm, "reshape")) == 1
    assert len(method_nodes(gm, "contiguous")) == 2
    assert len(call_nodes(gm, torch.reshape)) == 1

    before = captured.run(inputs)[0]
    passes.noop_elimination(gm)
    gm.graph.lint()
    gm.recompile()

    views = method_nodes(gm, "view")
    assert len(views) == 1 and views[0].args[1:] == (-1, 2)  # the shape-changing view stays
    assert method_nodes(gm, "reshape") == []
    assert call_nodes(gm, torch.reshape) == []
    contiguous = method_nodes(gm, "contiguous")
    assert len(contiguous) == 1
    assert contiguous[0].args[0].op == "call_method" and contiguous[0].args[0].target == "t"
    # the kept view now reads the input placeholder directly
    assert views[0].args[0].op == "placeholder"

    after = captured.run(inputs)[0]
    assert_same(after, before)
    assert_same(after, noop_fn(inputs["x"], inputs["w"]))
    # and at another size: the graph is symbolic, so it must stay valid for any n
    other = {"x": torch.randn(9, 4), "w": inputs["w"]}
    layout = [("input", e[1]) if isinstance(e, tuple) else 9 for e in captured.layout]
    assert_same(Captured(gm, layout).run(other)[0], noop_fn(other["x"], other["w"]))


def test_noop_elimination_keeps_shape_changes_and_dtype_views():
    def fn(x):
        return x.view(2, 8) + 1, x.view(torch.int32) + 1, x.view(torch.float32) * 2, x.expand(4, 4) - 1

    inputs = {"x": torch.randn(4, 4)}
    captured = capture_named(fn, inputs)
    gm = captured.gm
    assert len(method_nodes(gm, "view")) == 3
    before = captured.run(inputs)[0]
    passes.noop_elimination(gm)
    gm.recompile()
    kept = [n.args[1:] for n in method_nodes(gm, "view")]
    assert sorted(map(str, kept)) == sorted(map(str, [(2, 8), (torch.int32,)]))
    assert method_nodes(gm, "expand") == []
    assert_same(captured.run(inputs)[0], before)
    assert_same(captured.run(inputs)[0], fn(inputs["x"]))


def test_noop_elimination_on_aten_graph():
    def fn(x):
        return torch.ops.aten.view.default(x, [4, 4]) + torch.ops.aten.view.default(x, [16]).sum()

    gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake")(torch.randn(4, 4))
    views = call_nodes(gm, torch.ops.aten.view.default)
    assert len(views) == 2 and all("val" in n.meta for n in views)
    passes.noop_elimination(gm)
    gm.recompile()
    remaining = call_nodes(gm, torch.ops.aten.view.default)
    assert [list(n.args[1]) for n in remaining] == [[16]]
    x = torch.randn(4, 4)
    torch.testing.assert_close(gm(x), fn(x))


# --- op_name / is_op_call ----------------------------------------------------------------------


@pytest.mark.parametrize("target, expected", [
    (torch.ops.kvgraph.unified_attention, ATTN),
    (torch.ops.kvgraph.unified_attention.default, ATTN),
    (torch.ops.kvgraph.unified_mla_attention, "kvgraph::unified_mla_attention"),
    (torch.ops.aten.add, "aten::add"),
    (torch.ops.aten.add.Tensor, "aten::add"),
    (operator.add, None),
    (torch.add, None),
    ("view", None),
    (torch.ops.higher_order.auto_functionalized_v2, None),
])
def test_op_name(target, expected):
    assert passes.op_name(target) == expected


def test_is_op_call():
    graph = fx.Graph()
    x = graph.placeholder("x")
    packet = graph.call_function(torch.ops.kvgraph.unified_attention, (x,))
    overload = graph.call_function(torch.ops.kvgraph.unified_attention.default, (x,))
    mla = graph.call_function(torch.ops.kvgraph.unified_mla_attention.default, (x,))
    plain = graph.call_function(operator.add, (x, x))
    method = graph.call_method("unified_attention", (x,))
    graph.output(plain)
    names = [ATTN]
    assert passes.is_op_call(packet, names)
    assert passes.is_op_call(overload, names)
    assert not passes.is_op_call(mla, names)
    assert passes.is_op_call(mla, {ATTN, "kvgraph::unified_mla_attention"})
    assert not passes.is_op_call(plain, names)
    assert not passes.is_op_call(method, names)
    assert not passes.is_op_call(x, names)
    assert not passes.is_op_call(packet, [])


# --- split_at_attention ------------------------------------------------------------------------------


def two_layers(q, k, v, kc1, vc1, kc2, vc2):
    x = q * 2
    out1 = torch.empty_like(x)
    torch.ops.kvgraph.unified_attention(x, k, v, [kc1, vc1], out1, 0.5, -1)
    y = out1 + 1
    out2 = torch.empty_like(y)
    torch.ops.kvgraph.unified_attention(y, k * 3, v, [kc2, vc2], out2, 0.25, -1)
    return out2 * 3 + y


def back_to_back(q, k, v, kc1, vc1, kc2, vc2):
    x = q - 1
    out1 = torch.empty_like(x)
    out2 = torch.empty_like(x)
    torch.ops.kvgraph.unified_attention(x, k, v, [kc1, vc1], out1, 0.5, -1)
    torch.ops.kvgraph.unified_attention(x, k, v, [kc2, vc2], out2, 0.5, 2)
    return out1 * out2


def split_inputs(generator):
    metadata, num_tokens = attention_batch()
    inputs = qkv(num_tokens, generator)
    inputs["kc1"], inputs["vc1"] = random_caches(generator)
    inputs["kc2"], inputs["vc2"] = random_caches(generator)
    return metadata, inputs


def eager_reference(fn, metadata, inputs):
    clones = {name: t.clone() for name, t in inputs.items()}
    with kvgraph.set_forward_context(metadata):
        return fn(**clones), clones


def check_pieces(split: passes.SplitGraph, expected_kinds: list[bool], cache_names: list[str]):
    pieces = split.pieces
    assert [p.is_splitting_op for p in pieces] == expected_kinds
    # pieces in execution order: the order the split module calls them
    called = [n.target for n in split.split_module.graph.nodes if n.op == "call_module"]
    assert [p.name for p in pieces] == called
    op_caches = []
    for piece in pieces:
        ops = [n for n in piece.graph_module.graph.nodes if passes.is_op_call(n, [ATTN])]
        if piece.is_splitting_op:
            assert compute_nodes(piece.graph_module) == ops and len(ops) == 1
            op_caches.append(ops[0].args[3][0].target)
        else:
            assert ops == []
            assert compute_nodes(piece.graph_module)  # no empty compute pieces
    # the op pieces are the original calls, in their original order
    assert [name for name in op_caches] == [f"l_{c}_" for c in cache_names]


def run_split_and_compare(fn, captured: Captured, split: passes.SplitGraph, metadata, inputs):
    expected, expected_state = eager_reference(fn, metadata, inputs)
    with kvgraph.set_forward_context(metadata):
        original, original_state = captured.run(inputs)
        result, state = Captured(split.split_module, captured.layout).run(inputs)
    assert_same(original[0], expected)
    assert_same(result[0], expected)
    for name in inputs:
        assert_same(original_state[name], expected_state[name])
        assert_same(state[name], expected_state[name])
    # the attention really ran: the caches changed
    assert not torch.equal(state["kc1"], inputs["kc1"])
    assert not torch.equal(state["vc2"], inputs["vc2"])


def capture_attention_fn(fn, seed):
    """The Dynamo graph of `fn` on seeded attention inputs, with its metadata and inputs."""
    metadata, inputs = split_inputs(torch.Generator().manual_seed(seed))
    with kvgraph.set_forward_context(metadata):
        captured = capture_named(fn, inputs)
    return captured, metadata, inputs


@pytest.mark.parametrize("fn, kinds", [
    (two_layers, [False, True, False, True, False]),
    (back_to_back, [False, True, True, False]),
])
def test_split_at_attention(fn, kinds):
    captured, metadata, inputs = capture_attention_fn(fn, seed=0)
    ops = [n for n in captured.gm.graph.nodes if passes.is_op_call(n, [ATTN])]
    assert [n.target for n in ops] == [torch.ops.kvgraph.unified_attention] * 2  # the packet

    split = passes.split_at_attention(captured.gm, [ATTN])
    check_pieces(split, kinds, ["kc1", "kc2"])
    run_split_and_compare(fn, captured, split, metadata, inputs)


def test_split_at_default_overload_target():
    captured, metadata, inputs = capture_attention_fn(two_layers, seed=1)
    for node in captured.gm.graph.nodes:
        if node.target is torch.ops.kvgraph.unified_attention:
            node.target = torch.ops.kvgraph.unified_attention.default
    captured.gm.recompile()
    assert len(call_nodes(captured.gm, torch.ops.kvgraph.unified_attention.default)) == 2

    split = passes.split_at_attention(captured.gm, [ATTN])
    check_pieces(split, [False, True, False, True, False], ["kc1", "kc2"])
    run_split_and_compare(two_layers, captured, split, metadata, inputs)


def test_split_with_unmatched_names_is_one_piece():
    captured, metadata, inputs = capture_attention_fn(two_layers, seed=2)
    split = passes.split_at_attention(captured.gm, ["kvgraph::unified_mla_attention"])
    assert [p.is_splitting_op for p in split.pieces] == [False]
    run_split_and_compare(two_layers, captured, split, metadata, inputs)


def test_split_symbolic_trace_graph_with_attribute():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale_q = torch.nn.Parameter(torch.randn(HEAD_SIZE))

        def forward(self, q, k, v, kc1, vc1, kc2, vc2):
            x = q * self.scale_q
            out = torch.empty_like(x)
            torch.ops.kvgraph.unified_attention(x, k, v, [kc1, vc1], out, 0.5, -1)
            return out + self.scale_q

    model = Model()
    gm = fx.symbolic_trace(model)
    split = passes.split_at_attention(gm, [ATTN])
    assert [p.is_splitting_op for p in split.pieces] == [False, True, False]
    generator = torch.Generator().manual_seed(3)
    metadata, inputs = split_inputs(generator)
    expected, expected_state = eager_reference(model, metadata, inputs)
    clones = {name: t.clone() for name, t in inputs.items()}
    with kvgraph.set_forward_context(metadata):
        result = split.split_module(**clones)
    assert_same(result, expected)
    assert_same(clones["kc1"], expected_state["kc1"])


# --- PassManager / GraphPass -------------------------------------------------------------------


def _replace_target(gm, old, new):
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is old:
            node.target = new


def add_to_mul(gm):
    _replace_target(gm, operator.add, operator.mul)


def mul_to_sub(gm):
    _replace_target(gm, operator.mul, operator.sub)


class AddModule(torch.nn.Module):
    def forward(self, x, y):
        return x + y


def test_pass_manager_runs_in_order_with_observer():
    seen = []

    def observer(name, gm):
        seen.append((name, [n.target for n in gm.graph.nodes if n.op == "call_function"]))

    a = passes.GraphPass("add_to_mul", add_to_mul)
    b = passes.GraphPass("mul_to_sub", mul_to_sub)
    x, y = torch.tensor([5.0]), torch.tensor([3.0])

    gm = fx.symbolic_trace(AddModule())
    assert passes.PassManager([a, b])(gm, observer) is gm
    assert seen == [("add_to_mul", [operator.mul]), ("mul_to_sub", [operator.sub])]
    assert gm(x, y).item() == 2.0  # recompiled: (x + y) -> (x * y) -> (x - y)

    seen.clear()
    gm = fx.symbolic_trace(AddModule())
    passes.PassManager([b, a])(gm, observer)
    assert seen == [("mul_to_sub", [operator.add]), ("add_to_mul", [operator.mul])]
    assert gm(x, y).item() == 15.0

    gm = fx.symbolic_trace(AddModule())
    passes.PassManager([a])(gm)  # no observer is fine
    assert gm(x, y).item() == 15.0


def test_pass_manager_uuid():
    a = passes.GraphPass("add_to_mul", add_to_mul)
    b = passes.GraphPass("mul_to_sub", mul_to_sub)
    uuid_ab = passes.PassManager([a, b]).uuid()
    assert uuid_ab == passes.PassManager([passes.GraphPass("add_to_mul", add_to_mul),
                                          passes.GraphPass("mul_to_sub", mul_to_sub)]).uuid()
    others = {
        passes.PassManager([b, a]).uuid(),
        passes.PassManager([a]).uuid(),
        passes.PassManager([b]).uuid(),
        passes.PassManager([]).uuid(),
        passes.PassManager([a, a]).uuid(),
    }
    assert len(others) == 5 and uuid_ab not in others
    assert a.uuid() == passes.GraphPass("add_to_mul", add_to_mul).uuid()
    assert a.uuid() != b.uuid()
    registered = passes.REGISTERED_PASSES["noop_elimination"]
    assert registered.uuid() == passes.GraphPass("noop_elimination", passes.noop_elimination).uuid()


def _load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_graph_pass_uuid_follows_source(tmp_path):
    source = "def my_pass(gm):\n    return None\n"
    changed = "def my_pass(gm):\n    gm.graph.lint()\n"
    paths = {"same_a": source, "same_b": source, "changed": changed}
    modules = {}
    try:
        for stem, text in paths.items():
            path = tmp_path / f"kvgraph_test_pass_{stem}.py"
            path.write_text(textwrap.dedent(text))
            modules[stem] = _load_module(path, f"kvgraph_test_pass_{stem}")
        uuid = {stem: passes.GraphPass("p", m.my_pass).uuid() for stem, m in modules.items()}
        assert uuid["same_a"] == uuid["same_b"]
        assert uuid["changed"] != uuid["same_a"]
        assert passes.GraphPass("q", modules["same_a"].my_pass).uuid() != uuid["same_a"]
    finally:
        for stem in paths:
            sys.modules.pop(f"kvgraph_test_pass_{stem}", None)


# --- inplace_attention -------------------------------------------------------------------------


def aot_graph(fn, args, metadata) -> fx.GraphModule:
    """The AOT-functionalized inference graph of `fn`, with input mutations kept in the graph."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = aot_function(fn, fw_compiler=capture, keep_inference_input_mutations=True)
    with kvgraph.set_forward_context(metadata):
        compiled(*[a.clone() for a in args])
    assert len(graphs) == 1
    return graphs[0]


def one_call(q, k, v, key_cache, value_cache, out):
    before = key_cache.sum()
    torch.ops.kvgraph.unified_attention(q, k, v, [key_cache, value_cache], out, 0.5, -1)
    return out * 2, value_cache.sum() - before


def two_calls(q, k, v, key_cache, value_cache, out):
    torch.ops.kvgraph.unified_attention(q, k, v, [key_cache, value_cache], out, 0.5, -1)
    out2 = torch.empty_like(out)
    torch.ops.kvgraph.unified_attention(out * 2, k + 1, v, [key_cache, value_cache], out2, 0.3, -1)
    return out2 + 1


def sliced_cache(q, k, v, key_cache, value_cache, out):
    torch.ops.kvgraph.unified_attention(q, k, v, [key_cache[1:], value_cache[1:]], out, 0.5, -1)
    return out * 2


def inplace_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    metadata, num_tokens = attention_batch()
    t = qkv(num_tokens, generator)
    key_cache, value_cache = random_caches(generator)
    out = torch.randn(num_tokens, HEADS, HEAD_SIZE, generator=generator)
    return metadata, [t["q"], t["k"], t["v"], key_cache, value_cache, out]


def _copies_into(gm, placeholders):
    return [n for n in call_nodes(gm, torch.ops.aten.copy_.default) if n.args[0] in placeholders]


def _auto_functionalized(gm):
    return [n for n in call_nodes(gm, torch.ops.higher_order.auto_functionalized_v2)
            if passes.op_name(n.args[0]) == ATTN]


@pytest.mark.parametrize("fn, calls", [(one_call, 1), (two_calls, 2)])
def test_inplace_attention(fn, calls):
    metadata, args = inplace_inputs(seed=calls)
    gm = aot_graph(fn, args, metadata)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 6
    key_ph, value_ph, out_ph = placeholders[3:]
    assert len(_auto_functionalized(gm)) == calls
    assert {n.args[0] for n in _copies_into(gm, {key_ph, value_ph})} == {key_ph, value_ph}

    assert passes.inplace_attention(gm.graph, [ATTN]) == calls
    gm.graph.lint()
    gm.recompile()

    assert _auto_functionalized(gm) == []
    direct = call_nodes(gm, torch.ops.kvgraph.unified_attention.default)
    assert len(direct) == calls
    for node in direct:
        kv_cache = node.kwargs["kv_cache"]
        assert len(kv_cache) == 2 and kv_cache[0] is key_ph and kv_cache[1] is value_ph
    assert direct[0].kwargs["out"] is out_ph
    assert _copies_into(gm, {key_ph, value_ph}) == []

    # run the rewritten graph: caches and out are written in place, results match eager
    expected_args = [a.clone() for a in args]
    run_args = [a.clone() for a in args]
    pointers = [a.data_ptr() for a in run_args]
    with kvgraph.set_forward_context(metadata):
        expected = fn(*expected_args)
        result = gm(*run_args)
    assert [a.data_ptr() for a in run_args] == pointers
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert_same(tuple(result), expected)
    for got, want in zip(run_args, expected_args):
        assert_same(got, want)
    assert not torch.equal(run_args[3], args[3])  # the key cache really was written


def test_inplace_attention_ignores_other_ops():
    metadata, args = inplace_inputs(seed=5)
    gm = aot_graph(one_call, args, metadata)
    before = str(gm.graph)
    assert passes.inplace_attention(gm.graph, ["kvgraph::unified_mla_attention"]) == 0
    assert str(gm.graph) == before
    assert len(_auto_functionalized(gm)) == 1


def test_inplace_attention_leaves_views_alone():
    metadata, args = inplace_inputs(seed=6)
    gm = aot_graph(sliced_cache, args, metadata)
    assert len(_auto_functionalized(gm)) == 1
    rewritten = passes.inplace_attention(gm.graph, [ATTN])
    gm.recompile()
    expected_args = [a.clone() for a in args]
    run_args = [a.clone() for a in args]
    with kvgraph.set_forward_context(metadata):
        expected = sliced_cache(*expected_args)
        result = gm(*run_args)
    # whatever the pass decides, the graph must still compute what eager does
    assert_same(tuple(result), (expected,))
    for got, want in zip(run_args, expected_args):
        assert_same(got, want)
    assert rewritten == 0  # documented: calls on views are left for inductor


def test_inplace_attention_pass_uuid():
    a = passes.InplaceAttentionPass([ATTN, "kvgraph::unified_mla_attention"])
    b = passes.InplaceAttentionPass(["kvgraph::unified_mla_attention", ATTN])
    c = passes.InplaceAttentionPass([ATTN])
    assert a.uuid() == a.uuid() == b.uuid()
    assert c.uuid() != a.uuid()
    assert isinstance(a.uuid(), str) and len(a.uuid()) == 64


def test_inplace_attention_pass_counts_rewrites():
    metadata, args = inplace_inputs(seed=7)
    gm = aot_graph(two_calls, args, metadata)
    graph_pass = passes.InplaceAttentionPass([ATTN])
    graph_pass(gm.graph)
    assert graph_pass.rewritten == 2
    assert _auto_functionalized(gm) == []
