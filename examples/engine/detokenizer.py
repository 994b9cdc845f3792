"""Detokenizer: one request's output text, grown token by token, cut at its stop strings."""

from __future__ import annotations

from typing import Protocol, Sequence

# What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class Detokenizer:
    """Turns a request's output tokens into text deltas that never have to be taken back.

    The whole output is decoded again at each token (a token's text can depend on its
    neighbours). Text is handed out only once it is final: an incomplete character at the end
    is held back, and so are the last `len(longest stop string) - 1` characters, which could
    still become the start of a stop string.
    """

    def __init__(self, decoder: Decoder, stop: Sequence[str] = ()):
        self.decoder = decoder
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self.text = ""
        self.num_emitted = 0
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def add(self, token_id: int) -> bool:
        """Append one token; True when the text now contains a stop string (cut before it)."""
        self.token_ids.append(token_id)
        self.text = self.decoder.decode(self.token_ids)
        found = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[:min(found)]
        return bool(found)

    def take(self, finished: bool) -> str:
        """The text not handed out yet that is final; all of it once the request finished."""
        end = len(self.text)
        if not finished:
            end = len(self.text.rstrip(REPLACEMENT_CHAR)) - self._holdback
        if end <= self.num_emitted:
            return ""
        delta = self.text[self.num_emitted:end]
        self.num_emitted = end
        return delta
