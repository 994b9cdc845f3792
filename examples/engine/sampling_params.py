"""SamplingParams: how one request picks its tokens and when it stops, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import RequestError
from .logprobs import MAX_LOGPROBS

# The integers a torch tensor or generator seed holds: anything wider overflows at sample time.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# Below this temperature sampling is greedy: dividing float32 logits by less overflows them
# (1e-45 would turn every logit above 3.4e-7 into inf); from it up, only a logit past 3.4e33
# overflows. No temperature is too large: the sampler saturates it at float32's largest number.
GREEDY_TEMPERATURE = 1e-5
# A repeated token's positive logit is divided by the penalty, a negative one multiplied, in
# float32. At 0.01 only a logit past 3.4e36 overflows, far beyond any a model produces (tens),
# where 1e-45 turned every positive logit into inf (and 5e-324, 0 in float32, into inf or NaN).
# Below it nothing a user could want changes: a positive logit multiplied by 100 already makes
# the token near certain. (No bound below 1 keeps every finite float32 finite: the sampler
# fails a request whose row is not finite, whatever made it so.)
MIN_REPETITION_PENALTY = 0.01
# Stop strings are searched for after every token (detokenizer.py), and text is held back by the
# longest: bounded, one token's search stays within microseconds (64 strings of 256 characters:
# ~11 us on a CPU), where 300,000 took 25 ms a token and slowed every request beside them.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256


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
    Numbers must be finite, integers fit in int64, and each value lies where the sampler's
    float32 arithmetic keeps a model's logits finite (the bounds above, each with why); at
    most MAX_STOP_STRINGS stop strings, of at most MAX_STOP_CHARS characters each.
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
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must lie in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, f"must lie in [0, {MAX_LOGPROBS}]"),
            # These two subtract at most 2 * (1 + max_model_len) from a logit: it stays finite.
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must lie in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must lie in [-2, 2]"),
            ("repetition_penalty", MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2,
             f"must lie in [{MIN_REPETITION_PENALTY}, 2]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise RequestError(name, f"{name} {rule}, got {getattr(self, name)!r}")
        self._check_stop()

    def _check_stop(self) -> None:
        """Bound the stop strings (each is searched for after every token); the message shows
        their count or length, not the strings."""
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError("stop", f"stop must hold at most {MAX_STOP_STRINGS} strings, got "
                               f"{len(self.stop)}")
        longest = max(map(len, self.stop), default=1)
        if longest > MAX_STOP_CHARS:
            raise RequestError("stop", f"stop strings must be at most {MAX_STOP_CHARS} characters "
                               f"long, got one of {longest}")
        if not all(self.stop):
            raise RequestError("stop", "stop must not contain an empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
