"""Request: one generation in flight (tokens, cache blocks, timings) and the outputs it yields."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

import kvgraph

from .detokenizer import Detokenizer
from .logprobs import TokenLogprobs
from .sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request stopped: OpenAI's `finish_reason` values, plus an abort."""

    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # a stop string, a stop token or end-of-sequence
    ABORT = "abort"  # the client went away, or the engine failed (then the output has `error`)


@dataclass(eq=False)  # compared by identity: two requests are never the same request
class Request:
    """A prompt being generated, owned by the engine thread.

    `num_computed_tokens` of `all_token_ids` are in the KV cache, in `block_ids`. A preempted
    request loses its blocks and sets this back to 0: it is recomputed later from its prompt
    and the tokens it has generated so far.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    arrival_time: float
    generator: torch.Generator | None = None  # the request's own random stream, when seeded
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    last_token_time: float | None = None
    error: str | None = None  # why the engine failed it, when it did
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when its params ask
    # Prefix caching: the chain hash of each full block of tokens computed so far (kept through
    # preemption: tokens never change), and how many leading `block_ids` are in the cache.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Prompt tokens served from a cache at its first admission (the prefix cache's, or a KV
    # connector's) instead of computed: OpenAI's usage.prompt_tokens_details.cached_tokens.
    num_cached_tokens: int | None = None
    # Disaggregated prefill (vLLM's protocol): what the router sent, and, when the request
    # ends, what a KV connector answers for whoever continues it.
    kv_transfer_params: dict | None = None
    kv_transfer_result: dict | None = None
    spec_token_ids: list[int] = field(default_factory=list)  # drafts for its next step

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def chunk(self, num_tokens: int) -> kvgraph.RequestChunk:
        """The next `num_tokens` tokens not yet in the cache, as one step's chunk; with drafts
        (speculation.py), its last token and the drafts, with logits at each."""
        start = self.num_computed_tokens
        tokens = (self.prompt_token_ids + self.output_token_ids)[start:start + num_tokens]
        if self.spec_token_ids:
            return kvgraph.RequestChunk(tokens + self.spec_token_ids, start,
                                        list(self.block_ids), 1 + len(self.spec_token_ids))
        return kvgraph.RequestChunk(tokens, start, list(self.block_ids))


@dataclass(frozen=True)
class RequestOutput:
    """What one step added to one request: a token, its text, and whether it finished.

    `text` is the new text (possibly empty while a character or a possible stop string is
    incomplete). `ttft` is set on the first token (seconds since arrival), `itl` on the later
    ones (seconds since the previous token). A request the engine failed ends with an output
    that has no token, finish reason ABORT, and `error`.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    ttft: float | None = None
    itl: float | None = None
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # when the request's params asked for them
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # on the first output, if asked
    num_cached_tokens: int = 0  # of the prompt's, served from a cache (see Request)
    kv_transfer_params: dict | None = None  # on the last output: the KV connector's answer

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Completion:
    """A finished request, as the offline `LLMEngine.generate` returns it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    error: str | None = None
