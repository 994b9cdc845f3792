"""DraftModelProposer: drafts from a smaller model that shares the target's tokenizer, run by a
`kvgraph.ModelRunner` of its own: its own KV caches, compiled pieces and captured graphs, and
so its own output buffers (the target's are never read or written by it).

Its caches have as many blocks as the target's and are indexed by the same block tables: the
draft's entry of a token sits in the same slot as the target's. After each step, for the
decoding requests that may have drafts, it runs

1. a catch-up step: each request's tokens the draft has not yet run, up to its last one (one or
   two in steady decoding: the target's token after the accepted drafts, and the last accepted
   draft when all were; a request's whole prompt the first time), whose logits give draft 1;
2. then k - 1 decode steps of one token per request: draft j at its position gives draft j + 1.

A request's draft entries stay valid for its tokens the draft ran and the target kept: those of
accepted drafts are, the rest are written over (found by comparing the drafts proposed with the
tokens the request has now). Blocks another request holds too (a shared prompt prefix) are read,
never written: a step writing a block another chunk reads is refused (kvgraph's BatchError), and
their entries were written by the draft of the request that computed them. Where they were not
(that request never drafted, or a KV connector loaded them), the draft reads stale entries and
proposes worse drafts: drafts only change how many tokens a step emits, never which ones.

Greedy requests get the draft's argmax. Sampled ones draw from the draft's distribution q (the
request's temperature, top-k and top-p applied to the draft's logits), from the request's own
generator when it is seeded, and q goes to the rejection sampler, which keeps the target's
distribution whatever q is. A draft row that is not finite ends that request's drafts there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

import kvgraph

from .block_allocator import BlockAllocator
from .rejection_sampler import RejectionSampler
from .request import Request
from .sampler import _inverse_cdf

logger = logging.getLogger(__name__)


@dataclass
class _Proposal:
    """What the draft ran of one request at its last proposal: tokens before `start` are real,
    the drafts after them were run in order (all but the last, which nothing followed)."""

    num_preemptions: int
    start: int
    drafts: list[int]


@dataclass
class Drafts:
    """A batch's drafts: each request's token ids, and, when any request samples, q: each
    request's `[len(its drafts), vocab]` draft distribution (None for greedy requests)."""

    token_ids: list[list[int]]
    probs: list[torch.Tensor | None]


