"""kvgraph's rows of the decode benchmark: one ModelRunner per graph mode, timed and profiled.

Every runner gets a fresh model with the same weights, prefills equal-length random prompts,
then decodes greedily; `decode` records each step's time, and the host part of it (the step
plan and the persistent-input fill) separately.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch

import kvgraph
from examples.benchmarks.timing import median_ms, synchronize
from examples.models.llama import PRESETS, Llama

WARMUP_STEPS = 2  # untimed decode steps before timing (first replays, allocator growth)
PROFILE_ROWS = 15


@dataclass
class Decoded:
    """One decode run: the greedy tokens (prompt excluded), step and host seconds per step."""

    tokens: torch.Tensor  # [batch, steps + 1]: the prefill's token, then one per step
    logits: list[torch.Tensor]
    step_s: list[float]
    host_s: list[float]
    prefill_s: float


def prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """`batch` random prompts of `prompt_len` tokens, the same for every row of one batch size."""
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(vocab, (batch, prompt_len), generator=generator).tolist()


def make_runner(args, mode: str, weights: Mapping[str, torch.Tensor]) -> kvgraph.ModelRunner:
    """A runner for `mode` around a fresh model holding `weights`, sized for the whole run."""
    model = Llama.from_hf(dict(PRESETS[args.preset]), weights, dtype=args.torch_dtype,
                          device=args.device)
    max_batch = max(args.batch_sizes)
    max_num_tokens = max(max_batch * args.prompt_len, 64)
    cache = {"cache_dir": args.cache_dir} if args.cache_dir else {}  # else kvgraph's default
    config = kvgraph.CompilationConfig(  # the default capture sizes, as a server has them
        graph_mode=mode, piece_compiler=args.piece_compiler, max_num_tokens=max_num_tokens,
        **cache,
    )
    block_size = kvgraph.ModelRunner.default_block_size(args.device)  # 16; 128 on an NPU
    blocks_per_seq = -(-args.max_len // block_size)
    return kvgraph.ModelRunner(model, config, num_blocks=max_batch * blocks_per_seq + 1,
                               block_size=block_size, max_num_tokens=max_num_tokens,
                               max_num_seqs=max_batch, device=args.device,
                               max_model_len=blocks_per_seq * block_size,
                               attn_backend=args.attn_backend)


def host_seconds(runner: kvgraph.ModelRunner, chunks: list[kvgraph.RequestChunk]) -> float:
    """Host time of one step's preparation: planning it and filling the persistent inputs."""
    start = time.perf_counter()
    runner.prepare_step(chunks)
    return time.perf_counter() - start


class Requests:
    """One batch of requests on a runner: prefilled on creation, then advanced greedily."""

    def __init__(self, runner: kvgraph.ModelRunner, batch: int, prompt_len: int):
        blocks_per_seq = runner.limits.max_model_len // runner.limits.block_size
        self.prompt_len = prompt_len
        self.tokens = prompts(batch, prompt_len, runner.vocab_size)
        self.tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
                       for i in range(batch)]
        chunks = [kvgraph.RequestChunk(t, 0, b) for t, b in zip(self.tokens, self.tables)]
        synchronize(runner.device)
        start = time.perf_counter()
        self.logits = runner.execute(chunks)
        synchronize(runner.device)
        self.prefill_s = time.perf_counter() - start  # every prompt in one step

    def next_chunks(self) -> list[kvgraph.RequestChunk]:
        """Append each request's greedy token; the decode step that feeds them."""
        for t, row in zip(self.tokens, self.logits):
            t.append(int(row.argmax()))
        return [kvgraph.RequestChunk(t[-1:], len(t) - 1, b)
                for t, b in zip(self.tokens, self.tables)]

    def generated(self) -> torch.Tensor:
        """`[batch, steps + 1]`: the tokens chosen so far, the last logits' included."""
        last = self.logits.argmax(-1).cpu()
        return torch.tensor([t[self.prompt_len:] + [int(x)] for t, x in zip(self.tokens, last)])


