"""Driving an EngineProcess (the server's engine in a spawned process) in tests.

FLAGS are examples/serve.py's flags for the tiny Llama in piecewise graphs of eager pieces, its
engine in a process of its own; GREEDY is a short greedy request; `tokens_of` collects one
request's tokens from an EngineProcess.
"""

from __future__ import annotations

from examples.engine import SamplingParams
from examples.engine.engine_process import EngineProcess

FLAGS = ["--preset", "tiny", "--graph-mode", "piecewise", "--piece-compiler", "eager",
         "--max-num-tokens", "32", "--capture-sizes", "1,2,4,8", "--max-num-seqs", "4",
         "--max-model-len", "64", "--engine-loop", "process"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


async def tokens_of(engine: EngineProcess, request_id: str, prompt: list[int],
                    params: SamplingParams = GREEDY) -> list[int]:
    return [t async for output in engine.generate(request_id, prompt, params)
            for t in output.token_ids]
