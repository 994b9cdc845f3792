"""Speculative decoding with the engine's other features (issue 47): prefix caching, aborts, stop
strings, several seeded choices of one prompt (the server's `n`), the shared-storage KV
connector, and the HTTP server.

References are independent of speculation: the same engine (same tiny model, same weights)
without a speculative config gives the tokens, text and cache contents each test compares
with; drafts and accepted tokens are counted by the engine (`stats()`), so a test can check it
really ran verify steps, and that some drafts were rejected where rejections matter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch

from examples.engine import FinishReason, LLMEngine, SamplingParams
from examples.engine.block_allocator import blocks_for
from examples.engine.tokenizer import ByteTokenizer
from tests.support.engines import BLOCK_SIZE
from tests.support.speculation import GREEDY, NGRAM, PROMPTS, PROPOSERS, build, tokens

# The tests marked so run with each proposer: n-gram lookup and the draft model.
EACH_PROPOSER = pytest.mark.parametrize("spec", list(PROPOSERS.values()), ids=list(PROPOSERS))

# Six blocks of a common prefix, then two different tails.
PREFIX = [5, 6, 7, 8] * 6
SHARING = [PREFIX + [20, 21, 22, 20, 21], PREFIX + [30, 31, 30, 31, 30, 31]]


def alone(prompt, params=GREEDY) -> tuple[int, ...]:
    """The reference: `prompt`'s tokens on a fresh engine without speculation."""
    return build().generate([prompt], params)[0].token_ids


