"""One process of the compile-cache tests: compile the tiny Llama into a cache dir, report JSON."""

import json
import sys

import torch

import kvgraph
from kvgraph.compilation.counters import compile_counters
from tests.support.scenario import bind_fresh_caches, make_model, run_schedule


def main(cache_dir: str) -> None:
    model = make_model("llama")
    bind_fresh_caches(model)
    config = kvgraph.CompilationConfig(compile_sizes=(4,), cache_dir=cache_dir)
    logits = run_schedule(kvgraph.compile_model(model, config), model)
    print(json.dumps({
        "counters": compile_counters.snapshot(),
        "logits": torch.cat(logits).flatten()[:64].tolist(),
    }))


if __name__ == "__main__":
    main(sys.argv[1])
