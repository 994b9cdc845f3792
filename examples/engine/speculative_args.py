"""`--speculative-config`: speculative decoding (speculation.py), in vLLM's JSON.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 4}'

The runner's `num_speculative_tokens` (kvgraph's flag of that name) follows it, so verify steps
are keyed, padded and captured as uniform batches of 1 + that many tokens per request.
"""

from __future__ import annotations

import argparse

import kvgraph
from kvgraph.errors import ConfigError

from .speculative_config import SpeculativeConfig


def speculative_config(text: str) -> SpeculativeConfig:
    """argparse's type for the flag: the config, or a usage error saying what is wrong."""
    try:
        config = SpeculativeConfig.from_json(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if config.method != "ngram":
        raise argparse.ArgumentTypeError(
            f"method: the example engine speculates with 'ngram' (prompt lookup); "
            f"{config.method!r} (a draft model's runner) is not built yet")
    return config


def add_speculative_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--speculative-config", type=speculative_config, metavar="JSON",
                       help="decode speculatively, in vLLM's fields: method (ngram: drafts "
                       "looked up in the prompt and output), num_speculative_tokens, "
                       "prompt_lookup_min, prompt_lookup_max")


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
