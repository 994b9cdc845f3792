"""The prefill server's first token, handed to the decode server with the prompt's blocks, so
that the decode server computes no prompt token: when a handoff applies, and its checks.

A prefill server (P) answers a disaggregated request with where the prompt's blocks are and the
token(s) it generated from them (`kv_transfer_params.first_token_ids`, kvgraph's key beside
vLLM's). The decode server (D) emits those tokens as its first, loads every prompt token from P
and starts with a decode step. Without the tokens, D computes the prompt's last token itself for
the logits to sample from, as vLLM's D does. D does that too when the request asks for logprobs:
P sends the tokens, not their logprobs.
"""

from __future__ import annotations

from typing import Sequence

from .errors import RequestError
from .sampling_params import SamplingParams


def handed_off_tokens(kv_transfer_params: dict | None, params: SamplingParams
                      ) -> list[int]:
    """The tokens D continues from instead of computing the prompt's last token; [] for none."""
    transfer = kv_transfer_params or {}
    if not transfer.get("do_remote_prefill"):
        return []
    if params.logprobs is not None or params.prompt_logprobs is not None:
        return []
    return list(transfer.get("first_token_ids") or ())


def check_handed_off_tokens(tokens: Sequence[int], vocab_size: int) -> None:
    """Refuse, naming the key, handed-off tokens that are not this model's token ids."""
    bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < vocab_size]
    if bad:
        raise RequestError("kv_transfer_params", f"kv_transfer_params.first_token_ids must be "
                           f"token ids in [0, {vocab_size}), got {bad[:5]}")
