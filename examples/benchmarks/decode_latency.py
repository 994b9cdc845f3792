"""Decode-step latency of the Llama example per graph mode, after a parity check against eager.

For each mode: build a runner, capture, check that greedy generation matches eager (tokens and
logits), then time decode steps at several batch sizes. Prints a table, writes JSON.

    python -m examples.benchmarks.decode_latency --device cuda          # a GPU machine
    python -m examples.benchmarks.decode_latency --preset tiny --piece-compiler eager  # smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import kvgraph
from examples.models.llama import Llama

MODES = ["eager", "none", "piecewise", "full_decode_only", "full_and_piecewise"]
PROMPT_LEN = 16
BLOCK_SIZE = 16


def make_runner(args, mode: str) -> kvgraph.ModelRunner:
    model = Llama.from_preset(args.preset, device=args.device, dtype=getattr(torch, args.dtype))
    max_batch = max(args.batch_sizes)
    max_num_tokens = max(max_batch * PROMPT_LEN, 64)
    config = kvgraph.CompilationConfig(
        graph_mode=mode, piece_compiler=args.piece_compiler, max_num_tokens=max_num_tokens,
        capture_sizes=tuple(sorted({*args.batch_sizes, max_num_tokens})),
        cache_dir=args.cache_dir or kvgraph.config.default_cache_dir(),
    )
    blocks_per_seq = -(-(PROMPT_LEN + args.steps + args.parity_steps + 2) // BLOCK_SIZE)
    return kvgraph.ModelRunner(model, config, num_blocks=max_batch * blocks_per_seq + 1,
                               block_size=BLOCK_SIZE, max_num_tokens=max_num_tokens,
                               max_num_seqs=max_batch, device=args.device,
                               max_model_len=blocks_per_seq * BLOCK_SIZE)


def decode(runner, batch: int, steps: int, vocab: int) -> tuple[list[torch.Tensor], list[float]]:
    """Prefill `batch` prompts, then `steps` greedy decode steps; logits and per-step seconds."""
    blocks_per_seq = runner.max_model_len // BLOCK_SIZE
    generator = torch.Generator().manual_seed(batch)
    tokens = [torch.randint(vocab, (PROMPT_LEN,), generator=generator).tolist()
              for _ in range(batch)]
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(batch)]
    logits = runner.execute([kvgraph.RequestChunk(t, 0, b) for t, b in zip(tokens, tables)])
    history, times = [logits], []
    for _ in range(steps):
        for t, row in zip(tokens, logits):
            t.append(int(row.argmax()))
        chunks = [kvgraph.RequestChunk(t[-1:], len(t) - 1, b) for t, b in zip(tokens, tables)]
        runner.platform.synchronize()
        start = time.perf_counter()
        logits = runner.execute(chunks)
        runner.platform.synchronize()
        times.append(time.perf_counter() - start)
        history.append(logits)
    return history, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--piece-compiler", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    parser.add_argument("--parity-steps", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--json", default="decode_latency.json")
    args = parser.parse_args()

    reference: dict[int, list[torch.Tensor]] = {}
    results = []
    for mode in args.modes:
        runner = make_runner(args, mode)
        start = time.perf_counter()
        summary = runner.capture()
        row = {"mode": runner.config.graph_mode.value, "requested": mode,
               "capture_s": time.perf_counter() - start, "graphs": summary["graphs"],
               "graph_bytes": summary["bytes"]}
        vocab = runner.model.config.vocab_size
        for batch in args.batch_sizes:
            logits, _ = decode(runner, batch, args.parity_steps, vocab)
            if mode == args.modes[0]:
                reference[batch] = logits
            row[f"max_abs_diff_b{batch}"] = max(
                (a - b).abs().max().item() for a, b in zip(logits, reference[batch]))
            row[f"same_tokens_b{batch}"] = all(
                torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(logits, reference[batch]))
            _, times = decode(runner, batch, args.steps, vocab)
            row[f"ms_b{batch}"] = 1000 * statistics.median(times[2:] or times)
        results.append(row)
        print(json.dumps(row))
        del runner  # its graphs and their pool go with it, before the next mode's runner

    header = f"{'mode':<20}" + "".join(f"{'b=' + str(b) + ' ms':>12}" for b in args.batch_sizes)
    print(f"\n{args.preset} Llama, {args.dtype}, {args.device}, reference {args.modes[0]}")
    print(header + f"{'parity':>10}")
    for row in results:
        parity = all(row[f"same_tokens_b{b}"] for b in args.batch_sizes)
        print(f"{row['requested']:<20}" + "".join(f"{row[f'ms_b{b}']:>12.2f}" for b in args.batch_sizes)
              + f"{'ok' if parity else 'DIFF':>10}")
    machine = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda")
               else platform.processor() or platform.machine(),
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(args.json, "w") as f:
        json.dump({"machine": machine, "args": vars(args), "results": results}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
