"""A fixed multi-step batch schedule run through any forward: how eager and graph are compared.

Token ids are fixed in advance (teacher forcing), so two runs see identical batches whatever
their logits; block tables are shuffled so pages are not contiguous.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

import kvgraph
from examples.models import MODELS
from kvgraph.attention.backends import GraphSupport, register_attention_backend
from kvgraph.attention.backends.torch_native import TorchNativeBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 96

# Each step: (request, new tokens) in batch order. Mixed prefill, chunked prefill and decode;
# batch sizes 1, 3, 4, 11, 17, 19, ... so some fall between and above typical compile sizes.
SCHEDULE = [
    [(0, 9), (1, 4)],
    [(0, 1), (1, 5), (2, 13)],
    [(0, 1), (1, 1), (2, 1)],
    [(2, 1)],
    [(0, 1), (3, 6), (1, 1), (2, 1)],
    [(3, 1), (2, 1), (1, 1), (0, 1)],
    [(0, 1), (1, 1)],
]


def make_model(kind: str, num_layers: int | None = None, seed: int = 0) -> torch.nn.Module:
    cls = MODELS[kind]
    config = dict(cls.presets["tiny"])
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    return cls.from_hf(config, seed=seed)


def bind_fresh_caches(model: torch.nn.Module, num_blocks: int = NUM_BLOCKS) -> dict:
    specs = kvgraph.kv_cache_specs(model, BLOCK_SIZE, torch.float32)
    caches = kvgraph.allocate_kv_caches(specs, num_blocks, "cpu")
    kvgraph.bind_kv_cache(kvgraph.attention_layers(model), caches)
    return caches


@dataclass
class Request:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int = 0


def make_requests(vocab_size: int, seed: int = 0, schedule=SCHEDULE) -> dict[int, Request]:
    rng = random.Random(seed)
    lengths: dict[int, int] = {}
    for step in schedule:
        for req, n in step:
            lengths[req] = lengths.get(req, 0) + n
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    requests = {}
    for req, length in sorted(lengths.items()):
        blocks = [free.pop() for _ in range(-(-length // BLOCK_SIZE))]
        requests[req] = Request([rng.randrange(vocab_size) for _ in range(length)], blocks)
    return requests


def run_schedule(forward: Callable, model: torch.nn.Module, schedule=SCHEDULE, seed: int = 0
                 ) -> list[torch.Tensor]:
    """Run every step through `forward(input_ids, positions)`; logits of each chunk's last token."""
    requests = make_requests(model.config.vocab_size, seed, schedule)
    step_logits = []
    for step in schedule:
        chunks = []
        for req, n in step:
            r = requests[req]
            chunks.append(kvgraph.RequestChunk(
                r.token_ids[r.num_computed:r.num_computed + n], r.num_computed, r.block_ids))
            r.num_computed += n
        metadata = kvgraph.build_attention_metadata(chunks, BLOCK_SIZE, "cpu")
        input_ids, positions = kvgraph.build_model_inputs(chunks, "cpu")
        with torch.no_grad(), kvgraph.set_forward_context(metadata):
            hidden = forward(input_ids, positions)
        last = metadata.query_start_loc[1:].long() - 1
        step_logits.append(model.compute_logits(hidden[last]))
    return step_logits


# Greedy generation through a runner: (request, new prompt tokens) chunks, then "decode" steps
# where every listed request feeds back its last sampled token. Batch sizes 1..21 tokens land
# on (1, 2, 4, 8, 16), between them, and above 16.
GENERATION = [
    [(0, 7), (1, 3)],
    [(0, "decode"), (1, 5), (2, 13)],
    [(0, "decode"), (1, "decode"), (2, "decode")],
    [(0, "decode"), (1, "decode"), (2, "decode"), (3, 2)],
    [(3, "decode")],
    [(0, "decode"), (1, "decode"), (2, "decode"), (3, "decode")],
    [(0, "decode"), (1, "decode"), (2, "decode"), (3, "decode"), (4, 17)],
    [(4, "decode"), (0, "decode"), (1, "decode")],
    [(0, "decode"), (1, "decode"), (2, "decode"), (3, "decode"), (4, "decode")],
]
MAX_NEW_TOKENS = 8


