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

Drafts come from the n-gram proposer (prompt lookup). None are proposed for a request whose
penalties the rejection sampler cannot apply to drafts, or where no room is left: at most as
many as keep the request within its `max_tokens` and the model's `max_model_len`.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .ngram_proposer import NgramProposer
from .penalties import has_penalties
from .rejection_sampler import Emitted, RejectionSampler
from .request import Request
from .sampler import Sampler
from .speculative_config import SpeculativeConfig


class Speculator:
    """Proposes drafts and verifies them for one engine (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, sampler: Sampler, max_model_len: int):
        if config.method != "ngram":
            raise ValueError(f"speculative method {config.method!r} is not built yet: the "
                             "example engine speculates with method 'ngram'")
        self.config = config
        self.proposer = NgramProposer(config)
        self.rejection = RejectionSampler(sampler)
        self.max_model_len = max_model_len
        self.num_drafts = 0  # verify chunks: requests that ran with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def propose(self, requests: Iterable[Request]) -> None:
        """Set each decoding request's drafts for its next step (none where it may not have)."""
        for request in requests:
            room = self._room(request)
            request.spec_token_ids = (
                self.proposer.propose(request.all_token_ids, room) if room > 0 else [])

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
        emitted = self.rejection.emitted_or_errors(logits, requests, drafts)
        for request, ids, tokens in zip(requests, drafts, emitted):
            request.spec_token_ids = []
            if ids:
                self.num_drafts += 1
                self.num_draft_tokens += len(ids)
                if not isinstance(tokens, Exception):
                    self.num_accepted_tokens += len(tokens) - 1
        return emitted

    def stats(self) -> dict[str, float]:
        """Counts of drafts, draft tokens and accepted ones, and the mean accepted length (the
        tokens a verify chunk emitted: accepted drafts plus the target's own)."""
        mean = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return {"spec_decode_drafts": self.num_drafts,
                "spec_decode_draft_tokens": self.num_draft_tokens,
                "spec_decode_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_mean_accepted_length": mean}
