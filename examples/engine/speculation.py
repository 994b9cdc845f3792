"""Speculator: the engine's speculative decoding: drafts proposed for each decoding request after
a step, checked by the target model in the next.

A decoding request with k drafts runs its last sampled token and the k drafts as one chunk of
1 + k tokens, asking for logits at all of them (a verify step; the runner keys a batch in which
every request has `num_speculative_tokens` drafts as a uniform batch of that query length, so
it replays captured graphs). The rejection sampler (rejection_sampler.py) decides from those
logits how many drafts are accepted and draws one more token: greedy requests get exactly the
tokens decoding without drafts gives, sampled ones the target's distribution. The accepted
drafts' cache entries are kept; a rejected draft's slots are written over by the tokens that
follow it.

Drafts come from the n-gram proposer (prompt lookup) or a draft model (draft_model.py: a runner
of its own, which writes its cache entries of the drafts before the target's step, so the
blocks they need are reserved first). None are proposed for a request whose penalties the
rejection sampler cannot apply to drafts, or where no room is left: at most as many as keep the
request within its `max_tokens` and the model's `max_model_len`, and, with a draft model, none
where no free block is left for them.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

import kvgraph

from .draft_model import DraftModelProposer
from .ngram_proposer import NgramProposer
from .penalties import has_penalties
from .rejection_sampler import Emitted, RejectionSampler
from .request import Request
from .sampler import Sampler
from .scheduler import Scheduler
from .speculative_config import SpeculativeConfig


class Speculator:
    """Proposes drafts and verifies them for one engine (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, sampler: Sampler, max_model_len: int,
                 scheduler: Scheduler, draft_runner: kvgraph.ModelRunner | None = None):
        if (config.method == "draft_model") != (draft_runner is not None):
            raise ValueError(f"speculative method {config.method!r} "
                             + ("needs the draft model's runner" if draft_runner is None else
                                "takes no draft model's runner"))
        self.config = config
        self.rejection = RejectionSampler(sampler)
        self.ngram = NgramProposer(config) if config.method == "ngram" else None
        self.draft = draft_runner and DraftModelProposer(draft_runner, self.rejection,
                                                         scheduler.allocator)
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self._draft_probs: dict[Request, torch.Tensor] = {}  # q of the draft model's drafts
        self.num_drafts = 0  # verify chunks: requests that ran with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def propose(self, requests: Iterable[Request]) -> None:
        """Set each decoding request's drafts for its next step (none where it may not have)."""
        requests = list(requests)
        rooms = [self._room(request) for request in requests]
        if self.ngram is not None:
            for request, room in zip(requests, rooms):
                request.spec_token_ids = (
                    self.ngram.propose(request.all_token_ids, room) if room > 0 else [])
            return
        # The draft writes its entries of the last token and the drafts before the target
        # computes them: their slots are taken now.
        rooms = [room if room > 0 and self.scheduler.reserve(request, 1 + room) else 0
                 for request, room in zip(requests, rooms)]
        drafts = self.draft.propose(requests, rooms)
        self._draft_probs = {}
        for request, ids, probs in zip(requests, drafts.token_ids, drafts.probs):
            request.spec_token_ids = ids
            if probs is not None:
                self._draft_probs[request] = probs

    def _room(self, request: Request) -> int:
        if request.num_uncomputed_tokens != 1 or request.finished or has_penalties(request):
            return 0  # a prefill's chunk, or drafts the rejection sampler would refuse
        return min(self.config.num_speculative_tokens,
                   request.params.max_tokens - len(request.output_token_ids) - 1,
                   self.max_model_len - request.num_tokens)

    def verify(self, logits: torch.Tensor, requests: Sequence[Request]
               ) -> list[Emitted | Exception]:
        """The tokens each request emits from its rows of `logits` (1 + its drafts each), or
        its error; the drafts are taken off the requests and counted."""
        drafts = [request.spec_token_ids for request in requests]
        emitted = self.rejection.emitted_or_errors(logits, requests, drafts,
                                                   self._q(requests, drafts, logits))
        for request, ids, tokens in zip(requests, drafts, emitted):
            request.spec_token_ids = []
            if ids:
                self.num_drafts += 1
                self.num_draft_tokens += len(ids)
                if not isinstance(tokens, Exception):
                    self.num_accepted_tokens += len(tokens) - 1
        return emitted

    def _q(self, requests: Sequence[Request], drafts: Sequence[Sequence[int]],
           logits: torch.Tensor) -> torch.Tensor | None:
        """The draft model's q at each draft still there (the scheduler may have cut some), one
        row per draft in request order; zeros for a greedy request's (it draws nothing). None
        when no request has a q: drafts are one-hot."""
        if not any(request in self._draft_probs for request in requests):
            return None
        rows = [self._draft_probs[r][:len(ids)] if r in self._draft_probs
                else torch.zeros(len(ids), logits.shape[-1], device=logits.device)
                for r, ids in zip(requests, drafts)]
        return torch.cat(rows).to(logits.device)

    def stats(self) -> dict[str, float]:
        """Counts of drafts, draft tokens and accepted ones, and the mean accepted length (the
        tokens a verify chunk emitted: accepted drafts plus the target's own)."""
        mean = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        stats = {"spec_decode_drafts": self.num_drafts,
                 "spec_decode_draft_tokens": self.num_draft_tokens,
                 "spec_decode_accepted_tokens": self.num_accepted_tokens,
                 "spec_decode_mean_accepted_length": mean}
        if self.draft is not None:
            stats |= {"spec_decode_draft_model_steps": self.draft.num_steps,
                      "spec_decode_draft_model_failures": self.draft.num_failures,
                      "draft_runner": self.draft.runner.stats()}
        return stats
