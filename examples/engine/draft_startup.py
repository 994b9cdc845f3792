"""The draft model's share of the engine's start-up (`--speculative-config` with the
`draft_model` method): its weights loaded, its runner built beside the target's and compiled
and captured, each in a start-up stage of its own.

The draft's runner has the target's settings (device, dtype, attention backend, block size,
blocks, requests per step, context) so that it runs the target's requests in the target's
block tables, and the target's CompilationConfig less speculation (it proposes one token per
request a step) with a debug dump of its own, under the target's.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

import kvgraph
from kvgraph.inspect import units

from .draft_model import check_draft_runner
from .draft_model_source import ModelSource, resolve
from .kv_sizing import RunnerFactory
from .startup_stages import StartupStages

# The draft runner's debug dump, inside the target's (its own would empty the target's).
DUMP_DIR = "draft_model"
# Tokens a request runs in the draft's steps, at most, when proposing for decoding requests:
# two in its catch-up step (the target's token after the drafts, and the last draft when all
# were accepted), one in the others. Where only decode steps are captured, the draft's are
# captured up to this many tokens a request.
DRAFT_QUERY_LEN = 2


@dataclass(frozen=True)
class DraftBuild:
    """The draft model's runner, captured, what it was loaded from and its capture summary."""

    runner: kvgraph.ModelRunner
    source: str
    capture: dict[str, Any]

    def summary(self) -> dict[str, Any]:
        return {"model": self.source, "descriptors": self.capture["descriptors"],
                "graphs": self.capture["graphs"], "graph_bytes": self.capture["bytes"]}

    def said(self) -> str:
        """The start-up log's words on it."""
        return (f"; draft model {self.source}: {self.capture['descriptors']} descriptors "
                f"captured ({self.capture['graphs']} graphs, "
                f"{units.size(self.capture['bytes'])})")


def draft_source(args: argparse.Namespace, models: Mapping[str, Any]) -> ModelSource | None:
    """What the flags' draft model is loaded from; None without one."""
    spec = getattr(args, "speculative_config", None)
    if spec is None or spec.method != "draft_model":
        return None
    return resolve(spec.model, models, args.preset)


def refuse_under_tensor_parallelism(args: argparse.Namespace, world_size: int) -> None:
    """A ValueError for a draft model with `world_size` > 1 ranks."""
    spec = getattr(args, "speculative_config", None)
    if world_size > 1 and spec is not None and spec.method == "draft_model":
        raise ValueError(f"--speculative-config: draft-model speculation under tensor "
                         f"parallelism (--tensor-parallel-size {world_size}) is not built: the "
                         "ngram method works there")


def load_draft(source: ModelSource, args: argparse.Namespace, models: Mapping[str, Any],
               dtype: torch.dtype, stages: StartupStages) -> nn.Module:
    """The draft model, in the target's dtype on this rank's device (`args.device`)."""
    with stages.stage("load draft weights", f"loading the draft model, {source}"):
        return source.load(models, dtype, args.device, args.seed)


def draft_config(config: kvgraph.CompilationConfig) -> kvgraph.CompilationConfig:
    """The draft's runner's config: `config` (the flags' config `without_speculation`: the
    device's default capture sizes are then the draft's steps', DRAFT_QUERY_LEN tokens a
    request at most, not the target's, rounded up to whole verify steps) with a debug dump
    of its own."""
    dump = config.debug_dump_path
    return config.replace(num_speculative_tokens=0,
                          debug_dump_path=dump and str(Path(dump) / DUMP_DIR))


def without_speculation(args: argparse.Namespace) -> argparse.Namespace:
    """`args` less `--speculative-config`: the flags the draft's config is made from."""
    return argparse.Namespace(**{**vars(args), "speculative_config": None})


def draft_runner(build_runner: RunnerFactory, target: kvgraph.ModelRunner
                 ) -> kvgraph.ModelRunner:
    """The draft's runner with the target's blocks, checked against the target's runner
    before either compiles (a draft of another vocabulary costs no compile)."""
    runner = build_runner(target.limits.num_blocks)
    check_draft_runner(runner, target)
    return runner


def start_draft(runner: kvgraph.ModelRunner, source: ModelSource, stages: StartupStages
                ) -> DraftBuild:
    """Compile and capture the draft's `runner`."""
    with stages.stage("compile draft", "compiling the draft model"):
        runner.compile()
    with stages.stage("capture draft", "capturing the draft model's graphs"):
        return DraftBuild(runner, str(source), runner.capture())
