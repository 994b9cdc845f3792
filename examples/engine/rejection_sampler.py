"""RejectionSampler: the tokens a verify step emits from draft tokens, keeping the target's
distribution (speculative decoding's rejection sampling, Leviathan et al. 2023, Chen et al. 2023).

A request with k draft tokens has k + 1 rows of target logits: row j follows its tokens and
drafts 0..j-1. It emits its accepted draft prefix plus one token: at the first rejected
position j the recovered token, drawn from norm(max(0, p_j - q_j)), or, when all k were
accepted, the bonus token drawn from p_k. p is what the engine's Sampler samples from: the
logits after the request's temperature, top-k and top-p (its own methods compute it here). q is
the draft model's distribution; draft j is accepted with probability min(1, p(d) / q(d)).
Greedy requests accept while the draft is the argmax and then emit the argmax: exactly the
tokens decoding without speculation gives.

Drafts without a q (n-gram lookup: deterministic, so q is one-hot at the draft) are verified by
the coupling that rule allows: each row's token is picked as the Sampler picks it, with the
row's own draw, and a draft is accepted while it equals its row's pick; the request emits the
picks up to the first that differs from its draft (accepted with probability p(d), and a
rejected row's pick follows p without d: the rule above, exactly). A seeded request's generator
is then left as if it had drawn once per emitted token, so its tokens are those sampling
without drafts gives, whatever drafts it had or its batch trimmed (where taking n numbers in
one call equals n calls of one, as on the CPU; a CUDA generator's calls advance in steps, so
there they are reproducible but depend on the drafts).

Draws: k + 1 uniform numbers per sampled request, one per row (with a q: k to accept and the
last row's for the last token); a seeded request's from its own generator. With no drafts this
is the Sampler, draw for draw.

Penalties: the engine does not speculate for a request with repetition, presence or frequency
penalties (row j's penalties would count drafts 0..j-1 as output); such a request may only come
with no drafts, sampled as the Sampler samples it, and drafts for it are a ValueError.
A request with a row no token can be sampled from (NaN, +inf, -inf everywhere; any of its
k + 1, whichever draft it follows: the model is at fault) gets its SamplingError, and the
others are verified as if it were not in the batch (no draw of the shared generator is its).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch

from .penalties import apply_penalties, has_penalties
from .request import Request
from .sampler import Sampler, SamplingError, _filters, _in_vocabulary, _inverse_cdf, _not_finite

Emitted = list[int]


class RejectionSampler:
    """Verifies a batch's draft tokens against its target logits; unseeded requests draw from
    the Sampler's shared generator."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def emitted_or_errors(self, logits: torch.Tensor, requests: Sequence[Request],
                          draft_token_ids: Sequence[Sequence[int]],
                          draft_probs: torch.Tensor | None = None
                          ) -> list[Emitted | Exception]:
        """As calling it, but if the batch raises, each request alone, so that an error (a
        penalised request's drafts included) is only its own request's."""
        try:
            return self(logits, requests, draft_token_ids, draft_probs)
        except Exception:  # noqa: BLE001 - whose fault it is, is found below
            out: list[Emitted | Exception] = []
            rows, drafts = _starts([len(d) + 1 for d in draft_token_ids]), _starts(
                [len(d) for d in draft_token_ids])
            for i, (request, ids) in enumerate(zip(requests, draft_token_ids)):
                q = None if draft_probs is None else draft_probs[drafts[i]:drafts[i] + len(ids)]
                try:
                    out += self(logits[rows[i]:rows[i] + len(ids) + 1], [request], [ids], q)
                except Exception as error:  # noqa: BLE001 - this request's fault
                    out.append(error)
            return out

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 draft_token_ids: Sequence[Sequence[int]],
                 draft_probs: torch.Tensor | None = None) -> list[Emitted | SamplingError]:
        """Per request, the tokens it emits (1 to k + 1 of them), or its SamplingError.

        `logits` `[sum(k + 1), vocab]`: each request's k + 1 verify rows, in request order.
        `draft_token_ids`: each request's k >= 0 drafts. `draft_probs` `[sum(k), vocab]`: the
        draft model's distribution at each draft, in the same order; None: one-hot drafts.
        """
        counts = [len(d) for d in draft_token_ids]
        _check(logits, requests, draft_token_ids, draft_probs)
        row_requests = [r for r, k in zip(requests, counts) for _ in range(k + 1)]
        raw = logits.float()
        penalised = apply_penalties(raw, row_requests)  # no drafts where there are penalties
        scaled = self.sampler._scaled(penalised, row_requests)
        finite = scaled.amax(dim=-1).isfinite().tolist()
        if all(finite):
            return self._verify(scaled, requests, draft_token_ids, draft_probs)
        starts, draft_starts = _starts([k + 1 for k in counts]), _starts(counts)
        bad = [next((s + j for j in range(k + 1) if not finite[s + j]), None)
               for s, k in zip(starts, counts)]
        ok = [i for i, row in enumerate(bad) if row is None]
        rows = _index([starts[i] + j for i in ok for j in range(counts[i] + 1)], scaled)
        q = None if draft_probs is None else draft_probs[
            _index([draft_starts[i] + j for i in ok for j in range(counts[i])], draft_probs)]
        verified = iter(self._verify(scaled[rows], [requests[i] for i in ok],
                                     [draft_token_ids[i] for i in ok], q) if ok else [])
        return [next(verified) if row is None else _not_finite(
                    [("from the model", raw[row]), ("after its penalties", penalised[row]),
                     ("after its temperature", scaled[row])]) for row in bad]

    def _verify(self, scaled: torch.Tensor, requests: Sequence[Request],
                drafts: Sequence[Sequence[int]], q: torch.Tensor | None
                ) -> list[Emitted | SamplingError]:
        """What each request emits, from its finite, scaled rows."""
        device = scaled.device
        counts = [len(d) for d in drafts]
        starts = _starts([k + 1 for k in counts])
        # Index lists, one entry per draft (Python loops over requests and drafts, never over
        # the vocabulary): the request it is of, its place there, its row.
        owner = [i for i, k in enumerate(counts) for _ in range(k)]
        column = [j for k in counts for j in range(k)]
        draft_rows = _index([starts[i] + j for i, j in zip(owner, column)], scaled)
        ids = _index([t for d in drafts for t in d], scaled)
        greedy = [r.params.greedy for r in requests]
        kept = self._seeded_states(requests) if q is None else {}
        draws = self._uniforms(requests, counts).to(device)
        if q is None:  # one-hot drafts: each row's own pick decides (the module docstring)
            picks = self._picks(scaled, requests, counts, draws)
            accepted = picks[draft_rows] == ids
        else:
            picks = scaled.argmax(dim=-1)
            accepted = picks[draft_rows] == ids  # the greedy rule; sampled drafts overwrite it
            self._accept_from_q(scaled, requests, owner, greedy, draft_rows, ids, q, draws,
                                accepted)
        # Accepted so far, per request: a padded [requests, k_max + 1] table whose column k is
        # always False, so the cumulative product stops at a request's last draft.
        table = torch.zeros(len(requests), max(counts, default=0) + 1, dtype=torch.long,
                            device=device)
        table[_index(owner, scaled), _index(column, scaled)] = accepted.long()
        num_accepted = table.cumprod(dim=1).sum(dim=1)
        final_rows = _index(starts, scaled) + num_accepted
        last = picks[final_rows]
        if q is not None and not all(greedy):
            last = self._last_from_q(scaled, requests, greedy, counts, starts, num_accepted,
                                     ids, q, draws, last)
        accepted_counts = num_accepted.tolist()
        for i, state in kept.items():  # one draw per emitted token, as without drafts
            requests[i].generator.set_state(state)
            torch.rand(accepted_counts[i] + 1, dtype=torch.float64, device=self.sampler.device,
                       generator=requests[i].generator)
        tails = _in_vocabulary(last.tolist(), scaled.shape[1])
        return [t if isinstance(t, SamplingError) else list(d[:n]) + [t]
                for d, n, t in zip(drafts, accepted_counts, tails)]

    def _picks(self, scaled: torch.Tensor, requests: Sequence[Request], counts: list[int],
               draws: torch.Tensor) -> torch.Tensor:
        """Each row's token as the Sampler picks it with the row's draw: the argmax for a
        greedy request's rows."""
        picks = scaled.argmax(dim=-1)
        rows = [s + j for s, k, r in zip(_starts([k + 1 for k in counts]), counts, requests)
                if not r.params.greedy for j in range(k + 1)]
        if rows:
            owners = [r for r, k in zip(requests, counts) if not r.params.greedy
                      for _ in range(k + 1)]
            index = _index(rows, scaled)
            picks[index] = self._last(scaled[index], owners,
                                      torch.zeros_like(scaled[index]), draws[index])
        return picks

    def _accept_from_q(self, scaled, requests, owner, greedy, draft_rows, ids, q, draws,
                       accepted) -> None:
        """A sampled request's draft d, drawn from the draft model's q: accepted with
        probability min(1, p(d) / q(d)) (into `accepted`)."""
        drawn = [not greedy[i] for i in owner]
        if not any(drawn):
            return
        mask = torch.tensor(drawn, device=scaled.device)
        rows = draft_rows[mask]
        drawn_ids = ids[mask].unsqueeze(1)
        p = self._target_probs(scaled[rows], [requests[i] for i, d in zip(owner, drawn) if d])
        p_d = p.gather(1, drawn_ids).squeeze(1).double()
        q_d = q[mask].gather(1, drawn_ids).squeeze(1).double()
        accepted[mask] = draws[rows] * q_d < p_d

    def _last_from_q(self, scaled, requests, greedy, counts, starts, num_accepted, ids, q,
                     draws, last) -> torch.Tensor:
        """`last`, with each sampled request's last token drawn from norm(max(0, p - q)) at a
        rejected draft's row (q of that draft removed), or from p after all were accepted."""
        device, vocab = scaled.device, scaled.shape[1]
        mask = torch.tensor([not g for g in greedy], device=device)
        k = _index(counts, scaled)
        rejected = num_accepted < k
        draft_index = _index(_starts(counts), scaled) + num_accepted
        removed = torch.zeros(len(requests), vocab, device=device)
        which = (rejected & mask).nonzero().squeeze(1)
        if len(which):
            removed[which] = q[draft_index[which]].to(removed.dtype)
        final_rows = _index(starts, scaled) + num_accepted
        last_draws = draws[_index(starts, scaled) + k]
        last[mask] = self._last(scaled[final_rows[mask]],
                                [r for r, g in zip(requests, greedy) if not g],
                                removed[mask], last_draws[mask])
        return last

    @staticmethod
    def _seeded_states(requests: Sequence[Request]) -> dict[int, torch.Tensor]:
        """The generator state of each seeded, sampled request, before this step draws."""
        return {i: r.generator.get_state() for i, r in enumerate(requests)
                if not r.params.greedy and r.generator is not None}

    def _target_probs(self, scaled: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """p over the whole vocabulary, per row (its request's, temperature applied): the
        Sampler's softmax, or its top-k and top-p probabilities put back in vocabulary order."""
        vocab = scaled.shape[1]
        filtered = [_filters(r, vocab) for r in requests]
        if not any(filtered):
            return scaled.softmax(dim=-1)
        p = torch.zeros_like(scaled)
        rows = torch.tensor(filtered, device=scaled.device)
        if not all(filtered):
            p[~rows] = scaled[~rows].softmax(dim=-1)
        probs, order = self.sampler._top_k_top_p(
            scaled[rows], [r for r, f in zip(requests, filtered) if f])
        p[rows] = torch.zeros_like(scaled[rows]).scatter_(1, order, probs)
        return p

    def _last(self, scaled: torch.Tensor, requests: Sequence[Request], removed: torch.Tensor,
              draws: torch.Tensor) -> torch.Tensor:
        """Each sampled request's last token: from norm(max(0, p - removed)) at its final row
        (removed: the rejected draft's q, or 0 for the bonus token), found as the Sampler finds
        a token (vocabulary order, or its candidates' order with a top-k or top-p)."""
        vocab = scaled.shape[1]
        filtered = [_filters(r, vocab) for r in requests]
        tokens = torch.empty(len(requests), dtype=torch.long, device=scaled.device)
        rows = torch.tensor(filtered, device=scaled.device)
        draws = draws[:, None]
        if not all(filtered):
            p = scaled[~rows].softmax(dim=-1)
            tokens[~rows] = _inverse_cdf(_residual(p, removed[~rows]), draws[~rows])
        if any(filtered):
            probs, order = self.sampler._top_k_top_p(
                scaled[rows], [r for r, f in zip(requests, filtered) if f])
            residual = _residual(probs, removed[rows].gather(1, order))
            tokens[rows] = order.gather(1, _inverse_cdf(residual, draws[rows])[:, None]).squeeze(1)
        return tokens

    def _uniforms(self, requests: Sequence[Request], counts: list[int]) -> torch.Tensor:
        """`[sum(k + 1)]` float64 numbers in [0, 1), aligned with the rows: row j's accepts
        draft j, the last row's draws the last token. Greedy requests' are 0 (nothing drawn);
        a seeded request's come from its own generator, the others' from the sampler's, drawn
        in one call (as the Sampler draws, so no drafts means the Sampler's very numbers)."""
        device = self.sampler.device
        starts = _starts([k + 1 for k in counts])
        draws = torch.zeros(sum(counts) + len(counts), dtype=torch.float64, device=device)
        shared = [s + j for s, k, r in zip(starts, counts, requests)
                  if not r.params.greedy and r.generator is None for j in range(k + 1)]
        if shared:
            draws[shared] = torch.rand(len(shared), dtype=torch.float64, device=device,
                                       generator=self.sampler.generator)
        for s, k, r in zip(starts, counts, requests):
            if not r.params.greedy and r.generator is not None:
                draws[s:s + k + 1] = torch.rand(k + 1, dtype=torch.float64, device=device,
                                                generator=r.generator)
        return draws


def _residual(p: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """max(0, p - removed) per row (unnormalised: the inverse CDF scales by its total), or p
    where nothing is left: p <= q everywhere means p == q, a rejection only rounding makes."""
    residual = (p - removed).clamp(min=0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p, residual)


def _index(positions: list[int], like: torch.Tensor) -> torch.Tensor:
    """`positions` as an index tensor on `like`'s device (an int64 one even when empty)."""
    return torch.tensor(positions, dtype=torch.long, device=like.device)


def _starts(sizes: list[int]) -> list[int]:
    """Where each of consecutive blocks of `sizes` begins."""
    return [0, *accumulate(sizes)][:len(sizes)]


def _check(logits: torch.Tensor, requests: Sequence[Request],
           drafts: Sequence[Sequence[int]], draft_probs: torch.Tensor | None) -> None:
    """The shapes agree, drafts are token ids, and no penalised request has drafts: the engine's
    bugs, raised before anything is drawn."""
    if len(drafts) != len(requests):
        raise ValueError(f"{len(drafts)} draft lists for {len(requests)} requests")
    rows, vocab = sum(len(d) + 1 for d in drafts), logits.shape[-1]
    if logits.dim() != 2 or logits.shape[0] != rows:
        raise ValueError(f"logits {tuple(logits.shape)}: expected ({rows}, vocab), k + 1 rows "
                         "per request")
    if draft_probs is not None and tuple(draft_probs.shape) != (rows - len(requests), vocab):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)}: expected "
                         f"({rows - len(requests)}, {vocab}), one row per draft")
    for request, ids in zip(requests, drafts):
        if ids and has_penalties(request):
            raise ValueError(f"request {request.request_id} has penalties: the engine does not "
                             "speculate for it, and drafts for it cannot be verified")
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"request {request.request_id}: a draft token outside the "
                             f"vocabulary [0, {vocab}): {list(ids)}")
