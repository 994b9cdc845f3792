"""The flags every entry point shares (model, device, limits, kvgraph's), and the engine they build.

`--model llama|mla --preset NAME` serves an example model with seeded random weights and a
byte-level tokenizer; `--model PATH` a local Hugging Face checkpoint directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

import kvgraph

from .engine import LLMEngine
from .kv_sizing import add_kv_sizing_args, choose_num_blocks
from .tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

# Tokens per step when neither --max-num-tokens nor KVGRAPH_MAX_NUM_TOKENS says: small enough
# that capturing every size stays quick on a CPU.
DEFAULT_TOKEN_BUDGET = 128
# Context when neither --max-model-len nor a smaller max_position_embeddings says.
DEFAULT_MAX_MODEL_LEN = 1024
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def add_engine_args(parser: argparse.ArgumentParser, preset: str = "small"
                    ) -> argparse.ArgumentParser:
    """Add the engine's flags and kvgraph's (`kvgraph.add_cli_args`) to `parser`."""
    group = parser.add_argument_group("engine", "model, device and limits")
    group.add_argument("--model", default="llama",
                       help="llama or mla (random weights), or a local Hugging Face checkpoint dir")
    group.add_argument("--preset", default=preset, help="size of a random-weight example model")
    group.add_argument("--device", default="cpu")
    group.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    group.add_argument("--attention-backend", help="kvgraph attention backend (default: the "
                       "device's)")
    group.add_argument("--max-num-seqs", type=positive_int, default=16,
                       help="most requests in one step")
    group.add_argument("--max-model-len", type=positive_int,
                       help=f"longest sequence, prompt and output (default: the model's, at most "
                       f"{DEFAULT_MAX_MODEL_LEN})")
    group.add_argument("--block-size", type=positive_int,
                       help="tokens per cache block (default: the device's, 16; 128 on an NPU)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True, help="share the cached KV blocks of common prompt prefixes")
    add_kv_sizing_args(group)
    group.add_argument("--seed", type=int, default=0, help="seeds random weights and sampling")
    kvgraph.add_cli_args(parser)
    return parser


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def load_model(args: argparse.Namespace, models: Mapping[str, Any]) -> tuple[nn.Module, Any]:
    """The model and tokenizer `--model` names; `models` maps names to example model classes."""
    dtype = DTYPES[args.dtype]
    if args.model in models:
        model = models[args.model].from_preset(args.preset, dtype=dtype, device=args.device,
                                               seed=args.seed)
        return model, ByteTokenizer()
    if Path(args.model).is_dir():
        from .checkpoint import load_checkpoint

        return load_checkpoint(args.model, models, dtype, args.device)
    raise ValueError(f"--model {args.model!r} is neither one of {sorted(models)} nor a "
                     "checkpoint directory")


def compilation_config(args: argparse.Namespace) -> kvgraph.CompilationConfig:
    """kvgraph's flags and environment, with this engine's default token budget."""
    config = kvgraph.CompilationConfig.from_cli_args(args)
    if args.max_num_tokens is None and "KVGRAPH_MAX_NUM_TOKENS" not in os.environ:
        config = config.replace(max_num_tokens=DEFAULT_TOKEN_BUDGET)
    return config


def build_engine(args: argparse.Namespace, models: Mapping[str, Any]
                 ) -> tuple[LLMEngine, dict[str, Any]]:
    """Load, compile and capture: the engine, and a summary of its start-up."""
    start = time.perf_counter()
    if args.block_size is None:
        args.block_size = kvgraph.ModelRunner.default_block_size(args.device)
    model, tokenizer = load_model(args, models)
    config = compilation_config(args)
    max_model_len = args.max_model_len or min(model.config.max_position_embeddings,
                                              DEFAULT_MAX_MODEL_LEN)

    def build_runner(num_blocks: int) -> kvgraph.ModelRunner:
        return kvgraph.ModelRunner(
            model, config, num_blocks=num_blocks, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, device=args.device, max_model_len=max_model_len,
            attn_backend=args.attention_backend)

    sizing = choose_num_blocks(args, model, DTYPES[args.dtype], config.max_num_tokens,
                               max_model_len, build_runner)
    runner = build_runner(sizing.num_blocks)
    capture = runner.capture()  # compiles first: a compile error raises here, before serving
    engine = LLMEngine(runner, tokenizer, args.seed, args.enable_prefix_caching)
    summary = {"graph_mode": runner.config.graph_mode.value,
               "descriptors": capture["descriptors"], "graphs": capture["graphs"],
               "graph_bytes": capture["bytes"], "seconds": time.perf_counter() - start,
               "compile": runner.stats()["compile"], "num_blocks": sizing.num_blocks,
               "num_blocks_why": sizing.why}
    logger.info("engine ready in %.1f s: graph mode %s, %d descriptors captured (%d graphs, "
                "%.1f MiB), %d pieces built in %.1f s", summary["seconds"],
                summary["graph_mode"], summary["descriptors"], summary["graphs"],
                summary["graph_bytes"] / 2**20, summary["compile"]["builds"],
                summary["compile"]["compile_seconds"])
    return engine, summary
