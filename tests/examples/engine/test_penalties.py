"""Presence, frequency and repetition penalties: the batch ops against a per-token float64
reference of vLLM's definition, and their effect end to end."""

from __future__ import annotations

import random

import pytest
import torch

import kvgraph
from examples.engine import LLMEngine, RequestError, SamplingParams
from examples.engine.detokenizer import Detokenizer
from examples.engine.penalties import apply_penalties
from examples.engine.request import Request
from examples.engine.tokenizer import ByteTokenizer
from examples.models.llama import Llama

VOCAB = 50


def request(prompt, output, **penalties) -> Request:
    params = SamplingParams(**penalties)
    r = Request("r", list(prompt), params, Detokenizer(ByteTokenizer(), ()), 0.0)
    r.output_token_ids = list(output)
    return r


def reference(logits: torch.Tensor, r: Request) -> torch.Tensor:
    out = logits.double().clone()
    p = r.params
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(r.output_token_ids):
        count = r.output_token_ids.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_the_batch_ops_equal_the_per_token_reference():
    rng = random.Random(0)
    requests = [
        request([rng.randrange(VOCAB) for _ in range(9)], [rng.randrange(VOCAB) for _ in range(12)],
                presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3),
        request([1, 2, 3], [], repetition_penalty=0.8),  # no output yet
        request([4, 5], [5, 5, 6]),  # no penalties: left as it is
        request([7], [8, 8, 8, 9], presence_penalty=-1.0, frequency_penalty=2.0),
    ]
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(0))
    got = apply_penalties(logits, requests)
    for row, r in enumerate(requests):
        torch.testing.assert_close(got[row].double(), reference(logits[row], r), atol=1e-5,
                                   rtol=1e-5)
    assert torch.equal(got[2], logits[2])


def test_a_large_frequency_penalty_stops_greedy_decoding_from_repeating_itself():
    config = kvgraph.CompilationConfig(graph_mode="piecewise", piece_compiler="eager",
                                       max_num_tokens=32, capture_sizes=(1, 2, 4, 8))
    runner = kvgraph.ModelRunner(Llama.from_preset("tiny", seed=1), config, num_blocks=64,
                                 block_size=4, max_num_seqs=2, max_model_len=64)
    runner.capture()
    engine = LLMEngine(runner, ByteTokenizer())
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain, penalised = engine.generate(
        [prompt, prompt],
        [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
         SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=2.0,
                        presence_penalty=2.0)])
    assert len(set(plain.token_ids)) < 24, "the tiny model repeats itself without a penalty"
    assert len(set(penalised.token_ids)) == 24


@pytest.mark.parametrize("name, value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                         ("repetition_penalty", 0.0)])
def test_penalties_out_of_range_are_refused_naming_them(name, value):
    with pytest.raises(RequestError, match=name):
        SamplingParams(**{name: value})
