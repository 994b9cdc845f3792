"""Where a draft model comes from: the `model` of a `draft_model` speculative config, parsed,
checked against the model table and loaded.

    "model": "/models/small-draft"   a local Hugging Face checkpoint directory, read as
                                     `--model PATH` is (its tokenizer is read and dropped: the
                                     target's tokenizes for both)
    "model": "llama"                 an example model at the target's --preset
    "model": "llama:tiny"            ... at another preset
    "model": "llama:small:2"         ... cut to its first 2 decoder layers (a layer-skip draft,
                                     `CausalLM.first_layers`)

Example models are seeded with --seed, so `llama:PRESET:N` under `--model llama --preset
PRESET` is the target's own first N layers. A name of the model table wins over a directory of
that name; a path with a '/' is always a directory. The syntax is checked without the table
(`check_syntax`, as the flag is parsed); names, presets and layer counts with it (`resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from .checkpoint import checkpoint_config, load_checkpoint

SYNTAX = ("a checkpoint directory, or an example model NAME, NAME:PRESET or NAME:PRESET:N "
          "(N: keep its first N decoder layers)")


@dataclass(frozen=True)
class ExampleSource:
    """An example model (`name` a key of the model table) with seeded random weights, at
    `preset` (None: the target's), cut to its first `num_layers` layers (None: all)."""

    name: str
    preset: str | None = None
    num_layers: int | None = None

    def config(self, models: Mapping[str, Any]) -> dict[str, Any]:
        """Its HF config dict (no weights are made)."""
        config = dict(models[self.name].presets[self.preset])
        if self.num_layers is not None:
            config["num_hidden_layers"] = self.num_layers
        return config

    def load(self, models: Mapping[str, Any], dtype: torch.dtype, device: str, seed: int
             ) -> nn.Module:
        cls = models[self.name]
        if self.num_layers is None:
            return cls.from_preset(self.preset, dtype=dtype, device=device, seed=seed)
        return cls.first_layers(cls.presets[self.preset], self.num_layers, seed=seed,
                                dtype=dtype, device=device)

    def __str__(self) -> str:
        n = self.num_layers
        layers = "" if n is None else f", first {n} layer{'' if n == 1 else 's'} only"
        return f"the example {self.name!r} ({self.preset} preset{layers}, random weights)"


@dataclass(frozen=True)
class CheckpointSource:
    """A local Hugging Face checkpoint directory."""

    path: Path

    def config(self, models: Mapping[str, Any]) -> dict[str, Any]:
        """Its config.json, checked as `--model PATH`'s is (checkpoint.py's
        `checkpoint_config`), without reading its weights or tokenizer."""
        return checkpoint_config(self.path, models)

    def load(self, models: Mapping[str, Any], dtype: torch.dtype, device: str, seed: int
             ) -> nn.Module:
        """The model (`seed` unused: its weights are the checkpoint's)."""
        model, _ = load_checkpoint(self.path, models, dtype, device)
        return model

    def __str__(self) -> str:
        return f"the checkpoint {self.path}"


ModelSource = ExampleSource | CheckpointSource


def check_syntax(text: str) -> None:
    """A ValueError if `text` cannot name a draft model whatever the model table holds: a
    malformed NAME:PRESET[:N] that is no directory either."""
    if _is_path(text) or Path(text).is_dir():
        return
    _parse(text)


def resolve(text: str, models: Mapping[str, Any], preset: str) -> ModelSource:
    """What `text` names, `preset` standing in for an example's left-out PRESET; a ValueError
    saying what was expected and what came (unknown name or preset, N out of range, not a
    directory)."""
    if not _is_path(text) and text.split(":")[0] in models:
        return _checked(_parse(text), models, preset, text)
    path = Path(text)
    if path.is_dir():
        return CheckpointSource(path)
    found = "not a directory" if path.exists() else "no such directory"
    raise ValueError(f"{text!r}: expected {SYNTAX}, NAME one of {sorted(models)}; got neither "
                     f"an example model nor a checkpoint directory ({found})")


def _is_path(text: str) -> bool:
    return "/" in text


def _parse(text: str) -> ExampleSource:
    parts = text.split(":")
    if len(parts) > 3 or not all(parts):
        raise ValueError(f"{text!r}: expected {SYNTAX}, with no part left empty")
    num_layers = None
    if len(parts) == 3:
        count = parts[2]
        if not count.isdecimal() or int(count) < 1:
            raise ValueError(f"{text!r}: N (the decoder layers kept) must be an integer >= 1, "
                             f"got {count!r}")
        num_layers = int(count)
    return ExampleSource(parts[0], parts[1] if len(parts) > 1 else None, num_layers)


def _checked(source: ExampleSource, models: Mapping[str, Any], preset: str, text: str
             ) -> ExampleSource:
    """`source` with its preset (the target's when left out), both known, N within its layers."""
    source = replace(source, preset=source.preset or preset)
    presets = models[source.name].presets
    if source.preset not in presets:
        raise ValueError(f"{text!r}: expected a preset of the example model {source.name!r}, "
                         f"one of {sorted(presets)}, got {source.preset!r}")
    layers = presets[source.preset]["num_hidden_layers"]
    if source.num_layers is not None and source.num_layers > layers:
        raise ValueError(f"{text!r}: N (the decoder layers kept) must lie in [1, {layers}], the "
                         f"layers of {source.name}:{source.preset}, got {source.num_layers}")
    return source
