"""Tokenizers the engine serves with: bytes for the random-weight examples, or a checkpoint's.

Both answer `encode(text) -> ids`, `decode(ids) -> text`, `eos_token_ids` and `chat_template`
(None when there is none; otherwise `encode_chat(messages)` renders and encodes a chat).
The Hugging Face `tokenizers` library and jinja2 are imported only when a checkpoint is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from .chat_template import ChatTemplate, log_chat_template, read_chat_template

# Bytes are token ids 0..255.
NUM_BYTES = 256


class ByteTokenizer:
    """UTF-8 bytes as tokens: what the random-weight example models are served with.

    Ids at or above 256 (a vocabulary larger than the bytes) decode to nothing; there is no
    end-of-sequence token and no chat template.
    """

    eos_token_ids: frozenset[int] = frozenset()
    chat_template: None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < NUM_BYTES).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's `tokenizer.json`, with `tokenizer_config.json`'s special tokens and the
    checkpoint's chat template (chat_template.py; rendered with jinja2, as Hugging Face renders
    it)."""

    def __init__(self, tokenizer: Any, config: Mapping[str, Any], eos_token_ids: set[int],
                 chat_template: ChatTemplate | None = None):
        self.tokenizer = tokenizer
        self.config = config
        self.chat_template: str | None = chat_template.text if chat_template else None
        self.eos_token_ids = frozenset(eos_token_ids)

    @classmethod
    def from_dir(cls, path: Path, generation_config: Mapping[str, Any]) -> HFTokenizer:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json"
        if not file.is_file():  # the library's own error names no file
            raise FileNotFoundError(f"checkpoint: {file} is missing (the tokenizer: only "
                                    "Hugging Face fast tokenizers, tokenizer.json, are read)")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as error:  # noqa: BLE001 - the library raises a bare Exception
            raise ValueError(f"checkpoint: {file} is not a tokenizer the `tokenizers` library "
                             f"can read: {error}") from None
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        eos = generation_config.get("eos_token_id")
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        eos_token = _token_text(config.get("eos_token"))
        if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
            eos_ids.add(tokenizer.token_to_id(eos_token))
        template = read_chat_template(path, config)
        log_chat_template(template, path)
        return cls(tokenizer, config, eos_ids, template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt of a chat, ending where the assistant's reply starts (needs a template).

        The template writes the special tokens itself, so none are added when encoding.
        """
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        assert self.chat_template is not None, "callers check chat_template first"
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        # HF renders chat templates in a sandbox with these settings and globals.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        special = {k: _token_text(self.config.get(k)) or "" for k in ("bos_token", "eos_token")}
        return template.render(messages=messages, add_generation_prompt=True, **special)


def _token_text(token: Any) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string or `{"content": ...}`."""
    return token.get("content") if isinstance(token, dict) else token
