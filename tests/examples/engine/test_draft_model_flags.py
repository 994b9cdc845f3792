"""`--speculative-config` with the draft_model method, from the command line to a serving engine
(examples/engine/draft_model_source.py, draft_startup.py, build_engine): what `model` may name
and how a mistake is refused, the engine it builds (its greedy tokens those of decoding without
drafts), and the KV cache it sizes for both models.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest
import torch

import kvgraph
from examples.engine import add_engine_args, build_engine
from examples.engine.draft_model_source import (CheckpointSource, ExampleSource, check_syntax,
                                                resolve)
from examples.engine.kv_sizing import block_bytes, profiling_batch
from examples.engine.preflight import UsageError, check_start
from examples.models import MODELS
from kvgraph.runtime.platforms import get_platform
from tests.support.speculation import GREEDY, PROMPTS, first_layers, tokens
from tests.support.scenario import make_model

FLAGS = ["--preset", "tiny", "--piece-compiler", "eager", "--block-size", "4",
         "--max-num-seqs", "4", "--max-model-len", "64", "--max-num-tokens", "32"]
TARGET_BYTES = block_bytes(make_model("llama"), 4, torch.float32)
DRAFT_BYTES = block_bytes(first_layers("llama", 1), 4, torch.float32)


def spec(model: str, k: int = 2) -> list[str]:
    return ["--speculative-config", json.dumps({"method": "draft_model", "model": model,
                                                "num_speculative_tokens": k})]


def parse(*flags: str) -> argparse.Namespace:
    return add_engine_args(argparse.ArgumentParser()).parse_args([*FLAGS, *flags])


def engine_for(*flags: str):
    return build_engine(parse(*flags), MODELS)


@pytest.mark.parametrize("text, expected, layers", [
    ("llama", ExampleSource("llama", "tiny"), 2),
    ("llama:small", ExampleSource("llama", "small"), 8),
    ("mla:tiny:1", ExampleSource("mla", "tiny", 1), 1),
    ("llama:small:8", ExampleSource("llama", "small", 8), 8),
])
def test_an_example_model_takes_the_target_s_preset_unless_named(text, expected, layers):
    check_syntax(text)
    assert resolve(text, MODELS, "tiny") == expected
    assert expected.config(MODELS)["num_hidden_layers"] == layers


def test_a_directory_is_a_checkpoint_and_a_name_wins_over_one(checkpoint, tmp_path,
                                                              monkeypatch):
    assert resolve(str(checkpoint), MODELS, "tiny") == CheckpointSource(checkpoint)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").mkdir()
    (tmp_path / "draft:1").mkdir()
    assert resolve("llama", MODELS, "tiny") == ExampleSource("llama", "tiny")
    check_syntax("draft:1")  # a directory, though not NAME:PRESET
    assert resolve("draft:1", MODELS, "tiny") == CheckpointSource(Path("draft:1"))


@pytest.mark.parametrize("text, message", [
    ("llama:tiny:x", "'llama:tiny:x': N (the decoder layers kept) must be an integer >= 1, "
                     "got 'x'"),
    ("llama:tiny:0", "must be an integer >= 1, got '0'"),
    ("llama::1", "with no part left empty"),
    ("llama:tiny:1:2", "expected a checkpoint directory, or an example model NAME, NAME:PRESET "
                       "or NAME:PRESET:N"),
])
def test_a_malformed_name_is_refused_as_the_flag_is_parsed(text, message, capsys):
    with pytest.raises(ValueError, match="^" + repr(text)):
        check_syntax(text)
    with pytest.raises(SystemExit):
        parse(*spec(text))
    err = capsys.readouterr().err
    assert "argument --speculative-config: model: " in err and message in err


@pytest.mark.parametrize("text, message", [
    ("lama", "'lama': expected a checkpoint directory, or an example model NAME, NAME:PRESET "
             "or NAME:PRESET:N (N: keep its first N decoder layers), NAME one of "
             "['deepseek_mla', 'llama', 'mla']; got neither an example model nor a checkpoint "
             "directory (no such directory)"),
    ("llama:huge", "'llama:huge': expected a preset of the example model 'llama', one of "
                   f"{sorted(MODELS['llama'].presets)}, got 'huge'"),
    ("llama:tiny:3", "'llama:tiny:3': N (the decoder layers kept) must lie in [1, 2], the layers "
                     "of llama:tiny, got 3"),
    ("/nowhere/draft", "got neither an example model nor a checkpoint directory (no such "
                       "directory)"),
])
def test_what_needs_the_model_table_is_refused_by_the_start_up_checks(text, message):
    with pytest.raises(ValueError) as info:
        resolve(text, MODELS, "tiny")
    assert message in str(info.value)
    with pytest.raises(UsageError) as info:
        check_start(parse(*spec(text)), MODELS)
    assert str(info.value).startswith("--speculative-config model: ")
    assert message in str(info.value)


def test_a_file_is_not_a_checkpoint_directory(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"\(not a directory\)"):
        resolve(str(tmp_path / "file"), MODELS, "tiny")


def test_the_start_up_checks_read_a_checkpoint_draft_s_config(checkpoint, tmp_path):
    check_start(parse("--model", str(checkpoint), *spec(str(checkpoint))), MODELS)
    with pytest.raises(UsageError, match=f"--speculative-config model {tmp_path}: config.json "
                                         "is missing"):
        check_start(parse("--model", str(checkpoint), *spec(str(tmp_path))), MODELS)


def test_a_draft_of_another_vocabulary_is_refused(checkpoint):
    with pytest.raises(UsageError, match="the draft model has vocab_size=256, the target "
                                         r"\(--model llama\) 4096"):
        check_start(parse("--preset", "small", *spec("llama:tiny")), MODELS)
    with pytest.raises(UsageError, match="vocab_size=256"):
        check_start(parse("--model", str(checkpoint), *spec("llama")), MODELS)
    # Built anyway, the engine refuses it before compiling either model.
    with pytest.raises(ValueError, match="vocab_size=256, the target's 4096"):
        engine_for("--preset", "small", *spec("llama:tiny"))


def test_tensor_parallelism_is_refused_before_any_rank_starts(monkeypatch):
    def spawn(*_):
        raise AssertionError("ranks were spawned")
    monkeypatch.setattr("examples.engine.engine_args.start_rank_zero", spawn)
    refusal = ("--speculative-config: draft-model speculation under tensor parallelism "
               "(--tensor-parallel-size 2) is not built: the ngram method works there")
    with pytest.raises(ValueError) as info:
        engine_for("-tp", "2", *spec("llama:tiny:1"))
    assert str(info.value) == refusal
    with pytest.raises(UsageError) as info:
        check_start(parse("-tp", "2", *spec("llama:tiny:1")), MODELS)
    assert str(info.value) == refusal


def test_a_layer_skip_draft_gives_the_greedy_tokens_and_replays_its_graphs(caplog):
    expected = tokens(engine_for()[0].generate(PROMPTS, GREEDY))
    with caplog.at_level(logging.INFO):
        engine, summary = engine_for(*spec("llama:tiny:1"))
    assert tokens(engine.generate(PROMPTS, GREEDY)) == expected
    stats = engine.stats()
    assert stats["spec_decode_accepted_tokens"] > 0
    hits = stats["draft_runner"]["hits"]
    assert sum(n for key, n in hits.items() if key.startswith("full:")) > 0, hits
    draft = engine.speculator.draft.runner
    assert draft.config.num_speculative_tokens == 0
    assert engine.runner.config.num_speculative_tokens == 2
    assert vars(draft.limits) == vars(engine.runner.limits)
    # On the CPU only decode steps are captured: the target's of up to 4 verifying requests of
    # 1 + 2 tokens each, the draft's of up to 4 requests of two tokens (catch-up) or one (its
    # one-token steps are not padded to 3).
    assert engine.runner.config.capture_size_list == (3, 6, 9, 12)
    assert draft.config.capture_size_list == (1, 2, 4, 8)
    assert not any(key.startswith("full:BatchDescriptor(num_tokens=3,") for key in hits), hits
    assert list(summary["stages"]) == ["load weights", "load draft weights", "prepare weights",
                                       "size KV cache", "compile", "capture", "compile draft",
                                       "capture draft"]
    assert summary["draft"]["graphs"] > 0
    assert "draft model the example 'llama' (tiny preset, first 1 layer only" in caplog.text
    engine.close()


def test_a_checkpoint_draft_serves_a_checkpoint_target(checkpoint):
    flags = ["--model", str(checkpoint)]
    expected = tokens(engine_for(*flags)[0].generate(PROMPTS, GREEDY))
    engine, summary = engine_for(*flags, *spec(str(checkpoint), k=3))
    assert tokens(engine.generate(PROMPTS, GREEDY)) == expected
    assert engine.stats()["spec_decode_accepted_tokens"] > 0
    assert summary["draft"]["model"] == f"the checkpoint {checkpoint}"


def test_a_byte_budget_holds_both_models_caches(caplog):
    per_block = TARGET_BYTES + DRAFT_BYTES
    with caplog.at_level(logging.INFO):
        engine, summary = engine_for("--graph-mode", "eager", "--kv-cache-memory",
                                     str(40 * per_block + 7), *spec("llama:tiny:1"))
    assert summary["num_blocks"] == 40
    assert engine.runner.limits.num_blocks == engine.speculator.draft.runner.limits.num_blocks == 40
    assert (f"/ {per_block} ({TARGET_BYTES} the target's + {DRAFT_BYTES} the draft model's) "
            "bytes per block") in caplog.text


class FakeMemory:
    """A device allocator's statistics: `peak` bytes at most, of `total`, none used by others."""

    def __init__(self, peak: int, total: int):
        self.peak, self.total = peak, total

    def synchronize(self, device):
        pass

    def reset_peak_memory_stats(self, device):
        pass

    def max_memory_allocated(self, device):
        return self.peak

    def mem_get_info(self, device):
        return self.total, self.total

    def memory_reserved(self, device):
        return 0


def test_profiling_probes_both_runners_and_counts_both_caches(monkeypatch):
    captured = []
    capture = kvgraph.ModelRunner.capture

    def recording(runner):
        captured.append(runner.model)
        return capture(runner)
    monkeypatch.setattr(kvgraph.ModelRunner, "capture", recording)
    per_block = TARGET_BYTES + DRAFT_BYTES
    probe_blocks = max(16, sum(len(c.block_ids) for c in profiling_batch(32, 64, 4, 4)))
    # The probes' peak: their caches and 1000 bytes more; half the memory leaves 40 blocks.
    memory = FakeMemory(probe_blocks * per_block + 1000, 2 * (1000 + 40 * per_block + 5))
    monkeypatch.setattr(get_platform("cpu"), "device_memory", memory)
    engine, summary = engine_for("--graph-mode", "eager", "--gpu-memory-utilization", "0.5",
                                 *spec("llama:tiny:1"))
    assert summary["num_blocks"] == 40
    target, draft = engine.runner.model, engine.speculator.draft.runner.model
    assert [id(m) for m in captured] == [id(target), id(draft)] * 2  # the probes, then serving
