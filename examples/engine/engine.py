"""LLMEngine: requests in, tokens out, one continuous-batching step at a time.

The model runs only through `kvgraph.ModelRunner.execute`; the engine owns everything around
it: the scheduler and its block allocator, sampling, stopping and detokenizing. Its limits are
the runner's (`runner.limits`: blocks, block size, requests and tokens per step, context), so
the two cannot disagree. It is not thread-safe: one thread (the server's engine loop, or the
offline caller) drives it.

A failure while serving one request ends that request alone, with an error; see `step`. An
`EngineDeadError` (a tensor-parallel rank died) is nobody's request: it ends the engine.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Sequence

import torch

import kvgraph
from kvgraph.kv_transfer import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput

from .block_allocator import BlockAllocator, blocks_for
from .detokenizer import Detokenizer
from .draft_model import check_draft_runner
from .errors import RequestError
from .external_kv import ExternalKV, merged
from .step_faults import forward_or_retry
from .first_token_handoff import check_handed_off_tokens, handed_off_tokens
from .logprobs import TokenLogprobs, emitted_logprobs, prompt_logprobs
from .request import Completion, FinishReason, Request, RequestOutput
from .request_checks import check_request
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler
from .speculation import Speculator
from .speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)
# A sampled token, or the error sampling it raised.
Sampled = int | Exception
# Seconds a step with nothing to run waits, while requests wait for their KV blocks to load.
KV_WAIT_S = 0.002


class LLMEngine:
    """Continuous batching over one `ModelRunner` and one tokenizer; `seed` seeds sampling.

    Requests share the cached KV blocks of a common prompt prefix (prefix caching) unless
    `enable_prefix_caching` is False. `kv_connector`: the scheduler side of the KV connector
    whose worker side the runner was built with (see external_kv.py). `speculative_config`:
    decode speculatively (see speculation.py; the runner's CompilationConfig should have its
    `num_speculative_tokens`, so verify steps replay graphs); `draft_runner`: the draft
    model's runner, for the `draft_model` method (same device, vocabulary and block size, at
    least as many blocks: it shares the target's block tables). `close()` closes both runners.
    """

    def __init__(self, runner: kvgraph.ModelRunner, tokenizer: Any, seed: int = 0,
                 enable_prefix_caching: bool = True,
                 kv_connector: KVConnectorBase | None = None,
                 speculative_config: SpeculativeConfig | None = None,
                 draft_runner: kvgraph.ModelRunner | None = None):
        limits = runner.limits
        needed = blocks_for(limits.max_model_len, limits.block_size)
        if limits.num_blocks < needed:
            raise ValueError(
                f"the runner's num_blocks={limits.num_blocks} cannot hold one sequence of "
                f"max_model_len={limits.max_model_len} tokens (needs {needed} blocks of "
                f"{limits.block_size})")
        self.runner = runner
        self.tokenizer = tokenizer
        self.allocator = BlockAllocator(limits.num_blocks, enable_prefix_caching)
        if kv_connector is not None and getattr(runner, "kv_connector", None) is None:
            raise ValueError("a KV connector's scheduler side needs a runner built with its "
                             "worker side (ModelRunner(kv_connector=...))")
        self.external = kv_connector and ExternalKV(kv_connector, self.allocator,
                                                    limits.block_size)
        self.scheduler = Scheduler(self.allocator, limits.block_size, limits.max_num_seqs,
                                   limits.max_num_tokens, self.external)
        self.sampler = Sampler(runner.device, seed)
        if draft_runner is not None:
            check_draft_runner(draft_runner, runner)
        self.speculator = speculative_config and Speculator(
            speculative_config, self.sampler, limits.max_model_len, self.scheduler, draft_runner)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_aborted = 0
        self.num_failed = 0
        self.num_step_retries = 0
        self._kv_report = KVConnectorOutput()  # the KV connector's report of the last step
        self._handed_off: list[RequestOutput] = []  # see first_token_handoff.py

    def close(self) -> None:
        """Close the runner (with tensor parallelism: stop the other ranks) and the draft
        model's."""
        self.runner.close()
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.runner.close()

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Refuse, naming the field, a request that could never run; safe from any thread."""
        check_request(prompt_token_ids, params, self.runner.limits.max_model_len,
                      self.runner.vocab_size)

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None,
                    kv_transfer_params: dict | None = None) -> Request:
        """Queue a request (checked first); it runs from the next step on.

        `kv_transfer_params`: vLLM's disaggregated-prefill parameters, for the KV connector."""
        self.check(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError("request_id", f"request id {request_id!r} is already in flight")
        request = Request(
            request_id, list(prompt_token_ids), params,
            Detokenizer(self.tokenizer, params.stop, prompt_token_ids), time.perf_counter(),
            generator=None if params.seed is None else self.sampler.new_generator(params.seed),
            kv_transfer_params=kv_transfer_params,
        )
        handed_off = handed_off_tokens(kv_transfer_params, params)
        check_handed_off_tokens(handed_off, self.runner.vocab_size)
        self.requests[request_id] = request
        self.scheduler.add(request)
        for token in handed_off:  # a prefill server's: emitted with the next step's outputs
            self.sampler.skip(request)
            self._handed_off.append(self._append(request, token, time.perf_counter()))
            if request.finished:
                break
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
        return bool(self._handed_off) or self.scheduler.has_work

    @property
    def is_full(self) -> bool:
        """Whether it holds as many requests as one step can run (`max_num_seqs`)."""
        return len(self.requests) >= self.scheduler.max_num_seqs

    def step(self) -> list[RequestOutput]:
        """Run one batch through the model; one output per request that got a token or failed.

        Faults stay with their request. A batch whose model step raises runs again one request
        at a time: the requests that fail alone too end with an error, the others go on (when
        every one fails alone, the step itself is broken and they all end, saying so); a
        verify check that fails (VerifyError) ends all of the step's requests at once. An
        error sampling or detokenizing a request ends that request only. Every request that
        ends this way frees its blocks at once. An EngineDeadError from the model step is
        raised: the engine cannot go on.
        """
        schedule = self.scheduler.schedule()
        metadata = self.external.metadata(schedule.chunks) if self.external else None
        handed_off, self._handed_off = self._handed_off, []
        if not schedule.chunks:
            if self.external is not None:  # drive the loads requests wait for, then wait a bit
                self._kv_report = self.runner.kv_connector.transfer(metadata)
                self.scheduler.apply_kv_report(self._kv_report)
                time.sleep(KV_WAIT_S)
            return handed_off
        self._kv_report = KVConnectorOutput()
        ran, outputs, retried = forward_or_retry(schedule.chunks, metadata, self._execute,
                                                 self._fail)
        self.num_step_retries += retried
        outputs = handed_off + outputs
        self.num_steps += 1
        rows, ready = [], []
        for chunk, row in ran:
            if self.external and self.external.rolled_back(chunk.request,
                                                           self._kv_report.invalid_block_ids):
                continue  # its loaded blocks failed: it computes them from the next step
            # Its drafts' entries count once accepted (_sample).
            chunk.request.num_computed_tokens += (chunk.num_tokens
                                                  - len(chunk.request.spec_token_ids))
            # A prefill chunk that stops short of the prompt's end has no next token to sample.
            if chunk.request.num_uncomputed_tokens == 0:
                rows.append(row)
                ready.append(chunk.request)
        if self.external is not None:
            self.scheduler.apply_kv_report(self._kv_report)
        if ready:
            outputs += self._sample(rows, ready)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        return outputs

    def _sample(self, rows: list[torch.Tensor], ready: list[Request]) -> list[RequestOutput]:
        """The outputs of `ready`'s next tokens, from each one's `rows` of logits (one, or with
        drafts one per draft and one more): a request that emits several tokens has an output
        for each, in order, up to the one that finishes it."""
        now = time.perf_counter()
        logits = torch.cat(rows)
        if self.speculator is None:
            emitted = [t if isinstance(t, Exception) else [t]
                       for t in self.sampler.tokens_or_errors(logits, ready)]
        else:
            emitted = self.speculator.verify(logits, ready)
        outputs = []
        logprobs = emitted_logprobs(logits, [len(r) for r in rows], emitted, ready)
        for request, tokens, token_logprobs in zip(ready, emitted, logprobs):
            if isinstance(tokens, Exception):
                outputs.append(self._emit(request, tokens, now, None))
                continue
            for j, token in enumerate(tokens):
                outputs.append(self._emit(request, token, now, token_logprobs[j]))
                if request.finished:
                    break
                if j < len(tokens) - 1:  # an accepted draft: its cache entry is kept
                    request.num_computed_tokens += 1
        return outputs

    def _execute(self, chunks: list[ScheduledChunk], metadata: KVConnectorMetadata | None = None
                 ) -> list[torch.Tensor]:
        """The model step of `chunks`: each one's logits rows (one, or one per draft and one
        more), and the prompt logprobs of the requests that asked, from its hidden states."""
        batch = [c.request.chunk(c.num_tokens) for c in chunks]
        if self.external is None:
            logits = self.runner.execute(batch)
        else:
            try:
                logits = self.runner.execute(batch, metadata)
            except kvgraph.BatchError:  # refused before the connector ran: its loads (which
                self.runner.kv_connector.transfer(metadata)  # requests wait for) run alone
                raise
            finally:  # a failed step's report counts too: it may say loads are done
                self._kv_report = merged(self._kv_report, self.runner.kv_connector.output)
        if any(c.request.params.prompt_logprobs is not None for c in chunks):
            prompt_logprobs(self.runner.hidden_states, self.runner.model.compute_logits,
                            [(c.request, c.request.num_computed_tokens, c.num_tokens)
                             for c in chunks])
        return list(logits.split([chunk.num_logits for chunk in batch]))

    def _emit(self, request: Request, token: Sampled, now: float,
              logprobs: TokenLogprobs | None) -> RequestOutput:
        """The request's output for its sampled token, or its failure."""
        if isinstance(token, Exception):
            return self._fail(request, "sampling failed", token)
        try:
            return self._append(request, token, now, logprobs)
        except Exception as error:  # noqa: BLE001 - a tokenizer's error is this request's
            return self._fail(request, "detokenizing failed", error)

    def _fail(self, request: Request, what: str, error: Exception) -> RequestOutput:
        """End `request` with an error and free its blocks; the others in flight go on."""
        logger.error("request %s: %s", request.request_id, what, exc_info=error)
        request.error = f"{what}: {type(error).__name__}: {error}"
        request.finish_reason = FinishReason.ABORT
        self.requests.pop(request.request_id, None)  # _append may have taken it out already
        self.scheduler.remove(request)
        self.num_failed += 1
        return RequestOutput(request.request_id, (), "", len(request.prompt_token_ids),
                             len(request.output_token_ids), FinishReason.ABORT,
                             error=request.error)

    def _append(self, request: Request, token: int, now: float,
                logprobs: TokenLogprobs | None = None) -> RequestOutput:
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
            itl=None if first else now - request.last_token_time, logprobs=logprobs,
            prompt_logprobs=(tuple(request.prompt_logprobs)
                             if first and request.params.prompt_logprobs is not None else None),
            num_cached_tokens=request.num_cached_tokens or 0,
            kv_transfer_params=request.kv_transfer_result,
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
                       r.detokenizer.text, r.finish_reason, r.error)
            for r in requests
        ]

    def stats(self) -> dict[str, Any]:
        """The scheduler's queue, the cache's use and the runner's dispatch counts."""
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "aborted": self.num_aborted,
            "failed": self.num_failed,
            "step_retries": self.num_step_retries,
            "kv_blocks_total": self.allocator.num_blocks,
            "kv_blocks_free": self.allocator.num_free,
            **self.scheduler.stats(),
            **(self.external.stats() if self.external else {}),
            **(self.speculator.stats() if self.speculator else {}),
            "steps": self.num_steps,
            "runner": self.runner.stats(),
        }
