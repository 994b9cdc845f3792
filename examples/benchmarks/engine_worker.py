"""One engine, kvgraph's or vLLM's, behind a pipe: the worker process, and `Worker`, its client.

    python engine_worker.py kvgraph|vllm SETTINGS_JSON

kvgraph's python runs it for kvgraph (`-m examples.benchmarks.engine_worker`), the vLLM
environment's python for vLLM (as a file: kvgraph is not installed there), so only the
standard library is imported at the top and each engine's packages inside its own builder.
SETTINGS_JSON: {"model", "dtype", "threads", "max_model_len", "max_num_seqs"} plus, for kvgraph,
"kvgraph_args" (its engine flags) and, for vLLM, "gpu_memory_utilization".

Once built, the worker writes {"ready": {facts}} and then answers one JSON line per command line:
{"prompts": [[ids], ...], "max_tokens": N} -> {"seconds": s, "tokens": [[ids], ...]}: all
prompts in one greedy `generate`, end-of-sequence ignored (each makes exactly N tokens),
timed around the call. Whatever the engines print goes to stderr: stdout carries answers only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

WORKER = Path(__file__)
# kvgraph's worker and server run as `-m examples...`: from the repository's root.
REPO = WORKER.resolve().parents[2]

# prompts, max_tokens -> the tokens each made
Generate = Callable[[list[list[int]], int], list[list[int]]]


def build_kvgraph(settings: dict[str, Any]) -> tuple[Generate, dict[str, Any]]:
    """kvgraph's LLMEngine, built as the example server builds it, with the flags given."""
    import argparse

    import torch

    from examples.engine import SamplingParams, add_engine_args, build_engine
    from examples.models import MODELS

    parser = add_engine_args(argparse.ArgumentParser())
    args = parser.parse_args([
        "--model", settings["model"], "--dtype", settings["dtype"],
        "--threads", str(settings["threads"]),
        "--max-model-len", str(settings["max_model_len"]),
        "--max-num-seqs", str(settings["max_num_seqs"]),
        "--no-enable-prefix-caching", *settings["kvgraph_args"]])
    engine, summary = build_engine(args, MODELS)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return [list(c.token_ids) for c in engine.generate(prompts, params)]

    limits = engine.runner.limits
    return generate, {"graph_mode": summary["graph_mode"], "threads": torch.get_num_threads(),
                      "max_num_tokens": limits.max_num_tokens, "block_size": limits.block_size,
                      "attn_backend": engine.runner.attn_backend, "torch": torch.__version__}


def build_vllm(settings: dict[str, Any]) -> tuple[Generate, dict[str, Any]]:
    """vLLM's offline `LLM`; its threads are bound by VLLM_CPU_OMP_THREADS_BIND (the caller's)."""
    import torch
    import vllm
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(model=settings["model"], dtype=settings["dtype"],
                   max_model_len=settings["max_model_len"],
                   max_num_seqs=settings["max_num_seqs"], enable_prefix_caching=False,
                   gpu_memory_utilization=settings["gpu_memory_utilization"], seed=0)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    scheduler = llm.llm_engine.vllm_config.scheduler_config
    return generate, {"threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                      "max_num_tokens": scheduler.max_num_batched_tokens,
                      "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
                      "vllm": vllm.__version__, "torch": torch.__version__,
                      "ld_preload": os.environ.get("LD_PRELOAD", "")}


BUILDERS = {"kvgraph": build_kvgraph, "vllm": build_vllm}


class Worker:
    """An engine_worker.py process: send prompts, get seconds and tokens back."""

    def __init__(self, engine: str, command: list[str], settings: dict[str, Any],
                 env: dict[str, str]):
        self.engine = engine
        self.process = subprocess.Popen([*command, engine, json.dumps(settings)], env=env,
                                        cwd=REPO, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.facts = self._answer()["ready"]

    def _answer(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.engine} worker exited ({self.process.wait()}); "
                               "its log is above")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens})
                                 + "\n")
        self.process.stdin.flush()
        answer = self._answer()
        return answer["seconds"], answer["tokens"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in BUILDERS:
        raise SystemExit(f"usage: engine_worker.py {'|'.join(BUILDERS)} SETTINGS_JSON")
    # Answers go to the real stdout; everything else written to fd 1 (engine logs, the
    # processes vLLM starts) lands on stderr instead of corrupting the answers.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    generate, facts = BUILDERS[argv[0]](json.loads(argv[1]))
    answers.write(json.dumps({"ready": facts}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        start = time.perf_counter()
        tokens = generate(command["prompts"], command["max_tokens"])
        seconds = time.perf_counter() - start
        answers.write(json.dumps({"seconds": seconds, "tokens": tokens}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
