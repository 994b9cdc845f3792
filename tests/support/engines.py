"""The serving engine tests' engine: the tiny model's LLMEngine on a fresh runner, and its inputs.

`make_engine(model)` builds an LLMEngine over a captured kvgraph.ModelRunner of `model()` (a
callable, so that each engine gets a model of its own), with eager pieces and a small token
budget; PROMPTS (lengths 3..41) and GREEDY are what the engine tests run through it.
"""

from __future__ import annotations

import kvgraph
from examples.engine import LLMEngine, SamplingParams
from examples.engine.tokenizer import ByteTokenizer

BLOCK_SIZE = 4
MAX_MODEL_LEN = 96
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Prompt lengths 3..41: some fit in one step's budget, some are chunked.
PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(3 + 9 * i % 39)] for i in range(7)]


def make_engine(model, mode="eager", num_blocks=None, max_num_seqs=4, budget=32,
                tokenizer=None) -> LLMEngine:
    num_blocks = num_blocks or max_num_seqs * MAX_MODEL_LEN // BLOCK_SIZE
    config = kvgraph.CompilationConfig(graph_mode=mode, piece_compiler="eager",
                                       max_num_tokens=budget,
                                       capture_sizes=[s for s in (1, 2, 4, 8, 16) if s <= budget])
    runner = kvgraph.ModelRunner(model(), config, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                 max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN)
    runner.capture()
    return LLMEngine(runner, tokenizer or ByteTokenizer())
