"""Loading a local Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer.json.

Nothing is downloaded. `safetensors` and `tokenizers` are imported only here, when a
checkpoint is asked for. `checkpoint_config` checks a directory without reading its weights or
tokenizer: the scripts' start-up checks (preflight.py) run it before anything is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from kvgraph.distributed import TensorParallelGroup

from .tokenizer import HFTokenizer

# HF `architectures` entries -> the example model (a key of the caller's model table) that
# loads their state dicts under HF's own names.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                 "Qwen2ForCausalLM": "llama"}
# The tokenizer file read (tokenizer.py): only Hugging Face fast tokenizers.
TOKENIZER_FILE = "tokenizer.json"
LAYOUT = f"a checkpoint directory holds config.json, *.safetensors weights and {TOKENIZER_FILE}"


def _read_json(file: Path, required: bool = True) -> dict[str, Any]:
    """`file` as a JSON object ({} when it is missing and not `required`); an error naming the
    file and what is wrong with it."""
    if not file.is_file():
        if required:
            raise FileNotFoundError(f"{file.name} is missing ({LAYOUT})")
        return {}
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError) as error:  # ValueError: not JSON, or not UTF-8
        raise ValueError(f"{file.name} cannot be read as JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file.name} holds a JSON {type(value).__name__}, not an object")
    return value


def model_kind(config: Mapping[str, Any]) -> str:
    """Which example model serves a checkpoint's `config.json`; a clear error if none does."""
    architectures = config.get("architectures") or []
    for architecture in architectures:
        if architecture in ARCHITECTURES:
            return ARCHITECTURES[architecture]
    supported = f"supported: {sorted(ARCHITECTURES)}"
    if not architectures:  # a config saved on its own, not with its model, may have none
        raise NotImplementedError(f"config.json names no architecture (model_type "
                                  f"{config.get('model_type')!r}); {supported}")
    raise NotImplementedError(f"config.json's architectures {architectures} are not served by "
                              f"these examples; {supported}")


def safetensors_files(path: Path) -> list[Path]:
    """The `*.safetensors` files of `path` (several for a sharded checkpoint); at least one."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(file.name for file in path.glob("*.bin"))
        more = f" and {len(pickles) - 1} more" if len(pickles) > 1 else ""
        found = f"; {pickles[0]}{more}: PyTorch pickle weights, not read" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors weights file ({LAYOUT}){found}")
    return files


def checkpoint_config(path: str | Path, models: Mapping[str, Any]) -> dict[str, Any]:
    """Checkpoint dir `path`'s config.json, checked as far as it can be without reading weights
    or the tokenizer: it and generation_config.json parse, it names an architecture one of
    `models` serves and that model's config accepts it; weights and tokenizer files are there.
    Else what `load_checkpoint` would raise later (FileNotFoundError, ValueError or
    NotImplementedError), its message naming the file but not `path`."""
    path = Path(path)
    config = _read_json(path / "config.json")
    _read_json(path / "generation_config.json", required=False)
    models[model_kind(config)].config_class.from_hf(config)
    safetensors_files(path)
    if not (path / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"{TOKENIZER_FILE} is missing (the tokenizer: only Hugging Face "
                                f"fast tokenizers, {TOKENIZER_FILE}, are read)")
    return config


def read_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of every file."""
    from safetensors.torch import load_file

    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(file))
    return state_dict


def load_checkpoint(path: str | Path, models: Mapping[str, Any], dtype: torch.dtype,
                    device: torch.device | str, tp: TensorParallelGroup | None = None
                    ) -> tuple[nn.Module, HFTokenizer]:
    """The model (from `models`, by architecture) and tokenizer of checkpoint dir `path`;
    with `tp`, this rank's shard of the model (every rank reads the whole checkpoint)."""
    path = Path(path)
    config = _read_json(path / "config.json")
    model_class = models[model_kind(config)]
    # generation_config.json's end-of-sequence ids take precedence over config.json's.
    generation = {**config, **_read_json(path / "generation_config.json", required=False)}
    files = safetensors_files(path)
    tokenizer = HFTokenizer.from_dir(path, generation)  # before the weights, which take longer
    model = model_class.from_hf(config, read_state_dict(files), dtype=dtype, device=device, tp=tp)
    return model, tokenizer
