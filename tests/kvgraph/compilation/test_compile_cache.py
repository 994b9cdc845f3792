"""The compile cache: atomic, checksummed artifacts; graph fingerprints; key digests."""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx

import kvgraph
import passes
from kvgraph.compilation.cache import CompileCache
from kvgraph.compilation.cache_key import digest, graph_fingerprint, source_files_digest
from kvgraph.compilation.counters import compile_counters
from tests.support.scenario import dynamo_capture

KEY = digest("test-key")


pytestmark = pytest.mark.usefixtures("fresh_compile_state")


@pytest.fixture
def counters(fresh_compile_state):
    return compile_counters


def write_bytes(payload: bytes):
    def saver(path: str) -> None:
        Path(path).write_bytes(payload)
    return saver


def read_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


def files_under(root: Path) -> list[str]:
    """Every file and directory under root, relative, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# --- round trip and atomic save ----------------------------------------------------------------


def test_round_trip(tmp_path):
    payload = os.urandom(4096)
    cache = CompileCache.open(tmp_path, KEY)
    cache.save("piece-general", write_bytes(payload))
    assert cache.load("piece-general", read_bytes) == payload
    # another instance with the same root and key sees it; one with another key does not
    assert CompileCache.open(tmp_path, KEY).load("piece-general", read_bytes) == payload
    other = CompileCache.open(tmp_path, digest("other-key"))
    assert other.load("piece-general", read_bytes) is None
    # save replaces
    cache.save("piece-general", write_bytes(b"second"))
    assert cache.load("piece-general", read_bytes) == b"second"


def test_empty_payload_round_trip(tmp_path):
    cache = CompileCache.open(tmp_path, KEY)
    cache.save("empty", write_bytes(b""))
    assert cache.load("empty", read_bytes) == b""


def test_names_are_separate(tmp_path):
    cache = CompileCache.open(tmp_path, KEY)
    cache.save("a", write_bytes(b"payload a"))
    cache.save("b", write_bytes(b"payload b"))
    assert cache.load("a", read_bytes) == b"payload a"
    assert cache.load("b", read_bytes) == b"payload b"


def test_load_missing_returns_none(tmp_path, counters, caplog):
    cache = CompileCache.open(tmp_path / "never-created", KEY)
    with caplog.at_level(logging.WARNING):
        assert cache.load("nothing", read_bytes) is None
    cache.save("something", write_bytes(b"x"))
    assert cache.load("nothing", read_bytes) is None
    assert counters.cache_corrupt == 0
    assert caplog.records == []


def test_save_leaves_no_temporary_files(tmp_path):
    cache = CompileCache.open(tmp_path, KEY)
    for i in range(3):
        cache.save("a", write_bytes(b"a" * (i + 1)))
    cache.save("b", write_bytes(b"b"))
    assert cache.load("a", read_bytes) == b"aaa"
    files = files_under(cache.directory)
    assert files == sorted([cache.path("a").name, cache.path("b").name])
    assert files_under(tmp_path) == sorted(
        [cache.directory.name, "inductor"] + [f"{cache.directory.name}/{name}" for name in files])


def test_failing_saver_leaves_nothing(tmp_path):
    cache = CompileCache.open(tmp_path, KEY)

    def saver(path):
        Path(path).write_bytes(b"half an artifact")
        raise RuntimeError("compiler crashed while saving")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cache.save("piece", saver)
    assert not cache.path("piece").exists()
    assert cache.load("piece", read_bytes) is None
    assert files_under(cache.directory) == []


def test_failing_saver_keeps_previous_artifact(tmp_path, caplog):
    cache = CompileCache.open(tmp_path, KEY)
    cache.save("piece", write_bytes(b"good"))

    def saver(path):
        Path(path).write_bytes(b"bad")
        raise OSError(28, "No space left on device")

    with caplog.at_level(logging.WARNING, logger="kvgraph.compilation.cache"):
        cache.save("piece", saver)  # a write error is a fault to survive: warned, not raised
        cache.save("other", write_bytes(b"later"))  # and the cache saves nothing more
    assert [r.getMessage() for r in caplog.records if "No space left" in r.getMessage()]
    assert len(caplog.records) == 1
    assert cache.load("piece", read_bytes) == b"good"
    assert files_under(cache.directory) == [cache.path("piece").name]


# --- damaged artifacts -------------------------------------------------------------------------


def _truncate(blob: bytes) -> bytes:
    return blob[:-7]


def _truncate_to_header(blob: bytes) -> bytes:
    return blob[:25]


def _empty(blob: bytes) -> bytes:
    return b""


def _flip_payload_byte(blob: bytes) -> bytes:
    damaged = bytearray(blob)
    damaged[len(blob) - 100] ^= 0x01  # a byte well inside the payload
    return bytes(damaged)


def _wrong_header(blob: bytes) -> bytes:
    damaged = bytearray(blob)
    damaged[0] ^= 0x20  # same length, first byte of the magic changed
    return bytes(damaged)


def _raw_payload(blob: bytes) -> bytes:
    return b"an artifact written by something else, without kvgraph's header" * 10


def _extended(blob: bytes) -> bytes:
    return blob + b"trailing junk"


@pytest.mark.parametrize("damage", [_truncate, _truncate_to_header, _empty, _flip_payload_byte,
                                    _wrong_header, _raw_payload, _extended])
def test_damaged_artifact_is_discarded(tmp_path, counters, caplog, damage):
    payload = os.urandom(1000)
    cache = CompileCache.open(tmp_path, KEY)
    cache.save("piece", write_bytes(payload))
    path = cache.path("piece")
    damaged = damage(path.read_bytes())
    assert damaged != path.read_bytes()
    path.write_bytes(damaged)

    loaded = []
    with caplog.at_level(logging.WARNING, logger="kvgraph.compilation.cache"):
        result = cache.load("piece", lambda p: loaded.append(read_bytes(p)) or read_bytes(p))
    assert result is None
    assert loaded == []  # the loader never saw the damaged payload
    assert not path.exists()
    assert counters.cache_corrupt == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    # the next load is a plain miss, and a rebuild is stored and loads again
    assert cache.load("piece", read_bytes) is None
    assert counters.cache_corrupt == 1
    cache.save("piece", write_bytes(payload))
    assert cache.load("piece", read_bytes) == payload


def test_failing_loader_is_treated_as_damage(tmp_path, counters, caplog):
    cache = CompileCache.open(tmp_path, KEY)
    cache.save("piece", write_bytes(b"from an older torch"))

    def loader(path):
        assert read_bytes(path) == b"from an older torch"
        raise ValueError("unsupported artifact version")

    with caplog.at_level(logging.WARNING, logger="kvgraph.compilation.cache"):
        assert cache.load("piece", loader) is None
    assert not cache.path("piece").exists()
    assert counters.cache_corrupt == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "unsupported artifact version" in warnings[0].getMessage()
    assert files_under(cache.directory) == []  # no scratch copy left behind


def test_load_leaves_no_scratch_files(tmp_path):
    cache = CompileCache.open(tmp_path, KEY)
    cache.save("piece", write_bytes(b"abc"))
    seen_paths = []
    assert cache.load("piece", lambda p: seen_paths.append(p) or read_bytes(p)) == b"abc"
    assert not os.path.exists(seen_paths[0])
    assert files_under(cache.directory) == [cache.path("piece").name]


def test_concurrent_saves_never_leave_a_damaged_file(tmp_path, counters):
    cache = CompileCache.open(tmp_path, KEY)
    payloads = {i: bytes([i]) * (200_000 + i) for i in range(2)}
    rounds = 40
    errors, loads = [], []
    stop = threading.Event()

    def writer(i):
        try:
            for _ in range(rounds):
                cache.save("shared", write_bytes(payloads[i]))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    def reader():
        while not stop.is_set():
            result = cache.load("shared", read_bytes)
            if result is not None:
                loads.append(result in payloads.values())

    writers = [threading.Thread(target=writer, args=(i,)) for i in payloads]
    readers = [threading.Thread(target=reader)]
    for thread in writers + readers:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    for thread in readers:
        thread.join()

    assert errors == []
    assert counters.cache_corrupt == 0
    assert loads and all(loads)
    assert cache.load("shared", read_bytes) in payloads.values()
    assert files_under(cache.directory) == [cache.path("shared").name]


# --- graph_fingerprint -------------------------------------------------------------------------


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, key_cache, value_cache):
        h = self.proj(x).view(-1, 2, 4)
        out = torch.empty_like(h)
        torch.ops.kvgraph.unified_attention(h, h[:, :1], h[:, :1], [key_cache, value_cache],
                                            out, 0.5, -1)
        return out.view(-1, 8) + x


class Stack(torch.nn.Module):
    def __init__(self, num_layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(num_layers))

    def forward(self, x, caches):
        for layer, (key_cache, value_cache) in zip(self.layers, caches):
            x = layer(x, key_cache, value_cache)
        return x


def test_fingerprint_identical_layers_match():
    spec = kvgraph.AttentionSpec(4, 1, 4, torch.float32)
    caches = [spec.allocate(4, "cpu") for _ in range(4)]
    metadata = kvgraph.build_attention_metadata(
        [kvgraph.RequestChunk([1, 2, 3, 4, 5], 0, [0, 1])], 4)
    with kvgraph.set_forward_context(metadata):
        x = torch.randn(5, 8)
        gm = dynamo_capture(Stack(4), x, caches, unbacked=[x]).gm
    split = passes.split_at_attention(gm, ["kvgraph::unified_attention"])
    compute = [p.graph_module for p in split.pieces if not p.is_splitting_op]
    assert len(compute) == 5  # first, 3 x (end of layer i + start of layer i+1), last
    middle = compute[1:4]
    # the node names of the middle pieces differ (each names its own layer's parameters)...
    names = [{n.name for n in g.graph.nodes if n.op == "placeholder"} for g in middle]
    for layer, piece_names in enumerate(names, start=1):
        parameters = [name for name in piece_names if "_parameters_" in name]
        assert len(parameters) == 2, piece_names  # this layer's proj weight and bias
        assert all(f"_layers_modules_{layer}_" in name for name in parameters), piece_names
    assert len({frozenset(n) for n in names}) == 3  # pairwise different, first and last too
    # ...but they are the same computation
    prints = [graph_fingerprint(g) for g in compute]
    assert prints[1] == prints[2] == prints[3]
    assert len({prints[0], prints[1], prints[4]}) == 3


def test_fingerprint_blind_to_node_names():
    def build(names):
        graph = fx.Graph()
        a = graph.placeholder(names[0])
        b = graph.placeholder(names[1])
        s = graph.call_function(torch.add, (a, b), name=names[2])
        r = graph.call_function(torch.relu, (s,), name=names[3])
        graph.output(r)
        return fx.GraphModule(torch.nn.Module(), graph)

    one = build(["x", "y", "sum", "act"])
    two = build(["left", "right", "total", "relu_out"])
    assert [n.name for n in one.graph.nodes] != [n.name for n in two.graph.nodes]
    assert graph_fingerprint(one) == graph_fingerprint(two)


def test_fingerprint_of_symbolic_traces_of_one_class():
    class Block(torch.nn.Module):
        def forward(self, x, y):
            return torch.relu(x * 2 + y).sum(-1)

    assert graph_fingerprint(fx.symbolic_trace(Block())) == \
        graph_fingerprint(fx.symbolic_trace(Block()))


def test_fingerprint_same_function_retraced_is_stable():
    def fn(x):
        return torch.sigmoid(x) * 3

    first = graph_fingerprint(dynamo_capture(fn, torch.randn(4, 8)).gm)
    torch._dynamo.reset()
    assert graph_fingerprint(dynamo_capture(fn, torch.randn(4, 8)).gm) == first


def test_fingerprint_differs_when_an_op_differs():
    def with_relu(x):
        return torch.relu(x) + 1

    def with_sigmoid(x):
        return torch.sigmoid(x) + 1

    def with_sub(x):
        return torch.relu(x) - 1

    x = torch.randn(4, 8)
    prints = {graph_fingerprint(dynamo_capture(f, x).gm)
              for f in (with_relu, with_sigmoid, with_sub)}
    assert len(prints) == 3


def test_fingerprint_differs_when_a_shape_or_dtype_differs():
    def fn(x):
        return x.sum(0) * 2

    a = graph_fingerprint(dynamo_capture(fn, torch.randn(4, 8)).gm)
    torch._dynamo.reset()
    b = graph_fingerprint(dynamo_capture(fn, torch.randn(4, 16)).gm)
    torch._dynamo.reset()
    c = graph_fingerprint(dynamo_capture(fn, torch.randn(4, 8, dtype=torch.float64)).gm)
    torch._dynamo.reset()
    # same numbers, other strides
    d = graph_fingerprint(dynamo_capture(fn, torch.randn(4, 8).t()).gm)
    assert len({a, b, c, d}) == 4


def test_fingerprint_differs_when_a_constant_argument_differs():
    def view_2_8(x):
        return x.view(2, 8) + 1

    def view_4_4(x):
        return x.view(4, 4) + 1

    x = torch.randn(16)
    assert graph_fingerprint(dynamo_capture(view_2_8, x).gm) != \
        graph_fingerprint(dynamo_capture(view_4_4, x).gm)


def test_fingerprint_distinguishes_boolean_dispatch_ops():
    def pool1d(x):
        return F.max_pool1d(x, 2) + 1

    def pool2d(x):
        return F.max_pool2d(x, 2) + 1

    x = torch.randn(1, 4, 4)
    assert pool1d(x).shape != pool2d(x).shape  # really different computations
    assert graph_fingerprint(dynamo_capture(pool1d, x).gm) != \
        graph_fingerprint(dynamo_capture(pool2d, x).gm)


# --- digest / source_files_digest --------------------------------------------------------------


def test_digest_stable_and_order_sensitive():
    config = kvgraph.CompilationConfig(piece_compiler="eager", capture_sizes=(1, 2))
    same_config = kvgraph.CompilationConfig(piece_compiler="eager", capture_sizes=[2, 1, 1])
    parts = ("2.13.0", "0.1.0", "cpu", config)
    value = digest(*parts)
    assert re.fullmatch(r"[0-9a-f]{64}", value), value  # sha256, hex
    assert digest(*parts) == value
    assert digest("2.13.0", "0.1.0", "cpu", same_config) == value
    assert digest("0.1.0", "2.13.0", "cpu", config) != value
    assert digest("2.13.0", "0.1.0", "cpu", config.replace(graph_mode="full")) != value
    assert digest("a", "b") != digest("b", "a")
    # Parts are separated: repr alone keeps ("ab", "c") from ("a", "bc") (the quotes), but
    # 1, 23 and 12, 3 both concatenate to "123".
    assert digest("ab", "c") != digest("a", "bc")
    assert digest(1, 23) != digest(12, 3)
    assert digest(1, 2) != digest(12)
    assert digest(1) != digest("1")
    assert digest() != digest("")
    assert digest((1, 2)) != digest(1, 2)


def test_source_files_digest(tmp_path):
    a, b = tmp_path / "model.py", tmp_path / "layers.py"
    a.write_text("def forward(x):\n    return x + 1\n")
    b.write_text("SCALE = 2\n")
    paths = [str(a), str(b)]
    original = source_files_digest(paths)
    assert source_files_digest(paths) == original
    assert source_files_digest(list(reversed(paths)) + [str(a)]) == original  # a set of files

    a.write_text("def forward(x):\n    return x + 2\n")
    changed = source_files_digest(paths)
    assert changed != original
    a.write_text("def forward(x):\n    return x + 1\n")
    assert source_files_digest(paths) == original

    assert source_files_digest([str(a)]) != original  # a file fewer
    missing = str(tmp_path / "deleted.py")
    with_missing = source_files_digest(paths + [missing])  # does not raise
    assert with_missing != original
    (tmp_path / "deleted.py").write_text("x = 1\n")
    assert source_files_digest(paths + [missing]) != with_missing


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_an_os_error_while_loading_keeps_the_artifact(tmp_path, counters, caplog, code):
    cache = CompileCache.open(tmp_path, KEY)
    cache.save("piece", write_bytes(b"a good build"))

    def loader(path):
        assert read_bytes(path) == b"a good build"
        raise OSError(code, os.strerror(code))  # what the disk said, not what the file holds

    with caplog.at_level(logging.WARNING, logger="kvgraph.compilation.cache"):
        assert cache.load("piece", loader) is None
    [message] = [r.getMessage() for r in caplog.records]
    assert os.strerror(code) in message and "kept" in message
    assert counters.cache_corrupt == 0
    assert cache.load("piece", read_bytes) == b"a good build"
