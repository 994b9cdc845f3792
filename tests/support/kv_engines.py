"""Engines with the shared-storage KV connector, for the connector tests (issue 45).

`make_kv_engine(kind, mode, store)` builds the tiny example model (seeded: every engine of a
kind has the same weights) on a captured runner with eager pieces, with the shared-storage
connector on when `store` is a directory (or the connector `transfer` configures). Run as `python -m tests.support.kv_engines KIND STORE`, it fills `store`
from another process: what a restart or a second server on the host finds.
"""

from __future__ import annotations

import sys

import torch

import kvgraph
from examples.engine import LLMEngine, SamplingParams
from examples.engine.tokenizer import ByteTokenizer
from kvgraph.kv_transfer import KVConnectorRole, KVTransferConfig, create_kv_connector
from tests.support.scenario import make_model

BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# Two prompts with a common prefix of 24 tokens (6 blocks), 38 and 43 tokens long.
PREFIX = [(11 * j + 5) % 256 for j in range(24)]
PROMPTS = [PREFIX + [(3 * j + 1) % 256 for j in range(14)],
           PREFIX + [(5 * j + 2) % 256 for j in range(19)]]


def storage_config(store: str, **extra) -> KVTransferConfig:
    return KVTransferConfig("SharedStorageConnector", "kv_both",
                            {"shared_storage_path": str(store), **extra})


def make_kv_engine(kind: str, mode: str = "eager", store=None, num_blocks: int = 96,
                   transfer: KVTransferConfig | None = None, model_key: str | None = None,
                   **extra) -> LLMEngine:
    torch.manual_seed(0)
    config = kvgraph.CompilationConfig(graph_mode=mode, piece_compiler="eager",
                                       max_num_tokens=32, capture_sizes=[1, 2, 4, 8, 16, 32])
    if store is not None:
        transfer = storage_config(store, **extra)

    def connector(role):
        return transfer and create_kv_connector(transfer, role, BLOCK_SIZE,
                                                model_key=model_key or f"{kind}-tiny-seed0")
    runner = kvgraph.ModelRunner(make_model(kind), config, num_blocks=num_blocks,
                                 block_size=BLOCK_SIZE, max_num_seqs=4, max_model_len=96,
                                 kv_connector=connector(KVConnectorRole.WORKER))
    runner.capture()
    return LLMEngine(runner, ByteTokenizer(), kv_connector=connector(KVConnectorRole.SCHEDULER))


def generate(engine: LLMEngine, prompts=PROMPTS) -> list[tuple[int, ...]]:
    """Each prompt alone, in turn (so the second finds the first's prefix in the store)."""
    return [engine.generate([prompt], GREEDY)[0].token_ids for prompt in prompts]


if __name__ == "__main__":
    engine = make_kv_engine(sys.argv[1], "eager", sys.argv[2])
    print(generate(engine))
    engine.runner.close()
