"""Logprobs: each output's token log-probability and top alternatives, against a no-cache full
recompute of the sequence; and their shape in the OpenAI API, streamed or not."""

from __future__ import annotations

import pytest
import torch

import kvgraph
from examples.engine import LLMEngine, SamplingParams
from examples.engine.tokenizer import ByteTokenizer
from examples.models.llama import Llama

BLOCK_SIZE = 4
PROMPTS = [[(5 * i + 3 * j) % 256 for j in range(4 + 7 * i)] for i in range(3)]


def reference_logprobs(sequence: list[int]) -> torch.Tensor:
    """log-softmax of the next-token logits after `sequence`, recomputed from scratch."""
    runner = kvgraph.ModelRunner(Llama.from_preset("tiny", seed=1),
                                 kvgraph.CompilationConfig(graph_mode="eager"),
                                 num_blocks=32, block_size=BLOCK_SIZE, max_num_seqs=1,
                                 max_num_tokens=64)
    blocks = list(range(-(-len(sequence) // BLOCK_SIZE)))
    logits = runner.execute([kvgraph.RequestChunk(sequence, 0, blocks)])
    runner.close()
    return torch.log_softmax(logits[0].double(), dim=-1)


def make_engine(mode: str, max_num_tokens: int) -> LLMEngine:
    config = kvgraph.CompilationConfig(graph_mode=mode, piece_compiler="eager",
                                       max_num_tokens=max_num_tokens, capture_sizes=(1, 2, 4, 8))
    runner = kvgraph.ModelRunner(Llama.from_preset("tiny", seed=1), config, num_blocks=64,
                                 block_size=BLOCK_SIZE, max_num_seqs=4, max_model_len=64)
    runner.capture()
    return LLMEngine(runner, ByteTokenizer())


@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
def test_logprobs_are_the_models_distribution_for_the_sampled_token(mode):
    engine = make_engine(mode, max_num_tokens=32)
    asks = [3, None, 0]  # greedy with 3 alternatives; no logprobs; sampled, the token alone
    params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=asks[0]),
              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=1.0, seed=7, ignore_eos=True,
                             logprobs=asks[2])]
    requests = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    outputs = {r.request_id: [] for r in requests}
    while engine.has_unfinished:
        for output in engine.step():
            outputs[output.request_id].append(output)
    for request, k in zip(requests, asks):
        for i, output in enumerate(outputs[request.request_id]):
            if k is None:
                assert output.logprobs is None
                continue
            (token,) = output.token_ids
            want = reference_logprobs(request.prompt_token_ids + request.output_token_ids[:i])
            got = output.logprobs
            assert got.token_id == token
            assert got.logprob == pytest.approx(want[token].item(), abs=1e-4)
            assert len(got.top) == k
            top_ids = want.topk(k).indices.tolist()
            assert [t for t, _ in got.top] == top_ids
            for t, lp in got.top:
                assert lp == pytest.approx(want[t].item(), abs=1e-4)
            if k and request.params.greedy:
                assert got.top[0][0] == token  # greedy picks the most likely token


@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
def test_prompt_logprobs_equal_a_full_recompute_through_chunked_prefill(mode):
    # A budget of 8 tokens a step: the 21-token prompt is prefilled in three chunks, beside a
    # second request, so the prompt's rows sit at different offsets of different steps.
    engine = make_engine(mode, max_num_tokens=8)
    prompt = [(11 * j + 5) % 256 for j in range(21)]
    scored = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0,
                                                       ignore_eos=True, prompt_logprobs=2))
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    firsts = {}
    while engine.has_unfinished:
        for output in engine.step():
            firsts.setdefault(output.request_id, output)
    entries = firsts[scored.request_id].prompt_logprobs
    assert len(entries) == len(prompt)
    assert entries[0].token_id == prompt[0] and entries[0].logprob is None
    for q in range(1, len(prompt)):
        want = reference_logprobs(prompt[:q])
        assert entries[q].token_id == prompt[q]
        assert entries[q].logprob == pytest.approx(want[prompt[q]].item(), abs=1e-4), q
        assert [t for t, _ in entries[q].top] == want.topk(2).indices.tolist()
    assert all(o.prompt_logprobs is None for rid, o in firsts.items() if rid != scored.request_id)
