"""Loading a local Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer.json.

Nothing is downloaded. `safetensors` and `tokenizers` are imported only here, when a
checkpoint is asked for.
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


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.exists():
        if required:
            raise FileNotFoundError(f"checkpoint: {path} is missing")
        return {}
    return json.loads(path.read_text())


def model_kind(config: Mapping[str, Any]) -> str:
    """Which example model serves a checkpoint's `config.json`; a clear error if none does."""
    architectures = config.get("architectures") or []
    for architecture in architectures:
        if architecture in ARCHITECTURES:
            return ARCHITECTURES[architecture]
    raise NotImplementedError(
        f"checkpoint: architectures {architectures} are not served by these examples; "
        f"supported: {sorted(ARCHITECTURES)}")


def safetensors_files(path: Path) -> list[Path]:
    """The `*.safetensors` files of `path` (several for a sharded checkpoint); at least one."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint: no *.safetensors file in {path}")
    return files


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