class DraftModelProposer:
    """Proposes drafts with `runner`'s model for requests whose blocks `allocator` hands out.

    `rejection`: the engine's rejection sampler, whose sampler draws the drafts of sampled
    requests and whose target-probability method gives q (the same filters as p).
    """

    def __init__(self, runner: kvgraph.ModelRunner, rejection: RejectionSampler,
                 allocator: BlockAllocator):
        self.runner = runner
        self.rejection = rejection
        self.allocator = allocator
        self._proposals: dict[Request, _Proposal] = {}
        self.num_steps = 0  # draft model steps run
        self.num_failures = 0  # proposals lost to a draft step's error

    def propose(self, requests: Sequence[Request], rooms: Sequence[int]) -> Drafts:
        """Up to `rooms[i]` drafts for `requests[i]` (each a decoding request whose blocks hold
        its last token and `rooms[i]` more). A draft step that raises costs the batch its
        drafts (logged), never a request."""
        live = set(requests)
        self._proposals = {r: p for r, p in self._proposals.items() if r in live}
        batch = [(r, room) for r, room in zip(requests, rooms) if room > 0]
        drafts = Drafts([[] for _ in requests], [None] * len(requests))
        if not batch:
            return drafts
        try:
            proposed = self._propose(batch)
        except Exception:  # noqa: BLE001 - drafts are an optimisation: decode without them
            logger.exception("the draft model's step failed; this step's requests decode "
                             "without drafts")
            self.num_failures += 1
            for request, _ in batch:  # their draft entries may be half written
                self._proposals.pop(request, None)
            return drafts
        index = {r: i for i, r in enumerate(requests)}
        for request, (ids, probs) in proposed.items():
            drafts.token_ids[index[request]] = ids
            drafts.probs[index[request]] = probs
            self._proposals[request] = _Proposal(request.num_preemptions, request.num_tokens,
                                                 list(ids))
        return drafts

    def _propose(self, batch: list[tuple[Request, int]]
                 ) -> dict[Request, tuple[list[int], torch.Tensor | None]]:
        """Each request's drafts and their q (None for a greedy request)."""
        firsts = self._catch_up([request for request, _ in batch])
        ids: dict[Request, list[int]] = {}
        probs: dict[Request, list[torch.Tensor]] = {}
        live = self._take(firsts, [r for r, _ in batch], ids, probs)
        rooms = dict(batch)
        for j in range(1, max(rooms.values())):
            live = [r for r in live if rooms[r] > j]
            if not live:
                break
            chunks = [kvgraph.RequestChunk([ids[r][-1]], r.num_tokens + j - 1, list(r.block_ids))
                      for r in live]
            live = self._take(self._execute(chunks), live, ids, probs)
        return {r: (ids[r], torch.stack(probs[r]) if probs[r][0] is not None else None)
                for r in ids}

    def _catch_up(self, requests: list[Request]) -> torch.Tensor:
        """Run each request's tokens the draft has not run, in steps within the draft runner's
        limits; the logits after each request's last token, in request order."""
        pending = {r: self._first_unrun(r) for r in requests}
        rows: dict[Request, torch.Tensor] = {}
        limits = self.runner.limits
        while pending:
            budget, chunks, owners = limits.max_num_tokens, [], []
            for request, start in list(pending.items()):
                if budget == 0 or len(chunks) == limits.max_num_seqs:
                    break
                end = min(request.num_tokens, start + budget)
                chunks.append(kvgraph.RequestChunk(request.all_token_ids[start:end], start,
                                                   list(request.block_ids)))
                owners.append((request, end))
                budget -= end - start
            logits = self._execute(chunks)
            for row, (request, end) in enumerate(owners):
                if end == request.num_tokens:
                    rows[request] = logits[row]
                    del pending[request]
                else:
                    pending[request] = end
        return torch.stack([rows[r] for r in requests])

    def _first_unrun(self, request: Request) -> int:
        """The first position whose draft entry must be (re)written: after the tokens whose
        entries are right and after the blocks other requests hold, at most the last token's
        (its logits give draft 1)."""
        valid = 0
        proposal = self._proposals.get(request)
        if proposal is not None and proposal.num_preemptions == request.num_preemptions:
            tokens = request.all_token_ids
            valid = proposal.start
            for draft in proposal.drafts[:-1]:  # the last draft was proposed, never run
                if valid >= len(tokens) or tokens[valid] != draft:
                    break
                valid += 1
        # Shared blocks are a prefix of the table (the prefix cache's): only those from the
        # first one to write on are looked at, one in steady decoding.
        block_size, blocks = self.runner.limits.block_size, request.block_ids
        index = valid // block_size
        while index < len(blocks) and self.allocator.is_shared(blocks[index]):
            index += 1
        return min(max(valid, index * block_size), request.num_tokens - 1)

    def _execute(self, chunks: list[kvgraph.RequestChunk]) -> torch.Tensor:
        self.num_steps += 1
        return self.runner.execute(chunks)

    def _take(self, logits: torch.Tensor, requests: list[Request],
              ids: dict[Request, list[int]], probs: dict[Request, list[torch.Tensor | None]]
              ) -> list[Request]:
        """Append each request's next draft from its row of `logits`; the requests that got
        one (a row that is not finite ends its request's drafts)."""
        raw = logits.float()
        scaled = self.rejection.sampler._scaled(raw, requests)
        finite = scaled.amax(dim=-1).isfinite().tolist()
        sampled = [i for i, r in enumerate(requests) if finite[i] and not r.params.greedy]
        tokens = scaled.argmax(dim=-1)
        q: torch.Tensor | None = None
        if sampled:
            chosen = [requests[i] for i in sampled]
            q = torch.zeros_like(scaled)
            q[sampled] = self.rejection._target_probs(scaled[sampled], chosen)
            tokens[sampled] = _inverse_cdf(q[sampled], self._draws(chosen)[:, None])
        live = []
        for i, (request, token) in enumerate(zip(requests, tokens.tolist())):
            if not finite[i]:
                continue
            ids.setdefault(request, []).append(token)
            probs.setdefault(request, []).append(None if request.params.greedy else q[i])
            live.append(request)
        return live

    def _draws(self, requests: list[Request]) -> torch.Tensor:
        """One uniform number per request: a seeded one's from its own generator."""
        sampler = self.rejection.sampler
        draws = torch.empty(len(requests), dtype=torch.float64, device=sampler.device)
        shared = [i for i, r in enumerate(requests) if r.generator is None]
        if shared:
            draws[shared] = torch.rand(len(shared), dtype=torch.float64,
                                       device=sampler.device, generator=sampler.generator)
        for i, request in enumerate(requests):
            if request.generator is not None:
                draws[i] = torch.rand(1, dtype=torch.float64, device=sampler.device,
                                      generator=request.generator)
        return draws


def check_draft_runner(draft: kvgraph.ModelRunner, target: kvgraph.ModelRunner) -> None:
    """A ValueError naming what differs, unless `draft` can propose for `target`: the same
    device and vocabulary, and caches the target's block tables index (the same block size,
    at least as many blocks) with room for its longest sequence and its batches."""
    checks = [("device", draft.device, target.device),
              ("vocab_size", draft.vocab_size, target.vocab_size),
              ("block_size", draft.limits.block_size, target.limits.block_size)]
    for name, got, expected in checks:
        if got != expected:
            raise ValueError(f"the draft model's runner has {name}={got}, the target's "
                             f"{expected}: a draft model shares the target's tokenizer and "
                             "block tables, so they must be equal")
    for name in ("num_blocks", "max_model_len", "max_num_seqs"):
        got, expected = getattr(draft.limits, name), getattr(target.limits, name)
        if got < expected:
            raise ValueError(f"the draft model's runner has {name}={got}, below the target's "
                             f"{expected}: it runs the target's requests in the target's blocks")
    if draft is target or draft.model is target.model:
        raise ValueError("the draft model's runner is the target's: give the draft model a "
                         "runner (and a model object) of its own")
