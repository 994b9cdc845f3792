"""Scheduler: which requests run in the next step, and how many tokens each, under a budget.

Continuous batching: every step is rebuilt from the running requests (decodes first, then
unfinished prefills) and then new requests from the queue, until the token budget or the
request limit is reached. A prompt longer than what is left of the budget is prefilled in
chunks over several steps. When the cache has no block for a running request's next chunk,
the most recently admitted request is preempted: its blocks are freed and it goes back to the
front of the queue, to be recomputed from its prompt and the tokens it has generated so far.

Prefix caching (the allocator's): a request admitted shares the cached blocks its tokens start
with, and those tokens count as computed. Each block a request has computed in full is
registered in the cache before the next step is planned, and when the request leaves.

A KV connector (external_kv.py), when there is one, is asked at admission for the tokens after
those: loaded in the step, they count as computed; loaded asynchronously, the request waits,
holding its blocks (and a place among `max_num_seqs`), until the load is reported done.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from kvgraph.kv_transfer import KVConnectorOutput, chain_hashes

from .block_allocator import BlockAllocator, blocks_for
from .external_kv import ExternalKV
from .request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` of `request`'s uncomputed tokens run in this step."""

    request: Request
    num_tokens: int


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    """The request queue and the running set, and the blocks each running request holds."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int,
                 token_budget: int, external: ExternalKV | None = None):
        self.allocator = allocator
        self.external = external
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in order of admission: the last is preempted first
        self.num_preemptions = 0
        self.num_queried_tokens = 0  # tokens of admitted requests looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens found cached: prefill not computed
        self.num_prompt_tokens_computed = 0  # scheduled to run through the model

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or (self.external and self.external.has_work))

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queue or running set; free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.external is not None and self.external.finished(request):
            self._cache_computed(request)
            request.block_ids, request.num_cached_blocks = [], 0  # held by ExternalKV now
            return
        self._release(request)

    def apply_kv_report(self, output: KVConnectorOutput) -> None:
        """The KV connector's report: requests whose loads are done run from the next step."""
        self.running += self.external.update(output)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        for request in self.running:  # what the last step computed, for admissions to share
            self._cache_computed(request)
        budget = self._schedule_running(output, self.token_budget)
        if not output.preempted:  # admitting now would only take blocks back from the running
            self._schedule_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        decodes_first = sorted(self.running, key=lambda r: r.num_uncomputed_tokens > 1)
        scheduled: set[Request] = set()
        for request in decodes_first:
            if budget == 0:
                break
            if request not in self.running:  # preempted for an earlier request in this loop
                continue
            # A decode's drafts (speculation.py) run with it, as many as the budget leaves room for.
            num_tokens = min(request.num_uncomputed_tokens + len(request.spec_token_ids), budget)
            del request.spec_token_ids[max(0, num_tokens - request.num_uncomputed_tokens):]
            while not self._grow(request, num_tokens):
                victim = self._victim(scheduled) or request
                self._preempt(victim, output)
                if victim is request:
                    break
            else:
                self._add_chunk(output, request, num_tokens)
                scheduled.add(request)
                budget -= num_tokens
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        parked = len(self.external.loading) if self.external else 0
        while self.waiting and budget > 0 and len(self.running) + parked < self.max_num_seqs:
            request = self.waiting[0]
            num_cached_tokens = self._share_cached(request)
            external, load_async = self._external_tokens(request)
            # The first chunk's blocks come with a synchronous load's: they run in one step.
            num_tokens = 0 if load_async else min(request.num_uncomputed_tokens - external,
                                                  budget)
            if not self._grow(request, external + num_tokens):
                # It waits for blocks, holding none; the queue keeps its order.
                self._release(request)
                request.num_computed_tokens = 0
                break
            self.num_queried_tokens += request.num_tokens
            self.num_hit_tokens += num_cached_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached_tokens + external
            self.waiting.popleft()
            if external:
                self.external.allocated(request, external)
            if load_async:
                self.external.park(request, external)
                parked += 1
                continue
            request.num_computed_tokens += external
            self.running.append(request)
            self._add_chunk(output, request, num_tokens)
            budget -= num_tokens

    def _add_chunk(self, output: SchedulerOutput, request: Request, num_tokens: int) -> None:
        start = request.num_computed_tokens
        self.num_prompt_tokens_computed += max(
            0, min(start + num_tokens, len(request.prompt_token_ids)) - start)
        output.chunks.append(ScheduledChunk(request, num_tokens))

    def _external_tokens(self, request: Request) -> tuple[int, bool]:
        """The KV connector's tokens for `request` after its cached ones, and whether it loads
        them asynchronously; none when prompt logprobs need every position computed."""
        if self.external is None or request.params.prompt_logprobs is not None:
            return 0, False
        return self.external.matched(request)

    def _share_cached(self, request: Request) -> int:
        """Hold the cached blocks `request`'s tokens start with, as computed; their tokens' count.

        The last token is always left to compute: its logits are what the step samples from.
        """
        tokens = request.prompt_token_ids + request.output_token_ids
        # Prompt logprobs are scored from each prompt position's hidden state: all computed.
        scores_prompt = request.params.prompt_logprobs is not None
        shareable = 0 if scores_prompt else (len(tokens) - 1) // self.block_size
        request.block_hashes = chain_hashes(tokens[:-1], self.block_size, request.block_hashes)
        request.block_ids = self.allocator.share(request.block_hashes[:shareable])
        request.num_cached_blocks = len(request.block_ids)
        request.num_computed_tokens = len(request.block_ids) * self.block_size
        return request.num_computed_tokens

    def _cache_computed(self, request: Request) -> None:
        """Register the blocks `request` has computed in full since it last did."""
        full = request.num_computed_tokens // self.block_size
        if full == request.num_cached_blocks:
            return
        tokens = request.prompt_token_ids + request.output_token_ids
        computed = tokens[:full * self.block_size]
        request.block_hashes = chain_hashes(computed, self.block_size, request.block_hashes)
        for i in range(request.num_cached_blocks, full):
            self.allocator.register(request.block_ids[i], request.block_hashes[i])
        request.num_cached_blocks = full

    def stats(self) -> dict[str, int]:
        """Prefix cache use, in tokens of admitted requests, the prompt tokens scheduled to be
        computed (preempted ones again), and the allocator's cache stats."""
        return {"prefix_cache_queried_tokens": self.num_queried_tokens,
                "prefix_cache_hit_tokens": self.num_hit_tokens,
                "prompt_tokens_computed": self.num_prompt_tokens_computed,
                **self.allocator.stats()}

    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Give `request` the blocks its next `num_tokens` tokens need now, preempting nobody
        (a draft model writes their slots before the step that computes them); False, and
        nothing taken, if too few are free."""
        return self._grow(request, num_tokens)

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Give `request` the blocks its next `num_tokens` tokens need; False if too few free."""
        needed = blocks_for(request.num_computed_tokens + num_tokens, self.block_size)
        blocks = self.allocator.allocate(max(0, needed - len(request.block_ids)))
        if blocks is None:
            return False
        request.block_ids.extend(blocks)
        return True

    def _victim(self, scheduled: set[Request]) -> Request | None:
        """The latest admitted running request not already in this step's batch."""
        candidates = [r for r in self.running if r not in scheduled]
        return candidates[-1] if candidates else None

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens, request.spec_token_ids = 0, []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        output.preempted.append(request)

    def _release(self, request: Request) -> None:
        self._cache_computed(request)  # what it computed stays for the requests after it
        self.allocator.free(request.block_ids)
        request.block_ids = []
        request.num_cached_blocks = 0