def assert_some_drafts_rejected(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats["spec_decode_drafts"] > 0
    assert stats["spec_decode_accepted_tokens"] < stats["spec_decode_draft_tokens"], {
        k: v for k, v in stats.items() if k.startswith("spec_decode")}


def block_rows(engine: LLMEngine, block_ids) -> list[torch.Tensor]:
    """Every layer's cache rows of `block_ids` (copies, in that order)."""
    return [t[list(block_ids)].clone()
            for _, cache in sorted(engine.runner.kv_caches.items()) for t in cache]


def run_until_first_token(engine: LLMEngine, prompt, params=GREEDY):
    request = engine.add_request(prompt, params)
    while not request.output_token_ids:
        engine.step()
    return request


# --- 1. prefix caching -------------------------------------------------------------------------


@EACH_PROPOSER
def test_requests_sharing_a_prefix_give_the_tokens_and_hit_the_prefix_cache(spec):
    def run(config):
        e = build(config)
        return [e.generate([p], GREEDY)[0].token_ids for p in SHARING], e

    expected, plain = run(None)
    got, speculating = run(spec)
    assert got == expected
    assert speculating.stats()["spec_decode_accepted_tokens"] > 0
    # The second request found the six blocks of the prefix the first one computed.
    assert speculating.stats()["prefix_cache_hit_tokens"] == len(PREFIX)
    assert plain.stats()["prefix_cache_hit_tokens"] == len(PREFIX)


@EACH_PROPOSER
def test_a_request_admitted_while_another_speculates_shares_its_decoded_blocks(spec):
    e = build(spec)
    first = e.add_request(PROMPTS[0], GREEDY)
    while not (len(first.output_token_ids) >= 9 and first.spec_token_ids):
        e.step()
    # Its prompt is the first's tokens so far and one more: it shares the blocks the first has
    # decoded (drafts included) while the first goes on speculating.
    prompt = first.all_token_ids + [77]
    computed = (len(first.all_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    second = e.add_request(prompt, GREEDY)
    while e.has_unfinished:
        e.step()
    assert e.stats()["prefix_cache_hit_tokens"] == computed > len(PROMPTS[0])
    assert e.stats()["spec_decode_accepted_tokens"] > 0
    assert tuple(first.output_token_ids) == alone(PROMPTS[0])
    assert tuple(second.output_token_ids) == alone(prompt)


@EACH_PROPOSER
@pytest.mark.parametrize("kind, mode", [("llama", "eager"), ("deepseek_mla", "eager"),
                                        ("llama", "full_and_piecewise")])
@pytest.mark.parametrize("first_params", [
    GREEDY, SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)],
    ids=["greedy", "sampled"])
def test_cached_blocks_never_hold_rejected_drafts(spec, first_params, kind, mode):
    """A request whose drafts were (partly) rejected leaves its blocks in the prefix cache; a
    request continuing its text shares them all and must get the tokens (and, block by block,
    the cache contents) of a fresh engine that computed that text as a prompt."""
    if spec.method == "draft_model" and first_params is not GREEDY:
        # At 0.9 the tiny models' distributions are near uniform, the draft's close enough to
        # the target's that it may have every draft accepted.
        first_params = dataclasses.replace(first_params, temperature=0.5)
    e = build(spec, kind=kind, mode=mode)
    (first,) = e.generate(PROMPTS[3:], first_params)
    assert_some_drafts_rejected(e)
    prompt = list(first.prompt_token_ids + first.token_ids)
    shareable = (len(prompt) - 1) // BLOCK_SIZE
    second = run_until_first_token(e, prompt)
    assert e.stats()["prefix_cache_hit_tokens"] == shareable * BLOCK_SIZE

    reference = build(kind=kind, mode=mode)
    fresh = run_until_first_token(reference, prompt)
    assert reference.stats()["prefix_cache_hit_tokens"] == 0
    cached = block_rows(e, second.block_ids[:shareable])
    computed = block_rows(reference, fresh.block_ids[:shareable])
    for got, want in zip(cached, computed):
        # Per block, so a failure names it (a rejected draft's entry is off by far more).
        for i in range(shareable):
            assert torch.allclose(got[i], want[i], atol=1e-4, rtol=1e-4), (
                f"cached block {i} (tokens {i * BLOCK_SIZE}..{(i + 1) * BLOCK_SIZE - 1}) "
                "differs from a fresh prefill's")
    while e.has_unfinished:
        e.step()
    while reference.has_unfinished:
        reference.step()
    assert tuple(second.output_token_ids) == tuple(fresh.output_token_ids)


# --- 2. abort ----------------------------------------------------------------------------------


@EACH_PROPOSER
def test_aborting_a_request_that_holds_drafts_frees_its_blocks_and_leaves_the_others_alone(spec):
    e = build(spec)
    start = e.allocator.num_free
    requests = [e.add_request(p, GREEDY) for p in PROMPTS]
    victim = requests[2]
    # Abort it between steps once it has drafts for its next step and holds a block beyond what
    # its tokens need (one only rejected drafts were written to).
    while not (victim.spec_token_ids
               and len(victim.block_ids) > blocks_for(victim.num_tokens, BLOCK_SIZE)):
        assert e.has_unfinished and not victim.finished, "never held drafts and a spare block"
        e.step()
    assert not victim.finished
    held = set(victim.block_ids)
    assert e.abort(victim.request_id)
    assert victim.finish_reason is FinishReason.ABORT
    assert e.stats()["aborted"] == 1
    # The blocks only it held are free again (the cached ones stay cached, free).
    assert not held & {b for r in requests if r is not victim for b in r.block_ids}
    while e.has_unfinished:
        outputs = e.step()
        assert all(o.request_id != victim.request_id for o in outputs)
    assert e.allocator.num_free == start
    assert e.stats()["kv_blocks_free"] == e.stats()["kv_blocks_total"]
    assert e.stats()["running"] == e.stats()["waiting"] == 0
    others = [r for r in requests if r is not victim]
    expected = tokens(build().generate([r.prompt_token_ids for r in others], GREEDY))
    assert [tuple(r.output_token_ids) for r in others] == expected
    assert e.stats()["spec_decode_accepted_tokens"] > 0

    # What the aborted request left in the prefix cache holds no draft either.
    prompt = victim.all_token_ids
    assert tokens(e.generate([prompt], GREEDY)) == [alone(prompt)]
    assert e.stats()["prefix_cache_hit_tokens"] >= (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert e.allocator.num_free == start


@EACH_PROPOSER
def test_aborting_every_request_mid_speculation_frees_every_block(spec):
    e = build(spec)
    start = e.allocator.num_free
    requests = [e.add_request(p, GREEDY) for p in PROMPTS]
    while not any(r.spec_token_ids for r in requests):
        e.step()
    for r in requests:
        if not r.finished:
            assert e.abort(r.request_id)
    assert not e.has_unfinished
    assert e.allocator.num_free == start


# --- 3. stop strings ---------------------------------------------------------------------------


def steps_of(engine: LLMEngine, prompts, params) -> tuple[list, list[list[list[int]]]]:
    """Run `prompts`; the requests, and for each one the tokens of each step that gave some."""
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    groups: list[list[list[int]]] = [[] for _ in requests]
    index = {r.request_id: i for i, r in enumerate(requests)}
    while engine.has_unfinished:
        step: dict[str, list[int]] = {}
        for output in engine.step():
            step.setdefault(output.request_id, []).extend(output.token_ids)
        for request_id, ids in step.items():
            groups[index[request_id]].append(ids)
    return requests, groups


class Latin1Tokenizer(ByteTokenizer):
    """One character per byte token (the tiny model's bytes are mostly not UTF-8), so any run of
    output tokens is a stop string that ends exactly at its last token."""

    def decode(self, token_ids) -> str:
        return bytes(t for t in token_ids if t < 256).decode("latin-1")


def stop_inside_a_step(groups: list[list[int]], output: tuple[int, ...]) -> tuple[str, int]:
    """A stop string that the speculating run completes at a token followed by more tokens of
    the same step, and that appears nowhere before it; and that token's index."""
    position = 0
    for group in groups:
        for j in range(len(group) - 1):
            i = position + j
            for length in (1, 2, 3):
                if i + 1 - length < 0:
                    continue
                stop = Latin1Tokenizer().decode(output[i + 1 - length:i + 1])
                if stop not in Latin1Tokenizer().decode(output[:i]):
                    return stop, i
        position += len(group)
    raise AssertionError(f"no step of several tokens completes a new stop string: {groups}")


@EACH_PROPOSER
def test_a_stop_string_completed_inside_a_step_ends_where_decoding_without_drafts_does(spec):
    latin1 = Latin1Tokenizer()
    _, groups = steps_of(build(spec, tokenizer=latin1), PROMPTS, [GREEDY] * len(PROMPTS))
    reference_outputs = tokens(build(tokenizer=latin1).generate(PROMPTS, GREEDY))
    found = []
    for r, (output, request_groups) in enumerate(zip(reference_outputs, groups)):
        try:
            found.append((r, *stop_inside_a_step(request_groups, output)))
        except AssertionError:
            continue
    assert found, groups
    for r, stop, index in found:
        params = [GREEDY] * len(PROMPTS)
        params[r] = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
        expected = build(tokenizer=latin1).generate(PROMPTS, params)
        speculating = build(spec, tokenizer=latin1)
        requests, _ = steps_of(speculating, PROMPTS, params)
        assert speculating.stats()["spec_decode_accepted_tokens"] > 0
        assert expected[r].finish_reason is FinishReason.STOP
        assert len(expected[r].token_ids) == index + 1  # the stop string's last token is last
        for request, want in zip(requests, expected):
            assert (tuple(request.output_token_ids), request.detokenizer.text,
                    request.finish_reason) == (want.token_ids, want.text, want.finish_reason), (
                stop, request.request_id)
        assert stop not in requests[r].detokenizer.text


def test_streamed_text_with_a_stop_string_equals_the_text_without_drafts():
    """The deltas a request streams add up to the final text, cut where decoding without drafts
    cuts it, for stop strings of one to four characters ending all along the output."""
    latin1 = Latin1Tokenizer()
    text = build(tokenizer=latin1).generate(PROMPTS[3:], GREEDY)[0].text
    assert len(text) == GREEDY.max_tokens
    for start, length in [(0, 1), (3, 2), (6, 3), (9, 4), (13, 2), (17, 3), (21, 3)]:
        stop = text[start:start + length]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
        want = build(tokenizer=latin1).generate(PROMPTS[3:], params)[0]
        assert want.finish_reason is FinishReason.STOP
        e = build(NGRAM, tokenizer=latin1)
        request = e.add_request(PROMPTS[3], params)
        streamed = ""
        while e.has_unfinished:
            streamed += "".join(o.text for o in e.step())
        assert (tuple(request.output_token_ids), streamed, request.finish_reason) == (
            want.token_ids, want.text, want.finish_reason), stop
        assert e.stats()["spec_decode_drafts"] > 0 or len(want.token_ids) < 8


# --- 4. n > 1: one prompt, several seeded requests -----------------------------------------------


SAMPLED = SamplingParams(max_tokens=20, temperature=0.8, seed=1234, ignore_eos=True)


def choices(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The server's split of `n` choices into requests (http_app._nth_choice): seed + i each."""
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


def run_choices(engine: LLMEngine, prompt, params: list[SamplingParams], staggered: bool
                ) -> list[tuple[int, ...]]:
    """All at once, or as the server starts them: each after the one before has its first token
    (so the later ones find the prompt in the prefix cache)."""
    requests = []
    for sp in params:
        request = engine.add_request(prompt, sp)
        requests.append(request)
        while staggered and not request.output_token_ids:
            engine.step()
    while engine.has_unfinished:
        engine.step()
    return [tuple(r.output_token_ids) for r in requests]


@EACH_PROPOSER
def test_seeded_choices_of_one_prompt_are_reproducible_with_speculation(spec):
    params = choices(SAMPLED, 3)
    first = build(spec)
    together = run_choices(first, PROMPTS[1], params, staggered=False)
    assert first.stats()["spec_decode_drafts"] > 0
    assert len(set(together)) == 3, together  # each choice draws from its own seed
    again = build(spec)
    assert run_choices(again, PROMPTS[1], params, staggered=False) == together
    staggered = build(spec)
    assert run_choices(staggered, PROMPTS[1], params, staggered=True) == together
    assert staggered.stats()["prefix_cache_hit_tokens"] > 0
    # And each choice alone, with no other request in its steps.
    assert [build(spec).generate([PROMPTS[1]], sp)[0].token_ids for sp in params] == together


def test_a_seeded_choice_with_greedy_siblings_is_reproducible_and_greedy_ones_are_exact():
    params = [SAMPLED, GREEDY, choices(SAMPLED, 2)[1], GREEDY]
    runs = [run_choices(build(NGRAM), PROMPTS[0], params, staggered=False) for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0][1] == runs[0][3] == alone(PROMPTS[0])


def test_seeded_choices_under_a_tight_token_budget_are_reproducible_run_to_run():
    params = choices(SAMPLED, 4)
    runs = []
    for _ in range(2):
        e = build(NGRAM, budget=8)  # 4 decodes with 3 drafts each do not fit: drafts are cut
        runs.append(run_choices(e, PROMPTS[1], params, staggered=False))
        assert e.stats()["spec_decode_drafts"] > 0
    assert runs[0] == runs[1]
    # Without speculation a seeded request's tokens do not depend on its batch at all.
    plain = run_choices(build(budget=8), PROMPTS[1], params, staggered=False)
    assert plain == [build(budget=8).generate([PROMPTS[1]], sp)[0].token_ids for sp in params]


@pytest.mark.parametrize("params", [
    dataclasses.replace(SAMPLED, temperature=0.5),
    dataclasses.replace(SAMPLED, temperature=1.1, top_k=20, top_p=0.9)],
    ids=["temperature", "top-k and top-p"])
def test_n_gram_drafts_leave_a_seeded_request_the_tokens_it_samples_without_them(params):
    """One-hot drafts are verified by the rows' own picks (rejection_sampler.py), and a seeded
    request's generator keeps one draw per emitted token: alone, or with siblings in a budget
    that cuts its drafts, its tokens are those of an engine without speculation."""
    params = choices(params, 4)
    without = [build(budget=8).generate([PROMPTS[1]], sp)[0].token_ids for sp in params]
    e = build(NGRAM, budget=8)
    assert run_choices(e, PROMPTS[1], params, staggered=False) == without
    stats = e.stats()
    assert stats["spec_decode_accepted_tokens"] < stats["spec_decode_draft_tokens"]
    # The tiny model's near-uniform rows rarely pick a lookup's draft but with a top-k.
    assert stats["spec_decode_accepted_tokens"] > 0 or not params[0].top_k
    assert [build(NGRAM, budget=8).generate([PROMPTS[1]], sp)[0].token_ids
            for sp in params] == without


# --- 5. the shared-storage KV connector ----------------------------------------------------------


@EACH_PROPOSER
def test_a_second_engine_loading_the_first_ones_saved_blocks_gives_the_tokens(spec, tmp_path):
    expected = [alone(p) for p in SHARING]
    writer = build(spec, store=tmp_path)
    try:
        assert [writer.generate([p], GREEDY)[0].token_ids for p in SHARING] == expected
        assert writer.stats()["spec_decode_accepted_tokens"] > 0
    finally:
        writer.close()
    reader = build(spec, store=tmp_path)
    try:
        got = tokens(reader.generate(SHARING, GREEDY))  # together: both load
        stats = reader.stats()
    finally:
        reader.close()
    assert got == expected
    assert stats["kv_connector_loaded_tokens"] >= sum(
        (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in SHARING)
    assert stats["runner"]["kv_connector"]["load_failures"] == 0
    assert stats["spec_decode_accepted_tokens"] > 0


def saved_blocks(store, prompts) -> list[list[bool]]:
    """For each prompt, which of its full blocks (the last token's aside) `store` has a file of."""
    from kvgraph.kv_transfer import chain_hashes

    return [[store.has(h) for h in chain_hashes(p, BLOCK_SIZE)[:(len(p) - 1) // BLOCK_SIZE]]
            for p in prompts]


def test_a_speculating_engine_saves_the_blocks_a_plain_one_saves(tmp_path):
    """Only prompt blocks are saved, after the step that computed them: a speculating writer
    saves what a plain one does, and its files give an engine without speculation the
    reference tokens."""
    saved, stores = [], []
    for spec in (None, NGRAM):
        writer = build(spec, store=tmp_path / str(bool(spec)))
        try:
            writer.generate(PROMPTS, GREEDY)
            saved.append(saved_blocks(writer.external.connector.store, PROMPTS))
            stores.append(tmp_path / str(bool(spec)))
        finally:
            writer.close()
    assert saved[1] == saved[0]
    loaded = []
    for store in stores:
        reader = build(store=store)
        try:
            got = [reader.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
            loaded.append(reader.stats()["kv_connector_loaded_tokens"])
        finally:
            reader.close()
        assert got == tokens(build().generate(PROMPTS, GREEDY))
    assert loaded[1] == loaded[0] > 0


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "speculating"])
def test_every_full_prompt_block_is_saved_when_a_chunk_ends_inside_a_block(tmp_path, spec):
    # Budget 32, the four prompts together: the 9-token prompt's first chunk is its tokens 0..6
    # (block 0 full, block 1 = tokens 4..7 not yet), its second tokens 7..8, which complete
    # block 1, which the saves missed while they started at the first block after `start`.
    writer = build(spec, store=tmp_path)
    try:
        writer.generate(PROMPTS, GREEDY)
        saved = saved_blocks(writer.external.connector.store, PROMPTS)
    finally:
        writer.close()
    assert saved == [[True] * len(s) for s in saved]


# --- 6. the HTTP server --------------------------------------------------------------------------


SPEC_FLAG = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})


def draft_flag(checkpoint) -> str:
    """The checkpoint drafting for itself: every draft is accepted."""
    return json.dumps({"method": "draft_model", "model": str(checkpoint),
                       "num_speculative_tokens": 3})


@pytest.mark.slow  # starts two servers
@pytest.mark.parametrize("engine_loop, method", [("thread", "ngram"), ("process", "ngram"),
                                                 ("thread", "draft_model")])
def test_the_server_with_speculation_answers_like_one_without(checkpoint, engine_loop, method):
    from tests.support.servers import (complete, metric, serving, wait_for_free_blocks,
                                       wait_for_metric)

    import httpx

    prompt = "the quick brown fox jumps over the lazy dog the quick brown fox"
    completion = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "hello world, hello world, hello"}],
            "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    choices_body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.8, "seed": 5, "n": 3,
                    "ignore_eos": True}

    async def answers(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            plain = await complete(client, completion)
            streamed = await complete(client, {**completion, "stream": True})
            chatted = await complete(client, chat, "/v1/chat/completions")
            sampled = [[c["text"] for c in (await client.post("/v1/completions",
                                                              json=choices_body)).json()["choices"]]
                       for _ in range(2)]
            return plain, streamed, chatted, sampled

    with serving(str(checkpoint), "eager", engine_loop=engine_loop) as url:
        plain, streamed, chatted, sampled = asyncio.run(answers(url))
        assert metric(url, "kvgraph_spec_decode_drafts_total") == 0
    flag = SPEC_FLAG if method == "ngram" else draft_flag(checkpoint)
    with serving(str(checkpoint), "eager", "--speculative-config", flag,
                 engine_loop=engine_loop) as url:
        got = asyncio.run(answers(url))
        assert metric(url, "kvgraph_spec_decode_drafts_total") > 0
        assert metric(url, "kvgraph_spec_decode_accepted_tokens_total") > 0
        # A streaming client that leaves while its request speculates: aborted, blocks freed.
        leaving = {"prompt": prompt * 2, "max_tokens": 64, "temperature": 0, "stream": True,
                   "ignore_eos": True}
        aborted = metric(url, "kvgraph_requests_aborted_total")
        with httpx.Client(base_url=url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=leaving) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
        wait_for_metric(url, "kvgraph_requests_aborted_total", aborted + 1)
        health = wait_for_free_blocks(url)
        assert health["kv_blocks_free"] == health["kv_blocks_total"]
    assert got[:3] == (plain, streamed, chatted)
    assert plain == streamed and plain["tokens"] == 24
    assert chatted["text"] and chatted["tokens"] > 1
    # n = 3 seeded choices: the same run to run (each choice its own seed); with n-gram drafts
    # the very choices the server samples without speculation (rejection_sampler.py).
    assert got[3][0] == got[3][1] and len(got[3][0]) == 3
    if method == "ngram":
        assert got[3][0] == sampled[0]
