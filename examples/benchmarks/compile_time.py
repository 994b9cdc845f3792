"""Compile time of the Llama example: cold, warm (compile cache), and 2 vs 8 layers.

Each measurement runs in a fresh process, so nothing is shared but what is on disk.
Compile time is the first forward call (Dynamo trace, passes, split, piece builds);
the process time adds Python start-up and `import torch`.

    python -m examples.benchmarks.compile_time [--json compile_time.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch


def measure(num_layers: int, cache_dir: str, compile_sizes: str) -> dict:
    """Run one compile in a child process and return its timings."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "examples.benchmarks.compile_time", "--child",
         str(num_layers), cache_dir, compile_sizes],
        capture_output=True, text=True, check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def child(num_layers: int, cache_dir: str, compile_sizes: str) -> None:
    import kvgraph
    from examples.models.llama import PRESETS, Llama
    from kvgraph.compilation.counters import compile_counters as counters

    model = Llama.from_hf({**PRESETS["tiny"], "num_hidden_layers": num_layers})
    caches = kvgraph.allocate_kv_caches(kvgraph.kv_cache_specs(model, 16, torch.float32), 64, "cpu")
    kvgraph.bind_kv_cache(kvgraph.attention_layers(model), caches)
    sizes = tuple(int(s) for s in compile_sizes.split(",") if s)
    config = kvgraph.CompilationConfig(cache_dir=cache_dir, compile_sizes=sizes)
    compiled = kvgraph.compile_model(model, config)
    chunk = kvgraph.RequestChunk(list(range(8)), 0, [0])
    metadata = kvgraph.build_attention_metadata([chunk], 16)
    input_ids, positions = kvgraph.build_model_inputs([chunk])
    start = time.perf_counter()
    with torch.no_grad(), kvgraph.set_forward_context(metadata):
        compiled(input_ids, positions)
    print(json.dumps({"compile_s": time.perf_counter() - start, "builds": counters.builds,
                      "cache_hits": counters.cache_hits, "pieces": counters.pieces,
                      "unique_pieces": counters.unique_pieces}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="compile_time.json", help="where to write the results")
    parser.add_argument("--compile-sizes", default="1,8", help="static builds per piece")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1], args.child[2])
        return

    with tempfile.TemporaryDirectory() as two, tempfile.TemporaryDirectory() as eight:
        runs = {
            "cold, 2 layers": measure(2, two, args.compile_sizes),
            "warm, 2 layers": measure(2, two, args.compile_sizes),
            "cold, 8 layers": measure(8, eight, args.compile_sizes),
        }
    print(f"{'run':<16} {'compile s':>10} {'process s':>10} {'builds':>7} {'hits':>5} {'pieces':>7}")
    for name, r in runs.items():
        print(f"{name:<16} {r['compile_s']:>10.2f} {r['process_s']:>10.2f} {r['builds']:>7} "
              f"{r['cache_hits']:>5} {r['unique_pieces']:>3}/{r['pieces']:<3}")
    cold, warm, deep = (runs[k]["compile_s"] for k in runs)
    ratios = {"warm_over_cold": warm / cold, "8_layers_over_2": deep / cold}
    print(f"warm / cold = {ratios['warm_over_cold']:.2f} (target <= 0.25); "
          f"8 layers / 2 layers = {ratios['8_layers_over_2']:.2f} (target <= 1.3)")
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d")}
    with open(args.json, "w") as f:
        json.dump({"machine": machine, "runs": runs, "ratios": ratios}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
