"""Log-probabilities of sampled tokens and their top alternatives, for a whole batch at once.

They are the model's own distribution (log-softmax of the raw logits, before temperature,
top-k or top-p), as vLLM and OpenAI report them; computed on the logits' device in one set of
ops for every request of the step that asked, with one transfer to the host.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:
    from .request import Request

# The most alternatives a request may ask for (OpenAI's chat `top_logprobs` bound).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the `k` most likely tokens', best first."""

    token_id: int
    logprob: float | None  # None for a prompt's first token: nothing comes before it
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
    top_values, top_ids = logprobs.topk(min(max(ks[r] for r in rows), logprobs.shape[1]), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for i, r in enumerate(rows):
        top = tuple(zip(top_ids[i][:ks[r]], top_values[i][:ks[r]]))
        result[r] = TokenLogprobs(tokens[r], chosen_logprobs[i], top)
    return result


def sampled_logprobs(logits: torch.Tensor, tokens: Sequence[int | Exception],
                     requests: Sequence[Request]) -> list[TokenLogprobs | None]:
    """The logprobs of each request that asked for them (and whose sampling worked: a failed
    one's token is its error)."""
    ks = [None if isinstance(t, Exception) else r.params.logprobs
          for r, t in zip(requests, tokens)]
    return batch_logprobs(logits, [0 if isinstance(t, Exception) else t for t in tokens], ks)


def emitted_logprobs(logits: torch.Tensor, counts: Sequence[int],
                     emitted: Sequence[list[int] | Exception], requests: Sequence[Request]
                     ) -> list[list[TokenLogprobs | None]]:
    """Each request's logprobs of the tokens it emitted (see `sampled_logprobs`): token j from
    row j of its `counts` rows of `logits` (a verify step's: one per draft and one more), in one
    batch; None for each token of a request that did not ask."""
    starts = itertools.accumulate(counts, initial=0)
    flat = [(start + j, request, token)
            for request, tokens, start in zip(requests, emitted, starts)
            if not isinstance(tokens, Exception) and request.params.logprobs is not None
            for j, token in enumerate(tokens)]
    found = iter(sampled_logprobs(logits[[i for i, _, _ in flat]], [t for _, _, t in flat],
                                  [r for _, r, _ in flat]) if flat else ())
    return [[] if isinstance(tokens, Exception) else
            [next(found) if request.params.logprobs is not None else None for _ in tokens]
            for request, tokens in zip(requests, emitted)]


def prompt_logprobs(hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    chunks: Sequence[tuple[Request, int, int]]) -> None:
    """Record, on each request that asked, the logprobs of the prompt tokens its chunk of this
    step predicts. `hidden` is the step's output in token order; each chunk is `(request, its
    first position, its number of tokens)`, in that order. A position is recorded once, so a
    preempted request recomputing its prompt adds nothing."""
    offset = 0
    for request, start, count in chunks:
        k = request.params.prompt_logprobs
        recorded = request.prompt_logprobs
        if k is not None and not recorded:
            recorded.append(TokenLogprobs(request.prompt_token_ids[0], None, ()))
        # Row `start + i` predicts the token at position `start + i + 1`.
        first = max(start + 1, len(recorded))
        last = min(start + count, len(request.prompt_token_ids) - 1)
        if k is not None and first <= last:
            rows = torch.arange(offset + first - 1 - start, offset + last - start,
                                device=hidden.device)
            tokens = request.prompt_token_ids[first:last + 1]
            recorded += batch_logprobs(compute_logits(hidden[rows]), tokens, [k] * len(tokens))
        offset += count
