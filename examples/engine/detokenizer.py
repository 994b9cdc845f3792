"""Detokenizer: one request's output text, grown token by token, cut at its stop strings."""

from __future__ import annotations

from collections import deque
from typing import Protocol, Sequence

# What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"
# How many tokens of final text (at least) the decoded window keeps before its new tokens: the
# neighbours a token's text may depend on (a SentencePiece decoder strips the first space it
# decodes, a cleanup step joins punctuation to the word before it).
CONTEXT_TOKENS = 4
# A UTF-8 character takes at most 4 bytes, so at most 4 tokens.
MAX_CHARACTER_TOKENS = 4


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class Detokenizer:
    """Turns a request's output tokens into text deltas that never have to be taken back.

    Each token decodes a short window of the latest tokens, twice, as vLLM does: what the new
    tokens add is the window's text minus the text of its older tokens, whose text was final.
    The window starts at offsets where the text was final (never inside a character), so each
    step decodes a bounded number of tokens. It starts inside the prompt, when one is given, so
    the first output token keeps its leading space (' Paris', not 'Paris').

    Text is handed out only once it is final: text ending in an incomplete character is held
    back (its tokens stay in the window until the character is whole, or the request ends), and
    so are the last `len(longest stop string) - 1` characters, which could still become the
    start of a stop string.
    """

    def __init__(self, decoder: Decoder, stop: Sequence[str] = (),
                 prompt_token_ids: Sequence[int] = ()):
        self.decoder = decoder
        self.stop = tuple(stop)
        # The prompt matters only as the window's first context; the rest is never decoded.
        self._token_ids = list(prompt_token_ids[_window_start(decoder, prompt_token_ids):])
        # Offsets into _token_ids where the text was final, oldest first: the window starts at
        # the oldest, the text known so far ends at the newest.
        self._final = deque([0, len(self._token_ids)])
        self.text = ""
        self._pending = ""  # the window's new text, held back: it ends in half a character
        self.num_emitted = 0
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def add(self, token_id: int) -> bool:
        """Append one token; True when the text now contains a stop string (cut before it)."""
        self._token_ids.append(token_id)
        start, known_end = self._final[0], self._final[-1]
        known = self.decoder.decode(self._token_ids[start:known_end])
        self._pending = self.decoder.decode(self._token_ids[start:])[len(known):]
        if self._cut_at_stop():
            return True
        if self._pending and not self._pending.endswith(REPLACEMENT_CHAR):
            self.text += self._pending
            self._pending = ""
            self._final.append(len(self._token_ids))
            self._shorten_window()
        return False

    def _shorten_window(self) -> None:
        """Start the window at the latest final offset with CONTEXT_TOKENS tokens after it."""
        while self._final[1] <= self._final[-1] - CONTEXT_TOKENS:
            self._final.popleft()

    def _cut_at_stop(self) -> bool:
        """Cut the text before the first stop string that the pending text completes, if any."""
        # A stop string found now ends in the pending text, so it starts at most
        # `_holdback` characters before it: a token's search costs O(stop strings * longest),
        # which SamplingParams bounds (MAX_STOP_STRINGS, MAX_STOP_CHARS).
        kept = len(self.text) - min(self._holdback, len(self.text))
        tail = self.text[kept:] + self._pending
        found = [i for i in (tail.find(s) for s in self.stop) if i >= 0]
        if not found:
            return False
        self.text = self.text[:kept] + tail[:min(found)]
        self._pending = ""
        return True

    def take(self, finished: bool) -> str:
        """The text not handed out yet that is final; all of it once the request finished."""
        if finished:  # nothing can complete a held character any more: it is sent as it is
            self.text += self._pending
            self._pending = ""
        end = len(self.text) if finished else len(self.text) - self._holdback
        if end <= self.num_emitted:
            return ""
        delta = self.text[self.num_emitted:end]
        self.num_emitted = end
        return delta


def _window_start(decoder: Decoder, prompt_token_ids: Sequence[int]) -> int:
    """Where the first window starts: CONTEXT_TOKENS before the prompt's end, at a character.

    A window that starts inside a character decodes its first bytes to U+FFFD, and a byte
    fallback decoder turns a whole run of byte tokens into U+FFFD when the run starts inside a
    character, so the start moves back until the prompt's text from there is whole.
    """
    start = max(len(prompt_token_ids) - CONTEXT_TOKENS, 0)
    for _ in range(MAX_CHARACTER_TOKENS - 1):
        if start == 0 or not decoder.decode(prompt_token_ids[start:]).startswith(REPLACEMENT_CHAR):
            break
        start -= 1
    return start
