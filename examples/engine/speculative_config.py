"""SpeculativeConfig: how an engine speculates (`--speculative-config`), in vLLM's field names.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    --speculative-config '{"method": "draft_model", "model": "/models/small",
                           "num_speculative_tokens": 3}'

`ngram` proposes the tokens that followed an earlier occurrence of the sequence's last few
tokens (prompt lookup decoding, see ngram_proposer.py); `draft_model` has a smaller model
propose them. Either way the target model then checks `num_speculative_tokens` proposed tokens
and the one after them in a single step.

The n-gram lengths default as vLLM's do: neither given, both are 5; one given, the other
follows it (so `{"prompt_lookup_max": 4}` matches 4-grams only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from kvgraph.config_checks import json_object
from kvgraph.errors import ConfigError

METHODS = ("ngram", "draft_model")
# vLLM's n-gram length when the config gives neither prompt_lookup_min nor prompt_lookup_max.
DEFAULT_PROMPT_LOOKUP = 5
NGRAM_ONLY = ("prompt_lookup_min", "prompt_lookup_max")
EXAMPLE = ('expected e.g. {"method": "ngram", "num_speculative_tokens": 4, '
           '"prompt_lookup_max": 4}')


def _check_count(name: str, value: Any) -> None:
    # JSON's true/false are Python ints, and 3.0 would pass a numeric comparison: both are
    # slips in a config, not counts.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, f"{name}: expected an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """A speculation method and its settings, checked (and defaults filled) on construction.

    `method` is "ngram" or "draft_model"; left out, a config with a `model` means
    "draft_model", as in vLLM. `num_speculative_tokens` tokens are proposed per step.
    `prompt_lookup_min`/`prompt_lookup_max` bound the n-gram an `ngram` config matches (both set
    after construction); `model` names the draft model (a name or a checkpoint path) and is
    required for, and only for, `draft_model`.
    """

    method: str | None = None
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        method = self.method
        if method is None and self.model is not None:
            method = "draft_model"
            object.__setattr__(self, "method", method)
        if method not in METHODS:
            raise ConfigError("method", f"method: expected one of {list(METHODS)}, got "
                              f"{method!r}")
        _check_count("num_speculative_tokens", self.num_speculative_tokens)
        if method == "ngram":
            self._check_ngram()
        else:
            self._check_draft_model()

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise ConfigError("model", f"model: the ngram method proposes from the sequence "
                              f"itself and takes no draft model, got {self.model!r}; use "
                              '"method": "draft_model" to speculate with one')
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in zip(NGRAM_ONLY, (low, high)):
            if value is not None:
                _check_count(name, value)
        # vLLM's defaults: a bound left out follows the other one, both left out are 5.
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        elif low is None:
            low = high
        elif high is None:
            high = low
        if low > high:
            raise ConfigError("prompt_lookup_min", f"prompt_lookup_min: expected at most "
                              f"prompt_lookup_max ({high}), got {low}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    def _check_draft_model(self) -> None:
        if self.model is None:
            raise ConfigError("model", "model: the draft_model method needs the draft "
                              "model's name or checkpoint path, got none")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model", f"model: expected the draft model's name or "
                              f"checkpoint path, got {self.model!r}")
        for name in NGRAM_ONLY:
            value = getattr(self, name)
            if value is not None:
                raise ConfigError(name, f"{name}: only the ngram method matches n-grams; "
                                  f"drop it for draft_model (got {value!r})")

    @property
    def uniform_decode_query_len(self) -> int:
        """Tokens a decode step runs per request: the last sampled one and the proposals."""
        return 1 + self.num_speculative_tokens

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config a `--speculative-config` JSON object describes; a ConfigError naming
        what is wrong with it."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError("speculative_config", f"speculative config: not JSON "
                              f"({error}); {EXAMPLE}") from None
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig:
        """The config a parsed JSON object describes (`from_json`'s checks, less the JSON)."""
        json_object("speculative_config", "speculative config", value,
                    [f.name for f in fields(cls)], EXAMPLE)
        if "num_speculative_tokens" not in value:
            raise ConfigError("num_speculative_tokens", "num_speculative_tokens: required (an "
                              "integer >= 1, the tokens proposed per step), got none")
        if "method" not in value and "model" not in value:
            raise ConfigError("method", f"method: required, one of {list(METHODS)}, got none")
        return cls(**value)