def decode(runner: kvgraph.ModelRunner, batch: int, args, steps: int) -> Decoded:
    """Prefill `batch` prompts, then `steps` greedy decode steps, each timed."""
    requests = Requests(runner, batch, args.prompt_len)
    history, step_s, host_s = [requests.logits], [], []
    for _ in range(steps):
        chunks = requests.next_chunks()
        host_s.append(host_seconds(runner, chunks))
        synchronize(runner.device)
        start = time.perf_counter()
        requests.logits = runner.execute(chunks)
        synchronize(runner.device)
        step_s.append(time.perf_counter() - start)
        history.append(requests.logits)
    return Decoded(requests.generated(), history, step_s, host_s, requests.prefill_s)


def graph_bytes_vs_largest(bytes_by_descriptor: Mapping[str, int]) -> float | None:
    """All graphs' memory over the largest descriptor's: 1.0 when every size shares its pool
    (target <= 1.5); None without graphs."""
    largest = max(bytes_by_descriptor.values(), default=0)
    return sum(bytes_by_descriptor.values()) / largest if largest else None


def token_match(tokens: torch.Tensor, reference: torch.Tensor | None) -> float | None:
    """The fraction of greedy tokens equal to the reference's (None without a reference)."""
    if reference is None:
        return None
    n = min(tokens.shape[1], reference.shape[1])
    return (tokens[:, :n] == reference[:, :n]).float().mean().item()


def measure_mode(args, mode: str, weights: Mapping[str, torch.Tensor],
                 reference: dict[int, Decoded]) -> dict[str, Any]:
    """One graph mode's row: capture, parity against `reference` (filled if empty), timings."""
    runner = make_runner(args, mode, weights)
    summary = runner.capture()
    row: dict[str, Any] = {
        "name": f"kvgraph {mode}", "mode": runner.config.graph_mode.value,
        "attn_backend": runner.attn_backend, "capture_s": summary["seconds"],
        "graphs": summary["graphs"], "graph_bytes": summary["bytes"],
        "bytes_by_descriptor": summary["bytes_by_descriptor"],
        "graph_bytes_vs_largest": graph_bytes_vs_largest(summary["bytes_by_descriptor"]),
        "ms": {}, "host_ms": {}, "prefill_tok_s": {}, "token_match": {}, "max_abs_diff": {},
    }
    for batch in args.batch_sizes:
        parity = decode(runner, batch, args, args.parity_steps)
        ref = reference.setdefault(batch, parity)
        row["token_match"][batch] = token_match(parity.tokens, ref.tokens)
        row["max_abs_diff"][batch] = max((a.float() - b.float()).abs().max().item()
                                         for a, b in zip(parity.logits, ref.logits))
        timed = decode(runner, batch, args, WARMUP_STEPS + args.steps)
        row["ms"][batch] = median_ms(timed.step_s[WARMUP_STEPS:])
        row["host_ms"][batch] = median_ms(timed.host_s[WARMUP_STEPS:])
        # The parity run's prefill warmed this batch size up: the timed run's is steady.
        row["prefill_tok_s"][batch] = batch * args.prompt_len / timed.prefill_s
    runner.close()  # its graphs and pool go now, before the next mode's runner is built
    return row


def profile_step(runner: kvgraph.ModelRunner, batch: int, args) -> dict[str, str]:
    """Profile one decode step after warm-up; the top ops by self host (and device) time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    requests = Requests(runner, batch, args.prompt_len)
    for _ in range(WARMUP_STEPS):
        requests.logits = runner.execute(requests.next_chunks())
    chunks = requests.next_chunks()
    synchronize(runner.device)
    with torch.profiler.profile(activities=activities) as prof:
        runner.execute(chunks)
        synchronize(runner.device)
    averages = prof.key_averages()
    tables = {"self_cpu": averages.table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)}
    if runner.device.type == "cuda":
        tables["self_device"] = averages.table(sort_by="self_device_time_total",
                                               row_limit=PROFILE_ROWS)
    return tables


def profile_mode(args, mode: str, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Profile tables of one decode step per batch size, for one graph mode (printed too)."""
    runner = make_runner(args, mode, weights)
    runner.capture()
    profiles = {}
    for batch in args.batch_sizes:
        tables = profile_step(runner, batch, args)
        for sort, table in tables.items():
            print(f"\n=== kvgraph {mode}, batch {batch}: one decode step, by {sort} time\n"
                  f"{table}", flush=True)
        profiles[batch] = tables
    runner.close()
    return {"name": f"kvgraph {mode}", "mode": runner.config.graph_mode.value,
            "attn_backend": runner.attn_backend, "profiles": profiles}
