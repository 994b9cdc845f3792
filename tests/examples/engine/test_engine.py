"""The serving engine: block allocation, continuous batching, preemption, sampling, stopping.

References are independent runs: each prompt alone vs all together, an uninterrupted run vs
one that is preempted, a large token budget vs chunked prefill.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvgraph
from examples.engine import FinishReason, LLMEngine, RequestError, SamplingParams
from examples.engine.block_allocator import BlockAllocator
from examples.engine.detokenizer import Detokenizer
from examples.engine.tokenizer import ByteTokenizer
from examples.models.llama import Llama
from tests.support.engines import BLOCK_SIZE, GREEDY, MAX_MODEL_LEN, PROMPTS, make_engine


@pytest.fixture(scope="module")
def model():
    """Builds the model: one per engine (a model serves one live runner), the same weights."""
    return lambda: Llama.from_preset("tiny", seed=1)


def tokens(completions) -> list[tuple[int, ...]]:
    return [c.token_ids for c in completions]


# --- block allocator -----------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 9)), max_size=60))
def test_allocator_never_hands_out_a_block_twice(operations):
    allocator = BlockAllocator(16)
    held: dict[int, list[int]] = {}  # owner -> its blocks
    for allocate, owner, count in operations:
        if allocate:
            before = allocator.num_free
            blocks = allocator.allocate(count)
            if blocks is None:
                assert count > before and allocator.num_free == before  # all or nothing
                continue
            assert len(blocks) == count
            held.setdefault(owner, []).extend(blocks)
        else:
            allocator.free(held.pop(owner, []))
        every = [b for blocks in held.values() for b in blocks]
        assert len(every) == len(set(every)), "a block is held twice"
        assert len(every) + allocator.num_free == 16


def test_allocator_refuses_a_double_free():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.free(blocks)
    with pytest.raises(ValueError, match="not held"):
        allocator.free(blocks[:1])


# --- scheduling ------------------------------------------------------------------------------

def test_continuous_batching_matches_each_prompt_alone(model):
    engine = make_engine(model)
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    together = tokens(make_engine(model).generate(PROMPTS, GREEDY))
    assert together == alone
    assert all(len(t) == GREEDY.max_tokens for t in together)


def test_chunked_prefill_matches_one_step_prefill(model):
    large = make_engine(model, budget=64)
    small = make_engine(model, budget=8)  # every prompt above 8 tokens is chunked
    assert tokens(small.generate(PROMPTS, GREEDY)) == tokens(large.generate(PROMPTS, GREEDY))
    assert small.num_steps > large.num_steps


@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
def test_preempted_requests_resume_with_the_same_tokens(model, mode):
    reference = tokens(make_engine(model, mode).generate(PROMPTS, GREEDY))
    # 24 blocks of 4 tokens: one 41 + 12 token sequence needs 14, so four at once cannot fit.
    tight = make_engine(model, mode, num_blocks=24)
    assert tokens(tight.generate(PROMPTS, GREEDY)) == reference
    stats = tight.stats()
    assert stats["preemptions"] > 0
    assert stats["kv_blocks_free"] == 24


def test_abort_frees_blocks_at_once(model):
    engine = make_engine(model)
    engine.add_request(PROMPTS[3], GREEDY, "a")
    kept = engine.add_request(PROMPTS[4], GREEDY, "b")
    engine.step()
    assert engine.allocator.num_free < engine.allocator.num_blocks
    assert engine.abort("a") and not engine.abort("a")
    assert engine.allocator.num_free == engine.allocator.num_blocks - len(kept.block_ids)
    while engine.has_unfinished:
        engine.step()
    assert kept.finish_reason is FinishReason.LENGTH
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_requests_beyond_the_context_are_refused(model):
    engine = make_engine(model)
    with pytest.raises(RequestError, match="max_model_len") as error:
        engine.add_request([1] * MAX_MODEL_LEN, GREEDY)
    assert error.value.param == "prompt"
    with pytest.raises(RequestError, match="exceeds the context") as error:
        engine.add_request([1] * 90, SamplingParams(max_tokens=7))
    assert error.value.param == "max_tokens"
    with pytest.raises(RequestError) as error:
        SamplingParams(top_p=0)
    assert error.value.param == "top_p"


# --- sampling --------------------------------------------------------------------------------

def test_seeded_sampling_repeats_whatever_the_batch(model):
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=7,
                             ignore_eos=True)
    alone = make_engine(model).generate([PROMPTS[2]], sampled)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in range(3)]
    batch = make_engine(model).generate(PROMPTS[:4], [*others[:2], sampled, others[2]])
    assert batch[2].token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=8)
    assert make_engine(model).generate([PROMPTS[2]], other_seed)[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    greedy = tokens(make_engine(model).generate(PROMPTS, GREEDY))
    for params in (SamplingParams(max_tokens=12, temperature=2.0, top_k=1, ignore_eos=True),
                   SamplingParams(max_tokens=12, temperature=2.0, top_p=1e-6, ignore_eos=True)):
        assert tokens(make_engine(model).generate(PROMPTS, params)) == greedy


def test_sampled_tokens_stay_in_the_top_k(model):
    engine = make_engine(model)
    logits = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    requests = [engine.add_request([1], SamplingParams(temperature=5.0, top_k=3, seed=i))
                for i in range(3)]
    for _ in range(20):
        picked = engine.sampler(logits, requests)
        top3 = logits.topk(3).indices.tolist()
        assert all(token in row for token, row in zip(picked, top3))


# --- stopping --------------------------------------------------------------------------------

class LetterTokenizer(ByteTokenizer):
    """Every token a letter, so stop strings can be chosen from a reference text; token 5 is
    end-of-sequence."""

    eos_token_ids = frozenset({5})

    def decode(self, token_ids):
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


def test_max_tokens_stop_tokens_and_eos(model):
    reference = make_engine(model).generate([PROMPTS[5]], GREEDY)[0].token_ids
    stop_token = reference[4]
    first = reference.index(stop_token)
    stopped = make_engine(model).generate(
        [PROMPTS[5]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_token,)))
    assert stopped[0].token_ids == reference[:first + 1]
    assert stopped[0].finish_reason is FinishReason.STOP
    short = make_engine(model).generate([PROMPTS[5]], SamplingParams(max_tokens=3, temperature=0))
    assert short[0].token_ids == reference[:3] and short[0].finish_reason is FinishReason.LENGTH

    class EosTokenizer(ByteTokenizer):
        eos_token_ids = frozenset({stop_token})

    eos = make_engine(model, tokenizer=EosTokenizer()).generate(
        [PROMPTS[5]], SamplingParams(max_tokens=12, temperature=0))
    assert eos[0].token_ids == reference[:first + 1]
    assert eos[0].finish_reason is FinishReason.STOP


def test_stop_strings_cut_the_text(model):
    tokenizer = LetterTokenizer()
    engine = make_engine(model, tokenizer=tokenizer)
    reference = engine.generate([PROMPTS[6]], GREEDY)[0]
    stop = reference.text[5:7]
    cut = reference.text.index(stop)
    params = SamplingParams(max_tokens=12, temperature=0, stop=("zzzzzz", stop), ignore_eos=True)
    stopped = engine.generate([PROMPTS[6]], params)[0]
    assert stopped.text == reference.text[:cut]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == reference.token_ids[:cut + len(stop)]


def test_streamed_text_is_final_and_omits_the_stop_string():
    text = "h\u00e9llo, w\u00f6rld"
    ids = list(text.encode())
    detokenizer = Detokenizer(ByteTokenizer(), stop=("w\u00f6r",))
    deltas = []
    for token in ids:
        stopped = detokenizer.add(token)
        deltas.append(detokenizer.take(stopped))
        assert "\ufffd" not in deltas[-1]  # half a character is never sent
        if stopped:
            break
    assert "".join(deltas) == "h\u00e9llo, "


def test_the_engine_takes_its_limits_from_the_runner_and_keeps_no_copy(model):
    engine = make_engine(model, num_blocks=30, max_num_seqs=3, budget=16)
    limits = engine.runner.limits
    assert (limits.num_blocks, limits.max_num_seqs, limits.max_num_tokens) == (30, 3, 16)
    assert engine.allocator.num_blocks == limits.num_blocks
    assert (engine.scheduler.block_size, engine.scheduler.max_num_seqs,
            engine.scheduler.token_budget) == (limits.block_size, 3, 16)
    context = f"context \\(max_model_len\\) is {limits.max_model_len}"
    with pytest.raises(RequestError, match=context):
        engine.check([1] * limits.max_model_len, GREEDY)


def test_an_engine_over_a_runner_too_small_for_one_sequence_is_refused(model):
    config = kvgraph.CompilationConfig(graph_mode="eager")
    runner = kvgraph.ModelRunner(model(), config, num_blocks=8, block_size=BLOCK_SIZE,
                                 max_num_seqs=2, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="num_blocks=8 cannot hold one sequence"):
        LLMEngine(runner, ByteTokenizer())
