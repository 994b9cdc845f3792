"""`--speculative-config`: speculative decoding (speculation.py), in vLLM's JSON.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
    --speculative-config '{"method": "draft_model", "model": "llama:small:2",
                           "num_speculative_tokens": 3}'

The runner's `num_speculative_tokens` (kvgraph's flag of that name) follows it, so verify steps
are keyed, padded and captured as uniform batches of 1 + that many tokens per request. A draft
model's `model` is checked here as far as its syntax goes (draft_model_source.py); its name,
preset and layers, or its checkpoint directory, by the start-up checks (preflight.py).
"""

from __future__ import annotations

import argparse

import kvgraph
from kvgraph.errors import ConfigError

from .draft_model_source import check_syntax
from .speculative_config import SpeculativeConfig


def speculative_config(text: str) -> SpeculativeConfig:
    """argparse's type for the flag: the config, or a usage error saying what is wrong."""
    try:
        config = SpeculativeConfig.from_json(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if config.method == "draft_model":
        try:
            check_syntax(config.model)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"model: {error}") from None
    return config


def add_speculative_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--speculative-config", type=speculative_config, metavar="JSON",
                       help="decode speculatively, in vLLM's fields: method (ngram: drafts "
                       "looked up in the prompt and output; draft_model: drafts from a smaller "
                       "model sharing the target's tokenizer, with its own runner, KV caches "
                       "and graphs), num_speculative_tokens, prompt_lookup_min and "
                       "prompt_lookup_max (ngram), model (draft_model: a checkpoint directory, "
                       "or an example model NAME, NAME:PRESET or NAME:PRESET:N, seeded with "
                       "--seed, PRESET default --preset, N: its first N decoder layers; not "
                       "with --tensor-parallel-size > 1)")


def with_speculation(config: kvgraph.CompilationConfig, args: argparse.Namespace
                     ) -> kvgraph.CompilationConfig:
    """`config` with the flag's num_speculative_tokens; a ConfigError when kvgraph's own flag
    says another."""
    spec = getattr(args, "speculative_config", None)
    if spec is None:
        return config
    if config.num_speculative_tokens not in (0, spec.num_speculative_tokens):
        raise ConfigError("num_speculative_tokens", f"num_speculative_tokens: "
                          f"{config.num_speculative_tokens} from kvgraph's flag or environment, "
                          f"{spec.num_speculative_tokens} from --speculative-config")
    return config.replace(num_speculative_tokens=spec.num_speculative_tokens)
