"""SamplingParams: how one request picks its tokens and when it stops, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import RequestError
from .logprobs import MAX_LOGPROBS

# The integers a torch tensor or generator seed holds: anything wider overflows at sample time.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# Below this temperature sampling is greedy: dividing float32 logits by less overflows them.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping settings.

    `temperature` below 1e-5 (0 included) is greedy. `top_k=0` and `top_p=1` switch those
    filters off. `seed` gives the request its own random stream, so a seeded request samples
    the same tokens whatever else is in its batches. Generation stops after `max_tokens`
    tokens, at the first of `stop` strings (left out of the text), at a `stop_token_ids`
    token, or at the tokenizer's end-of-sequence token unless `ignore_eos`. `logprobs` (None: not
    asked) gives each output its token's log-probability and that many top alternatives';
    `prompt_logprobs` does the same for every prompt token (on the first output).
    The penalties are vLLM's (examples/engine/penalties.py); 0, 0 and 1 switch them off.
    Numbers must be finite, and integers fit in int64.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = [
            ("max_tokens", 1 <= self.max_tokens <= INT64_MAX, "must lie in [1, 2**63)"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0,
             "must be finite and >= 0"),
            ("top_k", 0 <= self.top_k <= INT64_MAX, "must lie in [0, 2**63) (0 switches it off)"),
            ("top_p", math.isfinite(self.top_p) and 0 < self.top_p <= 1, "must lie in (0, 1]"),
            ("seed", self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
             "must lie in [-2**63, 2**63)"),
            ("stop", all(self.stop), "must not contain an empty string"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must lie in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, f"must lie in [0, {MAX_LOGPROBS}]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must lie in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must lie in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 2, "must lie in (0, 2]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise RequestError(name, f"{name} {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
