"""The speculative-decoding tests' engine: the tiny model's LLMEngine, with n-gram or draft-model
speculation or without, and the prompts and settings they run
(tests/examples/engine/test_speculation*.py, test_draft_model.py).

The draft model by default is the target's first layer (`CausalLM.first_layers`): it agrees with
the target often enough that steps both accept and reject drafts.
"""

from __future__ import annotations

import kvgraph
from examples.engine import LLMEngine, SamplingParams
from examples.engine.speculative_config import SpeculativeConfig
from examples.engine.tokenizer import ByteTokenizer
from kvgraph.kv_transfer import KVConnectorRole, KVTransferConfig, create_kv_connector
from tests.support.engines import BLOCK_SIZE, MAX_MODEL_LEN
from examples.models import MODELS
from tests.support.scenario import make_model

K = 3
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=K, prompt_lookup_min=1,
                          prompt_lookup_max=3)
DRAFT = SpeculativeConfig(method="draft_model", model="first-layer", num_speculative_tokens=K)
PROPOSERS = {"ngram": NGRAM, "draft_model": DRAFT}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# Prompts that repeat themselves, so lookups find drafts (the model rejects some of them).
PROMPTS = [[5, 6, 7, 8] * 5, [40, 41, 42] * 6 + [40], list(range(100, 117)),
           [9, 9, 9, 10, 11, 9, 9, 9, 10]]
MODEL_SEED = 1


def build(spec: SpeculativeConfig | None = None, *, kind: str = "llama", mode: str = "eager",
          num_blocks: int | None = None, budget: int = 32, max_num_seqs: int = 4,
          store=None, tokenizer=None, draft=None, device: str = "cpu") -> LLMEngine:
    """The tiny model's engine (seeded weights: every engine of a kind is the same model), with
    `spec`, and with the shared-storage KV connector over `store` when one is given. A
    draft_model `spec` drafts with `draft` (default: the target's first layer), in a runner of
    the target's settings."""
    k = spec.num_speculative_tokens if spec else 0
    config = kvgraph.CompilationConfig(graph_mode=mode, piece_compiler="eager",
                                       max_num_tokens=budget, num_speculative_tokens=k,
                                       capture_sizes=[s for s in (1, 2, 4, 8, 16, 32)
                                                      if s <= budget])
    num_blocks = num_blocks or max_num_seqs * MAX_MODEL_LEN // BLOCK_SIZE
    transfer = store and KVTransferConfig("SharedStorageConnector", "kv_both",
                                          {"shared_storage_path": str(store)})

    def connector(role):
        return transfer and create_kv_connector(transfer, role, BLOCK_SIZE,
                                                model_key=f"{kind}-tiny-seed{MODEL_SEED}")
    runner = kvgraph.ModelRunner(make_model(kind, seed=MODEL_SEED).to(device), config,
                                 num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                 max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
                                 device=device, kv_connector=connector(KVConnectorRole.WORKER))
    runner.capture()
    draft_runner = None
    if spec is not None and spec.method == "draft_model":
        draft = draft or first_layers(kind, 1)
        draft_runner = kvgraph.ModelRunner(draft.to(device),
                                           config.replace(num_speculative_tokens=0),
                                           num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                           max_num_seqs=max_num_seqs,
                                           max_model_len=MAX_MODEL_LEN, device=device)
        draft_runner.capture()
    return LLMEngine(runner, tokenizer or ByteTokenizer(), speculative_config=spec,
                     kv_connector=connector(KVConnectorRole.SCHEDULER),
                     draft_runner=draft_runner)


def first_layers(kind: str, num_layers: int):
    """The tiny target's first `num_layers` layers, as a draft model."""
    cls = MODELS[kind]
    return cls.first_layers(cls.presets["tiny"], num_layers, seed=MODEL_SEED)


def tokens(completions) -> list[tuple[int, ...]]:
    return [c.token_ids for c in completions]
