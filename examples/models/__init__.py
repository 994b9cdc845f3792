"""Example models whose attention runs through kvgraph: Llama-style GQA and DeepSeek-style MLA."""

from .deepseek_mla import DeepseekMLA
from .llama import Llama

# The example models by the name `--model` gives (checkpoint loading maps HF architectures to
# these names: examples/engine/checkpoint.py). A plain dict: the engine process is sent it
# pickled. "deepseek_mla" is the name earlier versions of the demos used.
MODELS = {"llama": Llama, "mla": DeepseekMLA, "deepseek_mla": DeepseekMLA}

__all__ = ["MODELS", "DeepseekMLA", "Llama"]
