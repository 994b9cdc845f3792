"""Host time per step: kvgraph's step plan, input fill and op call, and the engine's sampling.

No model runs: the op is timed with an attention backend that does nothing, so what is left is
the op's own dispatch and checks; the step is timed as `ModelRunner` plans and fills it for
decode batches; sampling as the engine's `Sampler` picks a batch's tokens from random logits of
`--vocab` entries (greedy, temperature, top-k and top-p). Prints a table, writes JSON.

    python -m examples.benchmarks.host_overhead [--json out.json]
"""

from __future__ import annotations

import argparse
import time

import torch

import kvgraph
from examples.benchmarks.timing import machine, write_json
from examples.engine.detokenizer import Detokenizer
from examples.engine.request import Request
from examples.engine.sampler import Sampler
from examples.engine.sampling_params import SamplingParams
from examples.engine.tokenizer import ByteTokenizer
from examples.models.llama import Llama
from kvgraph.attention.backends import AttentionBackend, GraphSupport, register_attention_backend


# What the sampling rows time: each a batch of requests that all sample this way.
SAMPLING = {"greedy": SamplingParams(temperature=0), "temperature": SamplingParams(),
            "top-k 50": SamplingParams(top_k=50), "top-p 0.9": SamplingParams(top_p=0.9)}


class NoKernels(AttentionBackend):
    """An attention backend that launches nothing: the op's own host cost is all that is left."""

    name = "no_kernels"
    graph_support = GraphSupport.ALWAYS

    def forward(self, *args):
        pass

    forward_mla = forward_encoder = forward


def microseconds(fn, repeats: int) -> float:
    for _ in range(repeats // 10):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def op_call_us(repeats: int) -> float:
    register_attention_backend(NoKernels)
    chunks = [kvgraph.RequestChunk([1], 40, [3 * i, 3 * i + 1, 3 * i + 2]) for i in range(8)]
    metadata = kvgraph.build_attention_metadata(chunks, 16)
    query, out = torch.zeros(8, 32, 64), torch.zeros(8, 32, 64)
    key = value = torch.zeros(8, 8, 64)
    cache = [torch.zeros(24, 16, 8, 64), torch.zeros(24, 16, 8, 64)]
    with torch.no_grad(), kvgraph.set_forward_context(metadata, None, NoKernels.name):
        return microseconds(
            lambda: torch.ops.kvgraph.unified_attention(query, key, value, cache, out, 0.125),
            repeats)


def step_us(batch: int, repeats: int) -> float:
    config = kvgraph.CompilationConfig(graph_mode="full_and_piecewise", piece_compiler="eager")
    runner = kvgraph.ModelRunner(Llama.from_preset("tiny"), config, num_blocks=batch * 64,
                                 block_size=16, max_num_tokens=512, max_num_seqs=256,
                                 max_model_len=1024)
    chunks = [kvgraph.RequestChunk([5], 900, list(range(i * 64, i * 64 + 57)))
              for i in range(batch)]
    return microseconds(lambda: runner.prepare_step(chunks), repeats)


def sample_us(batch: int, params: SamplingParams, vocab: int, repeats: int) -> float:
    """One batch's sampling; logits spread like a trained model's (a few likely tokens)."""
    sampler = Sampler("cpu")
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 4
    requests = [Request(f"r{i}", [1], params, Detokenizer(ByteTokenizer()), 0.0)
                for i in range(batch)]
    return microseconds(lambda: sampler(logits, requests), repeats)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocab", type=int, default=32000, help="the sampled logits' width")
    parser.add_argument("--sampling-batch", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = [("attention op call (no kernels)", op_call_us(args.repeats))]
    rows += [(f"step plan + input fill, decode b={b}", step_us(b, args.repeats // 4))
             for b in args.batch_sizes]
    rows += [(f"sampling, {name}, b={args.sampling_batch}",
              sample_us(args.sampling_batch, params, args.vocab, max(args.repeats // 20, 10)))
             for name, params in SAMPLING.items()]
    print(f"{'what':<40} {'us':>8}")
    for name, us in rows:
        print(f"{name:<40} {us:>8.1f}")
    payload = {"machine": machine(torch.device("cpu")),
               "rows": [{"what": name, "us": us} for name, us in rows]}
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
