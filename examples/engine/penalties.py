"""Presence, frequency and repetition penalties on a batch's logits, as vLLM defines them.

Presence and frequency count the request's output tokens: `logit - presence * (count > 0) -
frequency * count`. Repetition covers prompt and output tokens: a positive logit is divided by
it, a negative one multiplied. They change what is sampled (greedy included), not the logprobs
reported, which are the model's own. One set of ops for the batch; rows without penalties are
left as they are.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .request import Request


def has_penalties(request: Request) -> bool:
    params = request.params
    return bool(params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """`logits` `[R, vocab]` (float32) with each request's penalties applied."""
    if not any(has_penalties(r) for r in requests):
        return logits
    device, vocab = logits.device, logits.shape[1]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, device=device, dtype=logits.dtype).unsqueeze(1)

    output_counts = _counts([r.output_token_ids for r in requests], vocab, device)
    seen = output_counts > 0
    seen |= _counts([r.prompt_token_ids for r in requests], vocab, device) > 0
    repetition = column([r.params.repetition_penalty for r in requests])
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition),
                         logits)
    logits = logits - column([r.params.frequency_penalty for r in requests]) * output_counts
    return logits - column([r.params.presence_penalty for r in requests]) * (output_counts > 0)


def _counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each list: `[len(token_lists), vocab]`."""
    rows = torch.tensor([i for i, tokens in enumerate(token_lists) for _ in tokens],
                        device=device, dtype=torch.long)
    ids = torch.tensor([t for tokens in token_lists for t in tokens], device=device,
                       dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab, device=device)
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)
    return counts
