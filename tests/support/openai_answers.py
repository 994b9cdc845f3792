"""What the KV connector servers' tests ask through the official `openai` client, and how."""

from __future__ import annotations

import pytest

PROMPT = "the quick brown fox jumps over the lazy dog, paged attention keeps blocks " * 4
MESSAGES = [{"role": "user", "content": "hello world, hello graphs; " * 5}]
MAX_TOKENS = 8


def ask(url: str, chat: bool = True):
    """The prompt's greedy completion and the messages' streamed chat (its text and usage),
    through the official client; with `chat` False (a model without a chat template), the
    streamed completion of the message's text instead of the chat."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})
    streamed = {"temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "extra_body": {"ignore_eos": True}}
    if chat:
        chunks = list(client.chat.completions.create(
            model=model, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, **streamed))
    else:
        chunks = list(client.completions.create(model=model, prompt=MESSAGES[0]["content"],
                                                max_tokens=MAX_TOKENS, **streamed))
    assert not chunks[-1].choices and all(c.usage is None for c in chunks[:-1])
    text = "".join((c.choices[0].delta.content if chat else c.choices[0].text) or ""
                   for c in chunks[:-1])
    return completion, text, chunks[-1].usage
