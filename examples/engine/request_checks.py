"""check_request: refuse, naming the field, a request that could never run."""

from __future__ import annotations

from typing import Sequence

from .errors import RequestError
from .sampling_params import SamplingParams


def check_request(prompt_token_ids: Sequence[int], params: SamplingParams, max_model_len: int,
                  vocab_size: int | None) -> None:
    """Raise RequestError if the prompt is empty, leaves no room in the context for
    `params.max_tokens`, or holds a token id outside the vocabulary."""
    if not prompt_token_ids:
        raise RequestError("prompt", "the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise RequestError("prompt", f"the prompt has {len(prompt_token_ids)} tokens; the "
                           f"context (max_model_len) is {max_model_len}, and at least one must "
                           "be left to generate into")
    if len(prompt_token_ids) + params.max_tokens > max_model_len:
        raise RequestError("max_tokens", f"max_tokens={params.max_tokens} with a prompt of "
                           f"{len(prompt_token_ids)} tokens exceeds the context "
                           f"(max_model_len={max_model_len}); at most "
                           f"{max_model_len - len(prompt_token_ids)} can be generated")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise RequestError("prompt", f"prompt token ids must lie in [0, {vocab_size})")
