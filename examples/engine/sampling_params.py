"""SamplingParams: how one request picks its tokens and when it stops, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping settings.

    `temperature=0` is greedy. `top_k=0` and `top_p=1` switch those filters off. `seed` gives
    the request its own random stream, so a seeded request samples the same tokens whatever
    else is in its batches. Generation stops after `max_tokens` tokens, at the first of
    `stop` strings (left out of the text), at a `stop_token_ids` token, or at the tokenizer's
    end-of-sequence token unless `ignore_eos`.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 switches it off)"),
            ("top_p", 0 < self.top_p <= 1, "must lie in (0, 1]"),
            ("stop", all(self.stop), "must not contain an empty string"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise RequestError(name, f"{name} {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
