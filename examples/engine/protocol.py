"""The OpenAI-style HTTP protocol's requests: bodies checked into engine inputs (the answers'
objects are in responses.py).

Plain Python (no web framework): every field is checked for its type here (numbers finite,
integers within int64, bools never numbers) and for its range by `SamplingParams`; a bad one
is a `RequestError` naming it, which the server answers with HTTP 400. The body as a whole
(size, nesting, Unicode) is checked before, by `json_body.parse_json`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from .errors import RequestError
from .logprobs import MAX_LOGPROBS
from .sampling_params import INT64_MAX, INT64_MIN, SamplingParams

# OpenAI's default when a request gives no max_tokens.
DEFAULT_MAX_TOKENS = 16
# The most choices (`n`) one request may ask for: each is an engine request.
MAX_CHOICES = 16


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request: what the engine runs, and how the answer is sent (`include_usage`:
    a stream ends with a chunk holding the token counts)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool = False
    echo_text: str = ""  # `echo`: the prompt's text, put before the answer's
    n: int = 1  # choices: each an engine request of its own
    # vLLM's disaggregated-prefill parameters, for the engine's KV connector (one choice only).
    kv_transfer_params: dict[str, Any] | None = None


def _is_int(value: Any) -> bool:
    """An integer (not a bool) that fits in int64, as every integer the engine holds must."""
    return isinstance(value, int) and not isinstance(value, bool) and (
        INT64_MIN <= value <= INT64_MAX)


def _is_number(value: Any) -> bool:
    """A finite number (not a bool); JSON's 1e400 parses to inf, and 10**400 has no float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def _is_stop(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list)
                                      and all(isinstance(s, str) for s in value))


# field -> (check, what it must be). Absent and null fields take SamplingParams' defaults.
_INT = "an integer in [-2**63, 2**63)"
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (_is_int, _INT),
    "temperature": (_is_number, "a finite number"),
    "top_p": (_is_number, "a finite number"),
    "top_k": (_is_int, _INT),
    "seed": (_is_int, _INT),
    "stop": (_is_stop, "a string or a list of strings"),
    "stream": (lambda v: isinstance(v, bool), "a boolean"),
    "ignore_eos": (lambda v: isinstance(v, bool), "a boolean"),
    "model": (lambda v: isinstance(v, str), "a string"),
    "n": (lambda v: _is_int(v) and 1 <= v <= MAX_CHOICES, f"an integer in [1, {MAX_CHOICES}]"),
    "presence_penalty": (_is_number, "a finite number"),
    "frequency_penalty": (_is_number, "a finite number"),
    "repetition_penalty": (_is_number, "a finite number"),
    "max_completion_tokens": (_is_int, _INT),
    "stream_options": (lambda v: isinstance(v, dict) and set(v) <= {"include_usage"}
                       and isinstance(v.get("include_usage", False), bool),
                       'an object {"include_usage": true|false}'),
}

# OpenAI's fields this engine does not implement, each with the values that ask for nothing
# (what the official client sends when the caller leaves it out): anything else is refused, so a
# client never gets an answer that silently ignored what it asked for.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "logit_bias": (None, {}), "best_of": (None, 1), "suffix": (None,), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}),
    "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]), "web_search_options": (None,),
}


def _field(body: dict[str, Any], name: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    check, expected = _FIELDS[name]
    if not check(value):
        raise RequestError(name, f"{name} must be {expected}, got {_shown(value)}")
    return value


def _shown(value: Any, limit: int = 80) -> str:
    """`value` as JSON for an error message, cut to `limit` characters."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _refuse_unsupported(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for name, neutral in _UNSUPPORTED.items():
        if name in body and name not in allowed and not any(body[name] == n and type(body[name]) is type(n)
                                    for n in neutral):
            raise RequestError(name, f"{name} is not supported by this server, got "
                               f"{_shown(body[name])} (leave it out)")


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions' `logprobs`: how many top alternatives each token comes with."""
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    if not _is_int(value):
        raise RequestError("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                           f"{_shown(value)}")
    return value


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's `logprobs` (a boolean) and `top_logprobs` (how many alternatives)."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise RequestError("logprobs", f"logprobs must be a boolean, got {_shown(asked)}")
    # Its range is checked here, not by SamplingParams, which would name `logprobs`.
    if top is not None and not (_is_int(top) and 0 <= top <= MAX_LOGPROBS):
        raise RequestError("top_logprobs", f"top_logprobs must be an integer in [0, "
                           f"{MAX_LOGPROBS}], got {_shown(top)}")
    if top is not None and not asked:
        raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if asked else None


def _sampling_params(body: dict[str, Any], logprobs: int | None,
                     prompt_logprobs: int | None = None, allowed: tuple[str, ...] = ()
                     ) -> SamplingParams:
    _refuse_unsupported(body, allowed)
    for name in _FIELDS:
        _field(body, name)  # type checks first: their messages are the clearest
    stop = _field(body, "stop", ())
    top_k = _field(body, "top_k", 0)
    # The chat API's newer name wins, as in OpenAI's and vLLM's servers.
    max_tokens = _field(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", DEFAULT_MAX_TOKENS)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(_field(body, "temperature", 1.0)),
        top_k=0 if top_k == -1 else top_k,  # -1 is vLLM's "off"
        top_p=float(_field(body, "top_p", 1.0)),
        seed=_field(body, "seed"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        ignore_eos=_field(body, "ignore_eos", False),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=float(_field(body, "presence_penalty", 0.0)),
        frequency_penalty=float(_field(body, "frequency_penalty", 0.0)),
        repetition_penalty=float(_field(body, "repetition_penalty", 1.0)),
    )


def parse_completion(body: dict[str, Any], tokenizer: Any) -> GenerationRequest:
    """`/v1/completions`: `prompt` is a non-empty string or a list of token ids."""
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("prompt", "prompt is required")
    if isinstance(prompt, str) and prompt:
        prompt_token_ids = tokenizer.encode(prompt)
    elif _is_token_ids(prompt):
        prompt_token_ids = prompt
    else:
        raise RequestError("prompt", "prompt must be a non-empty string or a non-empty list "
                           f"of token ids, got {_shown(prompt)}")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise RequestError("echo", f"echo must be a boolean, got {_shown(echo)}")
    logprobs = _completion_logprobs(body)
    # Echo with logprobs scores the prompt too: what loglikelihood evaluation asks for.
    params = _sampling_params(body, logprobs, logprobs if echo else None, allowed=("echo",))
    echo_text = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) if echo else ""
    return _request(prompt_token_ids, params, body, echo_text)


def parse_chat(body: dict[str, Any], tokenizer: Any) -> GenerationRequest:
    """`/v1/chat/completions`: `messages` is a non-empty list of `{role, content}` strings."""
    messages = body.get("messages")
    if messages is None:
        raise RequestError("messages", "messages is required")
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages)):
        raise RequestError("messages", "messages must be a non-empty list of objects with "
                           "string 'role' and 'content'")
    params = _sampling_params(body, _chat_logprobs(body))
    try:
        prompt_token_ids = tokenizer.encode_chat(messages)
    except Exception as error:  # a template's raise_exception, or a template bug
        raise RequestError("messages", f"the chat template failed: {error}") from None
    return _request(prompt_token_ids, params, body)


