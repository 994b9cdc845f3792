"""Example models whose attention runs through kvgraph: Llama-style GQA and DeepSeek-style MLA."""

from .deepseek_mla import DeepseekMLA
from .llama import Llama

__all__ = ["DeepseekMLA", "Llama"]
