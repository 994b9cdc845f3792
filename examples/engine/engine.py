"""LLMEngine: requests in, tokens out, one continuous-batching step at a time.

The model runs only through `kvgraph.ModelRunner.execute`; the engine owns everything around
it: the scheduler and its block allocator, sampling, stopping and detokenizing. Its limits are
the runner's (`runner.limits`: blocks, block size, requests and tokens per step, context), so
the two cannot disagree. It is not thread-safe: one thread (the server's engine loop, or the
offline caller) drives it.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import kvgraph

from .block_allocator import BlockAllocator, blocks_for
from .detokenizer import Detokenizer
from .errors import RequestError
from .request import Completion, FinishReason, Request, RequestOutput
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler


class LLMEngine:
    """Continuous batching over one `ModelRunner` and one tokenizer; `seed` seeds sampling."""

    def __init__(self, runner: kvgraph.ModelRunner, tokenizer: Any, seed: int = 0):
        limits = runner.limits
        needed = blocks_for(limits.max_model_len, limits.block_size)
        if limits.num_blocks < needed:
            raise ValueError(
                f"the runner's num_blocks={limits.num_blocks} cannot hold one sequence of "
                f"max_model_len={limits.max_model_len} tokens (needs {needed} blocks of "
                f"{limits.block_size})")
        self.runner = runner
        self.tokenizer = tokenizer
        self.allocator = BlockAllocator(limits.num_blocks)
        self.scheduler = Scheduler(self.allocator, limits.block_size, limits.max_num_seqs,
                                   limits.max_num_tokens)
        self.sampler = Sampler(runner.device, seed)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_aborted = 0

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Refuse, naming the field, a request that could never run; safe from any thread."""
        limit = self.runner.limits.max_model_len
        if not prompt_token_ids:
            raise RequestError("prompt", "the prompt is empty")
        if len(prompt_token_ids) >= limit:
            raise RequestError("prompt", f"the prompt has {len(prompt_token_ids)} tokens; the "
                               f"context (max_model_len) is {limit}, and at least one must be left "
                               "to generate into")
        if len(prompt_token_ids) + params.max_tokens > limit:
            raise RequestError("max_tokens", f"max_tokens={params.max_tokens} with a prompt of "
                               f"{len(prompt_token_ids)} tokens exceeds the context "
                               f"(max_model_len={limit}); at most "
                               f"{limit - len(prompt_token_ids)} can be generated")
        vocab = self.runner.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestError("prompt", f"prompt token ids must lie in [0, {vocab})")

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
        """Queue a request (checked first); it runs from the next step on."""
        self.check(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError("request_id", f"request id {request_id!r} is already in flight")
        request = Request(
            request_id, list(prompt_token_ids), params,
            Detokenizer(self.tokenizer, params.stop), time.perf_counter(),
            generator=None if params.seed is None else self.sampler.new_generator(params.seed),
        )
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Drop a request now and free its blocks; False if it is not in flight."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.finish_reason = FinishReason.ABORT
        self.scheduler.remove(request)
        self.num_aborted += 1
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        """Run one batch through the model; one output per request that got a new token."""
        schedule = self.scheduler.schedule()
        if not schedule.chunks:
            return []
        logits = self.runner.execute([c.request.chunk(c.num_tokens) for c in schedule.chunks])
        self.num_steps += 1
        rows, ready = [], []
        for row, chunk in enumerate(schedule.chunks):
            chunk.request.num_computed_tokens += chunk.num_tokens
            # A prefill chunk that stops short of the prompt's end has no next token to sample.
            if chunk.request.num_uncomputed_tokens == 0:
                rows.append(row)
                ready.append(chunk.request)
        if not ready:
            return []
        tokens = self.sampler(logits[rows], ready)
        now = time.perf_counter()
        return [self._append(request, token, now) for request, token in zip(ready, tokens)]

    def _append(self, request: Request, token: int, now: float) -> RequestOutput:
        first = not request.output_token_ids
        request.output_token_ids.append(token)
        request.finish_reason = self._finish_reason(request, token)
        if request.finished:
            self.requests.pop(request.request_id)
            self.scheduler.remove(request)
        output = RequestOutput(
            request.request_id, (token,), request.detokenizer.take(request.finished),
            len(request.prompt_token_ids), len(request.output_token_ids), request.finish_reason,
            ttft=now - request.arrival_time if first else None,
            itl=None if first else now - request.last_token_time,
        )
        request.last_token_time = now
        return output

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        stop_tokens = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_tokens |= self.tokenizer.eos_token_ids
        if token in stop_tokens:
            return FinishReason.STOP  # the stop token's text is not part of the output
        if request.detokenizer.add(token):
            return FinishReason.STOP
        if len(request.output_token_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """Offline: run every prompt to completion; the completions in prompt order."""
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, all_params)]
        while self.has_unfinished:
            self.step()
        return [
            Completion(r.request_id, tuple(r.prompt_token_ids), tuple(r.output_token_ids),
                       r.detokenizer.text, r.finish_reason)
            for r in requests
        ]

    def stats(self) -> dict[str, Any]:
        """The scheduler's queue, the cache's use and the runner's dispatch counts."""
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "aborted": self.num_aborted,
            "kv_blocks_total": self.allocator.num_blocks,
            "kv_blocks_free": self.allocator.num_free,
            "steps": self.num_steps,
            "runner": self.runner.stats(),
        }
