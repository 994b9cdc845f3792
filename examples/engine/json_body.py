"""A request body as a JSON object, within the server's limits: size, nesting, valid Unicode.

Plain Python (no web framework). Every way a body can break these limits is a `RequestError`
(HTTP 400, or `BodyTooLarge`, 413) raised before any field is read, so a streamed request is
refused before its stream starts.
"""

from __future__ import annotations

import json
import re
from typing import Any, AsyncIterable, Protocol

from .errors import BodyTooLarge, RequestError

MAX_BODY_MIB = 4
MAX_BODY_BYTES = MAX_BODY_MIB * 2**20
# Arrays and objects inside one another, the body itself included; OpenAI bodies need ~4.
MAX_JSON_DEPTH = 64
# json.loads pairs valid surrogate escapes into one character: any surrogate left is lone,
# and no UTF-8 encoder (tokenizer, response writer) can take it.
_SURROGATE = re.compile("[\ud800-\udfff]")


class Body(Protocol):
    def stream(self) -> AsyncIterable[bytes]: ...


async def read_body(http: Body) -> bytes:
    """The raw body, refused once it passes MAX_BODY_BYTES (the rest is never buffered)."""
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge("body", f"the request body is over the {MAX_BODY_MIB} MiB limit")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object no deeper than MAX_JSON_DEPTH, every string valid Unicode."""
    try:
        body = json.loads(raw)
    except RecursionError:  # the C decoder recurses per level: far past the limit
        raise RequestError("body", _too_deep()) from None
    except ValueError as error:  # bad JSON or UTF-8, or an integer of over 4300 digits
        raise RequestError("body", f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError("body", f"the request body must be a JSON object, got "
                           f"{type(body).__name__}")
    _check_tree(body)
    return body


def _check_tree(body: dict[str, Any]) -> None:
    """Walk the body without recursion; errors name the top-level field they are under."""
    for key in body:
        _check_text(key, "body", "a field name of the body")
    stack: list[tuple[Any, str, int]] = [(value, key, 1) for key, value in body.items()]
    while stack:
        value, field, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, field, field)
        elif isinstance(value, (list, dict)):
            if depth + 1 > MAX_JSON_DEPTH:
                raise RequestError(field, f"{field}: {_too_deep()}")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, field, f"a key inside {field}")
                stack.append((item, field, depth + 1))


def _check_text(text: str, field: str, what: str) -> None:
    found = _SURROGATE.search(text)
    if found:  # the message never echoes the text: it could not be written as UTF-8
        raise RequestError(field, f"{what} is not valid Unicode: a lone surrogate "
                           f"U+{ord(found.group()):04X} at character {found.start()}")


def _too_deep() -> str:
    return f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"
