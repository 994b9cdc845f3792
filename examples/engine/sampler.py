"""Sampler: the next token of every request in a batch, from its logits, in one set of ops.

Penalties, greedy, temperature, top-k and top-p are applied to the whole batch at once on the
logits' device. Greedy rows take the argmax and draw nothing. The other rows are sampled by
inverse transform: one uniform number per row, from the request's own generator when it has a
seed (so a seeded request samples the same tokens whatever batch it is in), found in the
row's cumulative distribution: in vocabulary order, or, for a row with a top-k or top-p, in
the order of its candidates, most likely first. One number per row, not one per vocabulary
entry, and only the filtered rows' candidates ordered (a partial sort where it can be): on a
CPU, drawing a vocabulary's worth of noise and sorting every row took about a third of a
batch-16 decode step of the small Llama.
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
        greedy = [r.params.greedy for r in requests]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        if not any(greedy):  # no row to pick out: a copy of a large vocabulary's logits saved
            return self._sample(logits, requests).tolist()
        tokens = logits.argmax(dim=-1)
        sampled = torch.tensor([not g for g in greedy], device=logits.device)
        tokens[sampled] = self._sample(logits[sampled],
                                       [r for r, g in zip(requests, greedy) if not g])
        return tokens.tolist()

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """One token per row of `logits` (rows that are not greedy), drawn from its filtered
        distribution at its temperature."""
        logits = logits / self._column([r.params.temperature for r in requests], logits)
        draws = self._uniforms(requests)
        vocab = logits.shape[1]
        filtered = [_filters(r, vocab) for r in requests]
        if not any(filtered):
            return _inverse_cdf(logits.softmax(dim=-1), draws)
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        rows = torch.tensor(filtered, device=logits.device)
        if not all(filtered):
            tokens[~rows] = _inverse_cdf(logits[~rows].softmax(dim=-1), draws[~rows])
        probs, order = self._top_k_top_p(logits[rows], [r for r, f in zip(requests, filtered) if f])
        tokens[rows] = order.gather(1, _inverse_cdf(probs, draws[rows])[:, None]).squeeze(1)
        return tokens

    def _top_k_top_p(self, logits: torch.Tensor, requests: Sequence[Request]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's candidate tokens, most likely first (`order`, ids), and their
        probabilities after its top-k, then its top-p (0 for the tokens those remove)."""
        vocab = logits.shape[1]
        top_k = self._column([r.params.top_k if 0 < r.params.top_k < vocab else vocab
                              for r in requests], logits)
        top_p = self._column([r.params.top_p for r in requests], logits)
        # Only the candidates need ordering (topk's partial sort is far cheaper than a sort on a
        # CPU): a row's top-k, or, without one, the tokens top-p might keep (_nucleus_bound).
        only_top_p = top_k == vocab
        candidates = top_k
        if bool(only_top_p.any()):
            candidates = torch.where(only_top_p, _nucleus_bound(logits, top_p), top_k)
        largest = int(candidates.max())
        if largest < vocab // 2:
            values, order = logits.topk(largest, dim=-1)
        else:
            values, order = logits.sort(dim=-1, descending=True)
            values, order = values[:, :largest], order[:, :largest]
        ranks = torch.arange(largest, device=logits.device).unsqueeze(0)
        values = values.masked_fill(ranks >= top_k, -torch.inf)
        if bool((top_p < 1).any()):
            # Over the row's top-k, or over the whole row where it has none (the candidates
            # leave out tokens too unlikely to matter to the sum, not to the total).
            log_total = torch.where(only_top_p, logits.logsumexp(dim=-1, keepdim=True),
                                    values.logsumexp(dim=-1, keepdim=True))
            probs = (values - log_total).exp()
            # Top-p keeps the smallest prefix whose mass reaches top_p (the first token always).
            values = values.masked_fill((probs.cumsum(dim=-1) - probs) > top_p, -torch.inf)
        return values.softmax(dim=-1), order

    def _uniforms(self, requests: Sequence[Request]) -> torch.Tensor:
        """`[len(requests), 1]` float64 numbers in [0, 1): a seeded request's from its own
        generator, the others' from the sampler's, drawn in one call."""
        draws = torch.empty(len(requests), 1, dtype=torch.float64, device=self.device)
        shared = [i for i, r in enumerate(requests) if r.generator is None]
        if shared:
            draws[shared] = torch.rand(len(shared), 1, dtype=torch.float64, device=self.device,
                                       generator=self.generator)
        for i, request in enumerate(requests):
            if request.generator is not None:
                draws[i] = torch.rand(1, dtype=torch.float64, device=self.device,
                                      generator=request.generator)
        return draws

    @staticmethod
    def _column(values: list[float] | list[int], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, device=like.device).unsqueeze(1)


def _inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` `[rows, n]`, the index its uniform draw `[rows, 1]` falls on."""
    # float64: the cumulative sum of a large vocabulary's probabilities keeps its small ones.
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    # Below the total, the first entry above the draw always has a probability above 0.
    draw = torch.minimum(draws * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, draw, right=True).squeeze(1)


def _nucleus_bound(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`[rows, 1]`: how many of each row's tokens top-p might keep; the others it removes.

    A token whose probability is below `(1 - top_p) / (2 * vocab)` is removed: the tokens that
    unlikely together hold less than half of `1 - top_p`, so more than `top_p` comes before
    each of them, with a margin that rounding cannot cross.
    """
    floor = (1 - top_p) / (2 * logits.shape[1])
    return (logits.softmax(dim=-1) >= floor).sum(dim=-1, keepdim=True)


def _filters(request: Request, vocab: int) -> bool:
    """Whether the request has a top-k or a top-p that can remove tokens."""
    params = request.params
    return 0 < params.top_k < vocab or params.top_p < 1
