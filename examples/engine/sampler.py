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

A row no token can be sampled from (NaN, +inf, or -inf everywhere, whether the model, the
request's penalties or its temperature made it so) is that request's SamplingError, and the
other rows are sampled as if it were not in the batch; no id outside the vocabulary comes out.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .penalties import apply_penalties
from .request import Request


class SamplingError(RuntimeError):
    """Why no token could be sampled for one request: it fails that request alone."""


class Sampler:
    """Picks one token per logits row; unseeded requests share the sampler's generator."""

    def __init__(self, device: torch.device | str, seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def new_generator(self, seed: int) -> torch.Generator:
        """A request's own random stream."""
        return torch.Generator(self.device).manual_seed(seed)

    def tokens_or_errors(self, logits: torch.Tensor, requests: Sequence[Request]
                         ) -> list[int | Exception]:
        """One token per request, all at once; if that raises, each alone, so that an error
        is only its own request's."""
        try:
            return self(logits, requests)
        except Exception:  # noqa: BLE001 - whose fault it is, is found below
            sampled: list[int | Exception] = []
            for row, request in zip(logits, requests):
                try:
                    sampled += self(row[None], [request])
                except Exception as error:  # noqa: BLE001 - this request's fault
                    sampled.append(error)
            return sampled

    def skip(self, request: Request) -> None:
        """Take the draw sampling one of `request`'s tokens takes, for a token sampled elsewhere
        (a prefill server's): a seeded request's later tokens are then the ones one server
        would sample."""
        if request.generator is not None and not request.params.greedy:
            torch.rand(1, dtype=torch.float64, device=self.device, generator=request.generator)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]
                 ) -> list[int | SamplingError]:
        """`logits` `[len(requests), vocab]` -> one token id per request, in `[0, vocab)`.

        A request whose row no token can be sampled from (NaN, +inf, or -inf everywhere: from
        the model, its penalties or its temperature) gets a SamplingError instead, and the
        other rows are sampled as if it were not in the batch.
        """
        raw = logits.float()
        penalised = apply_penalties(raw, requests)
        scaled = self._scaled(penalised, requests)
        # A row's maximum is finite exactly when it has no NaN, no +inf, and a finite entry
        # (amax: a small fraction of argmax's cost on a CPU, which returns indices too).
        finite = scaled.amax(dim=-1).isfinite().tolist()
        if all(finite):
            return _in_vocabulary(self._pick(scaled, requests), scaled.shape[1])
        return _in_vocabulary(self._pick_finite((raw, penalised, scaled), requests, finite),
                              scaled.shape[1])

    def _pick_finite(self, stages: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     requests: Sequence[Request], finite: list[bool]
                     ) -> list[int | SamplingError]:
        """The finite rows' tokens, picked as if the other rows were not in the batch (no draw
        of the shared generator is theirs), and each other row's error. `stages`: the logits
        as the model gave them, after the penalties, after the temperatures."""
        raw, penalised, scaled = stages
        rows = [i for i, ok in enumerate(finite) if ok]
        picked = iter(self._pick(scaled[rows], [requests[i] for i in rows]) if rows else [])
        return [next(picked) if ok else _not_finite(
                    [("from the model", raw[i]), ("after its penalties", penalised[i]),
                     ("after its temperature", scaled[i])])
                for i, ok in enumerate(finite)]

    def _scaled(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Each sampled row divided by its temperature (at most float32's largest number);
        greedy rows as they are."""
        if all(r.params.greedy for r in requests):
            return logits
        temperatures = self._column([1.0 if r.params.greedy else r.params.temperature
                                     for r in requests], logits)
        # One past float32's range would be inf, and a masked (-inf) logit / inf is NaN.
        return logits / temperatures.clamp(max=torch.finfo(logits.dtype).max)

    def _pick(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """One token id per row of finite, scaled `logits`: the greedy rows' argmax, the
        others drawn."""
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
        """One token per row of `logits` (rows that are not greedy, already divided by their
        temperature), drawn from its filtered distribution."""
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


def _not_finite(stages: Sequence[tuple[str, torch.Tensor]]) -> SamplingError:
    """The error of a row that is not finite once scaled, naming the first stage that made it
    so; `stages` are (stage, the row after it), in order."""
    where, row = next((w, r) for w, r in stages if not bool(r.max().isfinite()))
    return SamplingError(f"the logits of this request's row are not finite ({_what(row)}) "
                         f"{where}")


def _what(row: torch.Tensor) -> str:
    if bool(row.isnan().any()):
        return "NaN"
    return "+inf" if bool((row == torch.inf).any()) else "-inf everywhere"


def _in_vocabulary(tokens: list[int | SamplingError], vocab: int) -> list[int | SamplingError]:
    """`tokens`, with an error for any id outside `[0, vocab)`: a sampler bug fails its request
    alone, and never reaches the model as a token."""
    return [t if isinstance(t, SamplingError) or 0 <= t < vocab else SamplingError(
        f"the sampler picked token id {t}, outside the vocabulary [0, {vocab})") for t in tokens]


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