def _request(prompt_token_ids: list[int], params: SamplingParams, body: dict[str, Any],
             echo_text: str = "") -> GenerationRequest:
    stream = _field(body, "stream", False)
    options = _field(body, "stream_options", {})
    if options and not stream:
        raise RequestError("stream_options", "stream_options is only allowed with stream: true")
    n = _field(body, "n", 1)
    transfer = _kv_transfer_params(body)
    if transfer is not None and n > 1:
        # Each choice is an engine request of its own; one prefill hands over one request.
        raise RequestError("kv_transfer_params", "kv_transfer_params (disaggregated prefill) "
                           f"serves one choice: n must be 1, got {n}")
    return GenerationRequest(prompt_token_ids, params, stream,
                             options.get("include_usage", False), echo_text, n, transfer)


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(b) and b >= 0 for b in value)


def _is_port(value: Any) -> bool:
    return _is_int(value) and 0 < value < 65536


# vLLM's kv_transfer_params keys kvgraph's connectors read, each with its type: checked here,
# since a wrong one would otherwise raise inside an engine step, failing every request in it.
_TRANSFER_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "do_remote_decode": (lambda v: isinstance(v, bool), "a boolean"),
    "do_remote_prefill": (lambda v: isinstance(v, bool), "a boolean"),
    "remote_engine_id": (lambda v: isinstance(v, str), "a string"),
    "remote_request_id": (lambda v: isinstance(v, str), "a string"),
    "remote_host": (lambda v: isinstance(v, str) and bool(v), "a host name"),
    "remote_port": (_is_port, "a TCP port (an integer in [1, 65535])"),
    "remote_block_ids": (_is_id_list, "a list of block ids (integers >= 0)"),
    "first_token_ids": (_is_id_list, "a list of token ids (integers >= 0)"),
    "push": (lambda v: isinstance(v, bool), "a boolean"),
    "transfer_id": (lambda v: isinstance(v, str) and bool(v), "a transfer id (a string)"),
}
# What a decode request needs to find the prefill engine's blocks (a pushed one: its
# remote_block_ids are [], as P's are not known yet, and remote_request_id is the transfer id).
_PULL_KEYS = ("remote_host", "remote_port", "remote_block_ids")
_PUSH_KEYS = ("remote_host", "remote_port", "remote_request_id")


def _kv_transfer_params(body: dict[str, Any]) -> dict[str, Any] | None:
    """`kv_transfer_params`: an object or null. Other keys pass through untouched (another
    connector may read them); vLLM's proxies send the remote_* keys as null to a prefill."""
    value = body.get("kv_transfer_params")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("kv_transfer_params", "kv_transfer_params must be an object or "
                           f"null, got {_shown(value)}")
    for key, (check, expected) in _TRANSFER_KEYS.items():
        if value.get(key) is not None and not check(value[key]):
            raise RequestError("kv_transfer_params", f"kv_transfer_params.{key} must be "
                               f"{expected}, got {_shown(value[key])}")
    for flag, needed in (("do_remote_prefill", _PUSH_KEYS if value.get("push") else _PULL_KEYS),
                         ("do_remote_decode", ("transfer_id",) if value.get("push") else ())):
        missing = [key for key in needed if value.get(flag) and value.get(key) is None]
        if missing:
            raise RequestError("kv_transfer_params", f"kv_transfer_params with {flag} needs "
                               f"{', '.join(missing)} (the prefill server's answer, or for a "
                               "push the proxy, gives them)")
    return value