def generate(runner, vocab_size: int, plan=GENERATION, seed: int = 0):
    """Run `plan` through `runner.execute`; each step's logits and the sampled token ids."""
    rng = random.Random(seed)
    prompts = {}
    for step in plan:
        for req, n in step:
            if n != "decode":
                prompts[req] = prompts.get(req, 0) + n
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    requests = {
        req: Request([rng.randrange(vocab_size) for _ in range(n)],
                     [free.pop() for _ in range(-(-(n + MAX_NEW_TOKENS) // BLOCK_SIZE))])
        for req, n in sorted(prompts.items())
    }
    sampled: dict[int, list[int]] = {req: [] for req in requests}
    step_logits = []
    for step in plan:
        chunks = []
        for req, n in step:
            r = requests[req]
            if n == "decode":
                r.token_ids.append(sampled[req][-1])
                n = 1
            chunks.append(kvgraph.RequestChunk(
                r.token_ids[r.num_computed:r.num_computed + n], r.num_computed, r.block_ids))
            r.num_computed += n
        logits = runner.execute(chunks)
        step_logits.append(logits)
        for (req, _), row in zip(step, logits):
            if requests[req].num_computed == len(requests[req].token_ids):
                sampled[req].append(int(row.argmax()))
    return step_logits, sampled


# The one helper that captures what Dynamo hands a backend (tests of passes, fingerprints and
# the backend's inputs inspect it); tests that need fresh Dynamo state use the
# `fresh_compile_state` fixture (tests/conftest.py).


@dataclass
class DynamoCapture:
    """The FX graph Dynamo traced, and the arguments Dynamo called it with on the first call."""

    gm: torch.fx.GraphModule
    args: tuple


def dynamo_capture(fn: Callable, *args, unbacked=(), **kwargs) -> DynamoCapture:
    """Trace `fn(*args, **kwargs)` once with Dynamo (fullgraph) and run the traced graph as is.

    `unbacked`: tensors whose dim 0 is marked unbacked (dynamic, 0 and 1 included) first.
    """
    graphs, calls = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*graph_args):
            calls.append(graph_args)
            return gm.forward(*graph_args)

        return run

    for tensor in unbacked:
        torch._dynamo.decorators.mark_unbacked(tensor, 0)
    torch.compile(fn, backend=backend, fullgraph=True)(*args, **kwargs)
    assert len(graphs) == 1 and len(calls) == 1, (len(graphs), len(calls))
    return DynamoCapture(graphs[0], calls[0])


# --- runners: every graph mode against eager, through ModelRunner -----------------------------

CAPTURE_SIZES = (1, 2, 4, 8, 16)
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def make_runner(kind, mode, device="cpu", piece_compiler="eager", attn_backend=None, **config):
    model = make_model(kind).to(device)
    config = kvgraph.CompilationConfig(graph_mode=mode, piece_compiler=piece_compiler,
                                       capture_sizes=CAPTURE_SIZES, check_graph_inputs=True,
                                       **config)
    return kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                               max_num_tokens=32, max_num_seqs=8, device=device,
                               attn_backend=attn_backend)


def assert_matches_eager(kind, mode, device="cpu", **config):
    eager = make_runner(kind, "eager", device)
    expected_logits, expected_tokens = generate(eager, eager.model.config.vocab_size)
    runner = make_runner(kind, mode, device, **config)
    runner.capture()
    logits, tokens = generate(runner, runner.model.config.vocab_size)
    assert tokens == expected_tokens
    for step, (got, want) in enumerate(zip(logits, expected_logits)):
        torch.testing.assert_close(got, want, **TOLERANCE, msg=f"step {step}")
    for name, cache in eager.kv_caches.items():
        for got, want in zip(runner.kv_caches[name], cache):
            torch.testing.assert_close(got, want, **TOLERANCE, msg=name)
    return runner


def assert_backend_generates_like_torch_native(kind, mode, backend, plan, device="cpu"):
    """A runner on `backend` in `mode` gives torch_native eager's tokens and logits on `plan`,
    in `mode` itself (a backend that captures any batch is not downgraded); in `full`, mixed
    prefill/decode batches ran inside full graphs."""
    reference = make_runner(kind, "eager", device, attn_backend="torch_native")
    expected_logits, expected_tokens = generate(reference, reference.model.config.vocab_size,
                                                plan)
    runner = make_runner(kind, mode, device, attn_backend=backend)
    assert runner.config.graph_mode.value == mode, f"{backend} captures every batch: no downgrade"
    runner.capture()
    logits, tokens = generate(runner, runner.model.config.vocab_size, plan)
    assert tokens == expected_tokens
    for got, want in zip(logits, expected_logits):
        torch.testing.assert_close(got, want, **TOLERANCE)
    if mode == "full":
        assert any(key.startswith("full:") and "uniform_decode=False" in key
                   for key in runner.stats()["hits"])


class AlwaysCapturableBackend(TorchNativeBackend):
    """Torch-native math declared capture-safe for every batch: the runner then pads mixed
    batches to fixed shapes, which exercises the full-graph path for non-decode batches."""

    name = "test_always"
    graph_support = GraphSupport.ALWAYS


register_attention_backend(AlwaysCapturableBackend)
