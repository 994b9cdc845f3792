"""Where a checkpoint keeps its chat template, read in transformers' order of precedence.

transformers 5 saves a tokenizer's template as `chat_template.jinja` (named extra templates in
`additional_chat_templates/`), older versions inside `tokenizer_config.json` (a string, or a
list of `{"name", "template"}`), and processors of multimodal models in `chat_template.json`
(`{"chat_template": ...}`). A file of its own takes priority over the config's entry, as
`AutoTokenizer` and `AutoProcessor` give it; of several templates the server uses "default".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

logger = logging.getLogger(__name__)

JINJA_FILE = "chat_template.jinja"
JSON_FILE = "chat_template.json"
CONFIG_FILE = "tokenizer_config.json"
# Where a template is looked for, first found wins: what a 404 on the chat endpoint names.
SOURCES = (JINJA_FILE, JSON_FILE, f"{CONFIG_FILE} 'chat_template'")


@dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template and the file it came from."""

    text: str
    source: str


def read_chat_template(path: Path, tokenizer_config: Mapping[str, Any]) -> ChatTemplate | None:
    """The chat template of the checkpoint directory `path` (None where it has none); a
    ValueError naming the file for one that is there but unreadable."""
    jinja = path / JINJA_FILE
    if jinja.is_file():
        return ChatTemplate(jinja.read_text(encoding="utf-8"), JINJA_FILE)
    legacy = path / JSON_FILE
    if legacy.is_file():
        try:
            text = json.loads(legacy.read_text(encoding="utf-8"))["chat_template"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"checkpoint: {legacy} is not {{\"chat_template\": ...}}: "
                             f"{error!r}") from None
        return ChatTemplate(_default(text, legacy), JSON_FILE)
    entry = tokenizer_config.get("chat_template")
    if entry is None:
        return None
    return ChatTemplate(_default(entry, path / CONFIG_FILE), CONFIG_FILE)


def _default(entry: Any, file: Path) -> str:
    """A template entry as a string: itself, or the one named "default" of a list of them."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"checkpoint: {file} has chat templates named {sorted(map(str, named))}"
                         f", none of them 'default'")
    raise ValueError(f"checkpoint: {file}'s chat_template is a {type(entry).__name__}, not a "
                     f"string or a list of named templates")


def log_chat_template(template: ChatTemplate | None, path: Path) -> None:
    """Say at start-up whether the chat endpoint will answer, and from which file."""
    if template is None:
        logger.warning("checkpoint %s has no chat template (looked for %s): "
                       "/v1/chat/completions is off, /v1/completions serves", path,
                       ", ".join(SOURCES))
    else:
        logger.info("chat template from %s", template.source)
