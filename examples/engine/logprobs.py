"""Log-probabilities of sampled tokens and their top alternatives, for a whole batch at once.

They are the model's own distribution (log-softmax of the raw logits, before temperature,
top-k or top-p), as vLLM and OpenAI report them; computed on the logits' device in one set of
ops for every request of the step that asked, with one transfer to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# The most alternatives a request may ask for (OpenAI's chat `top_logprobs` bound).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the `k` most likely tokens', best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def batch_logprobs(logits: torch.Tensor, tokens: Sequence[int], ks: Sequence[int | None]
                   ) -> list[TokenLogprobs | None]:
    """Per row of `logits` `[R, vocab]`: its `tokens[r]`'s logprob and top `ks[r]`, or None
    where `ks[r]` is None (the request did not ask)."""
    rows = [r for r, k in enumerate(ks) if k is not None]
    result: list[TokenLogprobs | None] = [None] * len(ks)
    if not rows:
        return result
    device = logits.device
    logprobs = torch.log_softmax(logits[torch.tensor(rows, device=device)].float(), dim=-1)
    chosen = torch.tensor([tokens[r] for r in rows], device=device)
    chosen_logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    top_values, top_ids = logprobs.topk(max(ks[r] for r in rows), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for i, r in enumerate(rows):
        top = tuple(zip(top_ids[i][:ks[r]], top_values[i][:ks[r]]))
        result[r] = TokenLogprobs(tokens[r], chosen_logprobs[i], top)
    return result
