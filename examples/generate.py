"""Quick start: greedy generation with an example model through kvgraph's paged KV cache.

    python examples/generate.py [--model llama|deepseek_mla] [--preset small|tiny] ...

Every prompt is prefilled in one batch, then all requests decode together, one token per step,
through `kvgraph.ModelRunner` in the graph mode of `--graph-mode` (default piecewise; `eager`
runs the model as written). Weights are random, so the tokens are noise, but the path is the
one a served model takes: compile, capture, then replay per batch descriptor.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

import kvgraph

if __package__:
    from .models import DeepseekMLA, Llama
else:  # run as `python examples/generate.py`: this folder, not the repo root, is on sys.path
    from models import DeepseekMLA, Llama

MODELS = {"llama": Llama, "deepseek_mla": DeepseekMLA}
MIN_PROMPT_LEN, MAX_PROMPT_LEN = 4, 48

# One step: the batch's request chunks in, each chunk's last-token logits `[num_reqs, vocab]` out.
Step = Callable[[Sequence[kvgraph.RequestChunk]], torch.Tensor]


@dataclass
class Request:
    """One prompt being generated: its tokens so far, how many are cached, its block table."""

    token_ids: list[int]
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    def next_chunk(self) -> kvgraph.RequestChunk:
        """The tokens not yet cached: the whole prompt first, then the last sampled token."""
        new_tokens = self.token_ids[self.num_computed_tokens:]
        return kvgraph.RequestChunk(new_tokens, self.num_computed_tokens, list(self.block_ids))

    def advance(self, next_token: int) -> None:
        """Every token so far is now cached; `next_token` is the next one to feed."""
        self.num_computed_tokens = len(self.token_ids)
        self.token_ids.append(next_token)

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.prompt_len:]


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def grow_block_table(request: Request, free_blocks: list[int], block_size: int) -> None:
    """Give `request` blocks from `free_blocks` until its block table covers all its tokens."""
    needed = blocks_for(len(request.token_ids), block_size) - len(request.block_ids)
    if needed > len(free_blocks):
        raise RuntimeError(f"out of KV cache blocks: need {needed}, {len(free_blocks)} free")
    request.block_ids.extend(free_blocks.pop() for _ in range(needed))


def make_requests(num_prompts: int, vocab_size: int, seed: int) -> list[Request]:
    """Random prompts of random lengths, repeatable for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(MIN_PROMPT_LEN, MAX_PROMPT_LEN + 1, (num_prompts,), generator=generator)
    return [
        Request(torch.randint(vocab_size, (int(n),), generator=generator).tolist(), int(n))
        for n in lengths
    ]


def make_runner(model: torch.nn.Module, requests: list[Request], num_blocks: int,
                args: argparse.Namespace) -> kvgraph.ModelRunner:
    """A runner sized for this demo's batches, in the graph mode the flags ask for."""
    config = kvgraph.CompilationConfig.from_cli_args(args)
    max_num_tokens = args.max_num_tokens or max(8, sum(r.prompt_len for r in requests))
    return kvgraph.ModelRunner(
        model, config.replace(max_num_tokens=max_num_tokens), num_blocks=num_blocks,
        block_size=args.block_size, max_num_tokens=max_num_tokens,
        max_num_seqs=len(requests), device=args.device,
    )


def generate(step: Step, requests: list[Request], free_blocks: list[int], block_size: int,
             max_new_tokens: int) -> int:
    """Greedy generation of `max_new_tokens` per request, all requests in every step.

    The first step prefills every prompt; each later step decodes one token per request.
    Returns the number of steps run.
    """
    for _ in range(max_new_tokens):
        for request in requests:
            grow_block_table(request, free_blocks, block_size)
        logits = step([request.next_chunk() for request in requests])
        for request, token in zip(requests, logits.argmax(dim=-1).tolist()):
            request.advance(token)
    return max_new_tokens


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    presets = sorted(set().union(*(model.presets for model in MODELS.values())))
    parser.add_argument("--preset", choices=presets, default="small")
    parser.add_argument("--num-prompts", type=positive_int, default=4)
    parser.add_argument("--max-new-tokens", type=positive_int, default=16)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the prompts")
    kvgraph.add_cli_args(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = MODELS[args.model].from_preset(args.preset, device=args.device, seed=args.seed)
    requests = make_requests(args.num_prompts, model.config.vocab_size, args.seed)
    num_blocks = sum(
        blocks_for(r.prompt_len + args.max_new_tokens, args.block_size) for r in requests
    )
    free_blocks = list(range(num_blocks))
    runner = make_runner(model, requests, num_blocks, args)
    start = time.perf_counter()
    summary = runner.capture()  # the first capture also compiles
    print(f"graph mode {runner.config.graph_mode.value}: compiled and captured "
          f"{summary['graphs']} graphs in {time.perf_counter() - start:.1f} s; they hold "
          f"{summary['bytes'] / 2**20:.1f} MiB")

    start = time.perf_counter()
    num_steps = generate(runner.execute, requests, free_blocks, args.block_size,
                         args.max_new_tokens)
    elapsed = time.perf_counter() - start

    for i, request in enumerate(requests):
        print(f"request {i} (prompt of {request.prompt_len} tokens): {request.generated}")
    generated = sum(len(r.generated) for r in requests)
    prompt_tokens = sum(r.prompt_len for r in requests)
    print(
        f"{args.model}/{args.preset} on {args.device}: {num_steps} steps, {prompt_tokens} prompt "
        f"tokens, {generated} generated in {elapsed:.2f} s ({generated / elapsed:.1f} tokens/s)"
    )
    stats = runner.stats()
    print(f"steps by graph: {stats['hits']}; graph replays {stats['graphs']['replays']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
