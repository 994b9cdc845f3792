"""SpeculativeConfig (`--speculative-config`): vLLM's defaults for the n-gram bounds, and a
ConfigError naming the field, what it expected and what came for each way a config is wrong."""

from __future__ import annotations

import dataclasses
import json

import pytest

from examples.engine.speculative_config import SpeculativeConfig
from kvgraph.errors import ConfigError


def parse(**fields) -> SpeculativeConfig:
    return SpeculativeConfig.from_json(json.dumps(fields))


@pytest.mark.parametrize("given, bounds", [
    ({}, (5, 5)),  # vLLM's default when neither is given
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_max": 4}, (4, 4)),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": 6}, (2, 6)),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 3}, (3, 3)),
])
def test_ngram_bounds_default_as_vllms_do(given, bounds):
    config = parse(method="ngram", num_speculative_tokens=4, **given)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == bounds
    assert config.method == "ngram" and config.model is None


def test_a_draft_model_config_keeps_its_model_and_no_ngram_bounds():
    config = parse(method="draft_model", model="/models/small", num_speculative_tokens=3)
    assert config.model == "/models/small"
    assert config.prompt_lookup_min is None and config.prompt_lookup_max is None


def test_a_model_without_a_method_means_draft_model_as_in_vllm():
    config = parse(model="org/draft", num_speculative_tokens=2)
    assert config.method == "draft_model"


@pytest.mark.parametrize("num_speculative_tokens", [1, 4, 7])
def test_a_decode_step_runs_the_last_token_and_the_proposals(num_speculative_tokens):
    config = parse(method="ngram", num_speculative_tokens=num_speculative_tokens)
    assert config.uniform_decode_query_len == 1 + num_speculative_tokens


def test_the_config_is_frozen_and_equal_by_value():
    config = parse(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_speculative_tokens = 5  # type: ignore[misc]
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                                       prompt_lookup_min=3, prompt_lookup_max=3)


NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
DRAFT = {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 4}

# (the flag's JSON, the field the error names, fragments its message must hold)
ERRORS = [
    ("{not json", "speculative_config", ["not JSON", '"method": "ngram"']),
    ("[1, 2]", "speculative_config", ["expected an object", "list"]),
    (json.dumps({**NGRAM, "num_lookahead": 2}), "speculative_config",
     ["unknown field(s) ['num_lookahead']", "num_speculative_tokens"]),
    (json.dumps({"method": "ngram"}), "num_speculative_tokens", ["required", "got none"]),
    (json.dumps({**NGRAM, "num_speculative_tokens": 0}), "num_speculative_tokens",
     ["expected an integer >= 1", "got 0"]),
    (json.dumps({**NGRAM, "num_speculative_tokens": -2}), "num_speculative_tokens",
     ["expected an integer >= 1", "got -2"]),
    (json.dumps({**NGRAM, "num_speculative_tokens": "3"}), "num_speculative_tokens",
     ["expected an integer >= 1", "got '3'"]),
    (json.dumps({**NGRAM, "num_speculative_tokens": 2.0}), "num_speculative_tokens",
     ["expected an integer >= 1", "got 2.0"]),
    (json.dumps({**NGRAM, "num_speculative_tokens": True}), "num_speculative_tokens",
     ["expected an integer >= 1", "got True"]),
    (json.dumps({"num_speculative_tokens": 3}), "method",
     ["required", "'ngram'", "'draft_model'", "got none"]),
    (json.dumps({**NGRAM, "method": "eagle"}), "method",
     ["expected one of ['ngram', 'draft_model']", "got 'eagle'"]),
    (json.dumps({**NGRAM, "method": None}), "method", ["expected one of", "got None"]),
    (json.dumps({"method": "draft_model", "num_speculative_tokens": 3}), "model",
     ["draft_model", "name or checkpoint path", "got none"]),
    (json.dumps({**DRAFT, "model": ""}), "model", ["name or checkpoint path", "got ''"]),
    (json.dumps({**DRAFT, "model": 7}), "model", ["name or checkpoint path", "got 7"]),
    (json.dumps({**NGRAM, "model": "/models/small"}), "model",
     ["takes no draft model", "got '/models/small'", '"method": "draft_model"']),
    (json.dumps({**DRAFT, "prompt_lookup_min": 2}), "prompt_lookup_min",
     ["only the ngram method", "got 2"]),
    (json.dumps({**DRAFT, "prompt_lookup_max": 4}), "prompt_lookup_max",
     ["only the ngram method", "got 4"]),
    (json.dumps({**NGRAM, "prompt_lookup_min": 5, "prompt_lookup_max": 3}), "prompt_lookup_min",
     ["expected at most prompt_lookup_max (3)", "got 5"]),
    (json.dumps({**NGRAM, "prompt_lookup_min": 0}), "prompt_lookup_min",
     ["expected an integer >= 1", "got 0"]),
    (json.dumps({**NGRAM, "prompt_lookup_max": "4"}), "prompt_lookup_max",
     ["expected an integer >= 1", "got '4'"]),
    (json.dumps({**NGRAM, "prompt_lookup_max": 1.5}), "prompt_lookup_max",
     ["expected an integer >= 1", "got 1.5"]),
]


@pytest.mark.parametrize("text, field, fragments", ERRORS)
def test_a_wrong_config_is_refused_naming_the_field(text, field, fragments):
    with pytest.raises(ConfigError) as error:
        SpeculativeConfig.from_json(text)
    assert error.value.field == field
    message = str(error.value)
    # The message starts with what is wrong: the field, or the config for one it cannot parse.
    assert message.startswith(f"{field}:" if field != "speculative_config"
                              else "speculative config:"), message
    for fragment in fragments:
        assert fragment in message, message


def test_the_constructor_checks_as_the_flag_does():
    with pytest.raises(ConfigError) as error:
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4,
                          prompt_lookup_max=2)
    assert error.value.field == "prompt_lookup_min"
