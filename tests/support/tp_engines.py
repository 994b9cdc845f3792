"""A serving engine on two tensor-parallel ranks (this process is rank 0), for tests.

FLAGS are examples/generate.py's (and serve.py's) flags of the TP tests' engine, EAGER those
added for tests of the broadcast alone; `tp_engine(*flags)` is an engine whose runner spans two
ranks, and `threads_kept` puts this process's compute threads back after one.
"""

from __future__ import annotations

import contextlib

import torch

from examples.engine import build_engine
from examples.generate import MODELS, parse_args

# The tiny Llama (4 heads, 2 KV heads) in piecewise graphs of eager pieces, few capture sizes:
# prompts of up to 41 tokens are prefilled in chunks of 16.
FLAGS = ["--model", "llama", "--preset", "tiny", "--graph-mode", "piecewise",
         "--piece-compiler", "eager", "--max-num-tokens", "16", "--capture-sizes", "1,2,4,8,16",
         "--max-num-seqs", "4", "--max-model-len", "96", "--distributed-timeout", "60"]
# For tests of the broadcast alone: no compile (the tokens are the same in every mode).
EAGER = ["--graph-mode", "eager"]


@contextlib.contextmanager
def threads_kept():
    """This process's compute threads put back after (rank 0 takes its share of the cores)."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def tp_engine(*flags: str, models=MODELS):
    """An engine whose runner spans two ranks (this process is rank 0); closed after, and this
    process's threads and torch.distributed state put back."""
    with threads_kept():
        args = parse_args([*FLAGS, "--tensor-parallel-size", "2", *flags])
        engine, _ = build_engine(args, models)
        try:
            yield engine
        finally:
            engine.runner.close()
