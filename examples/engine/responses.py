"""The OpenAI-style answers: completion and chat objects, whole or as stream chunks, with their
logprobs, and error bodies."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .logprobs import TokenLogprobs
from .request import FinishReason


def error_body(message: str, param: str | None, kind: str = "invalid_request_error"
               ) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param}}


@dataclass(frozen=True)
class ResponseFormat:
    """How one endpoint shapes its answers (OpenAI's completion or chat objects)."""

    request_id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))
    token_text: Callable[[int], str] = str  # a token id's text, for logprobs

    def _choice(self, index: int, text: str, finish_reason: FinishReason | None, stream: bool,
                logprobs: list[TokenLogprobs] | None = None) -> dict[str, Any]:
        reason = None if finish_reason is None else finish_reason.value
        if not self.chat:
            return {"index": index, "text": text,
                    "logprobs": self._completion_logprobs(logprobs), "finish_reason": reason}
        key = "delta" if stream else "message"
        return {"index": index, key: {"role": "assistant", "content": text},
                "logprobs": self._chat_logprobs(logprobs), "finish_reason": reason}

    def _completion_logprobs(self, entries: list[TokenLogprobs] | None) -> dict | None:
        """The completions API's logprobs object (parallel lists, one entry per token)."""
        if not entries:
            return None
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None
                                 else {self.token_text(t): lp for t, lp in e.top}
                                 for e in entries],
                "text_offset": offsets}

    def _chat_logprobs(self, entries: list[TokenLogprobs] | None) -> dict | None:
        """The chat API's logprobs object (one record per token, its alternatives inside)."""
        if not entries:
            return None

        def record(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob,
                    "bytes": list(text.encode("utf-8", "surrogatepass"))}

        return {"content": [{**record(e.token_id, e.logprob),
                             "top_logprobs": [record(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices}

    def response(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        """The whole answer: every choice, in index order, the token counts, and (vLLM's field,
        null when none) what the KV connector answers for whoever continues the request."""
        kind = "chat.completion" if self.chat else "text_completion"
        body = self._object(kind, [self._choice(i, c.text, c.finish_reason, False, c.logprobs)
                                   for i, c in enumerate(choices)])
        # The choices share one prompt, counted once in prompt_tokens: its cached_tokens are the
        # first choice's (the later ones, started after it, may find its blocks cached too).
        cached = choices[0].num_cached_tokens if choices else 0
        body["usage"] = _usage(prompt_tokens, sum(c.num_tokens for c in choices), cached)
        # As vLLM: the first choice's (a request with kv_transfer_params has only one).
        body["kv_transfer_params"] = choices[0].kv_transfer_params if choices else None
        return body

    def chunk(self, index: int, text: str, finish_reason: FinishReason | None,
              logprobs: list[TokenLogprobs] | None = None,
              kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One stream chunk: one token of choice `index`; the chunk that ends a request the KV
        connector answered for carries `kv_transfer_params` (no other chunk has the key)."""
        body = self._object(self._chunk_kind,
                            [self._choice(index, text, finish_reason, True, logprobs)])
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
                    ) -> dict[str, Any]:
        """A stream's last chunk under `stream_options.include_usage`: no choices, the counts."""
        body = self._object(self._chunk_kind, [])
        body["usage"] = _usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


@dataclass
class Choice:
    """One choice of a whole answer, gathered from its request's outputs."""

    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt's, served from the prefix cache or a KV connector
    kv_transfer_params: dict[str, Any] | None = None  # the KV connector's answer, at the end


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
           ) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` is always there (0 when
    nothing was cached), as vLLM gives it with prefix caching on."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
