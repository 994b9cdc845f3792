"""Sampler: the next token of every request in a batch, from its logits, in one set of ops.

Penalties, greedy, temperature, top-k and top-p are applied to the whole batch at once on the logits'
device. Only the random numbers are drawn per request, from the request's own generator when
it has a seed, so a seeded request samples the same tokens whatever batch it is in.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .penalties import apply_penalties
from .request import Request


class Sampler:
    """Picks one token per logits row; unseeded requests share the sampler's generator."""

    def __init__(self, device: torch.device | str, seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def new_generator(self, seed: int) -> torch.Generator:
        """A request's own random stream."""
        return torch.Generator(self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """`logits` `[len(requests), vocab]` -> one token id per request."""
        logits = apply_penalties(logits.float(), requests)
        greedy = logits.argmax(dim=-1)
        if all(r.params.greedy for r in requests):
            return greedy.tolist()
        sampled = self._sample(logits, requests)
        is_greedy = torch.tensor([r.params.greedy for r in requests], device=logits.device)
        return torch.where(is_greedy, greedy, sampled).tolist()

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, device=logits.device).unsqueeze(1)

        vocab = logits.shape[1]
        params = [r.params for r in requests]
        # Greedy rows are sampled too (at temperature 1) and then ignored: no per-row branches.
        temperature = column([1.0 if p.greedy else p.temperature for p in params])
        top_k = column([p.top_k or vocab for p in params])
        top_p = column([p.top_p for p in params])
        sorted_logits, order = (logits / temperature).sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        outside = ranks >= top_k
        probs = sorted_logits.masked_fill(outside, -torch.inf).softmax(dim=-1)
        # Top-p keeps the smallest prefix whose mass reaches top_p (the first token always).
        outside |= (probs.cumsum(dim=-1) - probs) > top_p
        probs = sorted_logits.masked_fill(outside, -torch.inf).softmax(dim=-1)
        # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race); E per request.
        noise = torch.stack([
            torch.empty(vocab, device=logits.device).exponential_(
                generator=r.generator or self.generator)
            for r in requests
        ])
        choice = (probs / noise).argmax(dim=-1, keepdim=True)
        return order.gather(1, choice).squeeze(1)
