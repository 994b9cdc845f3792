"""Prefill on one engine, decode on another (issue 46, in one process): the prompt's blocks
pulled by D from P's cache over a gloo pair, vLLM's kv_transfer_params between them.

Reference: the greedy tokens of an engine that computes everything itself (fp32). D must give
them whether it loaded the prompt or, when P is gone or refuses it, computed it; P must free
the blocks once D has them, or when D never comes.
"""

from __future__ import annotations

import time

import pytest

import kvgraph
from examples.engine import SamplingParams
from examples.engine.errors import RequestError
from kvgraph.kv_transfer import KVTransferConfig
from tests.support.kv_engines import BLOCK_SIZE, GREEDY, PROMPTS, generate, make_kv_engine
from tests.support.transfer_engines import require_mooncake, require_nixl
from tests.support.scripts import free_port

PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


CONNECTORS = ["TorchDistributedConnector", "MooncakeConnector", "NixlConnector"]
REQUIRE = {"MooncakeConnector": require_mooncake, "NixlConnector": require_nixl}


def producer(kind="llama", timeout_s=60.0, connector=CONNECTORS[0], **kwargs):
    port = free_port()
    transfer = KVTransferConfig(connector, "kv_producer", {"port": port, "timeout_s": timeout_s})
    return make_kv_engine(kind, "piecewise", transfer=transfer, **kwargs)


def consumer(kind="llama", mode="full", connector=CONNECTORS[0], **kwargs):
    transfer = KVTransferConfig(connector, "kv_consumer", {"timeout_s": 20})
    return make_kv_engine(kind, mode, transfer=transfer, **kwargs)


def prefill(p, prompt):
    """Run `prompt` on P as a router would; its final output's kv_transfer_params."""
    request = p.add_request(prompt, PREFILL_ONLY, kv_transfer_params={"do_remote_decode": True})
    while not request.finished:
        p.step()
    assert request.kv_transfer_result["do_remote_prefill"]
    return request.kv_transfer_result


def decode(p, d, prompt, params):
    """Run `prompt` on D with P's params, stepping P beside it (it serves the pull)."""
    request = d.add_request(prompt, GREEDY, kv_transfer_params=params)
    step_both(p, d)
    return request


def step_both(p, d, timeout_s: float = 60.0) -> list:
    """Step D, and P beside it (it serves the pulls), until both are done: D's outputs.
    `timeout_s` stays far below P's: the pair must finish without P's timeout freeing blocks."""
    deadline, outputs = time.monotonic() + timeout_s, []
    while d.has_unfinished or (p is not None and p.has_unfinished):
        assert time.monotonic() < deadline, "the pair did not finish"
        outputs += d.step()
        if p is not None:
            p.step()
    return outputs


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_decode_continues_from_the_prefill_engines_blocks(kind, connector):
    REQUIRE.get(connector, lambda: None)()
    reference = generate(make_kv_engine(kind))
    p, d = producer(kind, connector=connector), consumer(kind, connector=connector)
    free = p.allocator.num_free
    for prompt, expected in zip(PROMPTS, reference):
        params = prefill(p, prompt)
        request = decode(p, d, prompt, params)
        assert tuple(request.output_token_ids) == expected
        # D continued from P's first token: every prompt token came from P (or D's cache).
        assert request.num_cached_tokens == len(prompt)
    assert p.allocator.num_free == free  # every held block freed once D had it
    stats = d.stats()
    assert stats["prompt_tokens_computed"] == 0
    # The second prompt found the common prefix (6 blocks) in D's own prefix cache: only the
    # blocks after it came from P, the partial last one included.
    loaded = [len(PROMPTS[0]), len(PROMPTS[1]) - 6 * BLOCK_SIZE]
    assert stats["kv_connector_loaded_tokens"] == sum(loaded)
    assert stats["prefix_cache_hit_tokens"] == 6 * BLOCK_SIZE
    pulled = [-(-len(PROMPTS[0]) // BLOCK_SIZE), -(-len(PROMPTS[1]) // BLOCK_SIZE) - 6]
    assert stats["runner"]["kv_connector"]["failed_pulls"] == 0
    assert p.stats()["runner"]["kv_connector"]["sent_blocks"] == sum(pulled)
    assert stats["runner"]["graph_mode"] == "full"  # a whole-request pull keeps full graphs
    d.runner.close()
    p.runner.close()


def test_without_ps_first_token_decode_computes_the_prompts_last_as_vllms_does():
    reference = generate(make_kv_engine("llama"), PROMPTS[:1])
    p, d = producer(), consumer()
    params = {**prefill(p, PROMPTS[0]), "first_token_ids": None}  # a vLLM prefill's answer
    request = decode(p, d, PROMPTS[0], params)
    assert tuple(request.output_token_ids) == reference[0]
    assert request.num_cached_tokens == len(PROMPTS[0]) - 1
    assert d.stats()["prompt_tokens_computed"] == 1
    d.runner.close()
    p.runner.close()


def test_a_request_asking_for_logprobs_computes_the_prompts_last_for_them():
    params_d = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    reference = make_kv_engine("llama").generate([PROMPTS[0]], params_d)[0].token_ids
    p, d = producer(), consumer()
    request = d.add_request(PROMPTS[0], params_d, kv_transfer_params=prefill(p, PROMPTS[0]))
    outputs = step_both(p, d)
    assert tuple(request.output_token_ids) == reference
    assert all(o.logprobs is not None for o in outputs if o.token_ids)
    assert d.stats()["prompt_tokens_computed"] == 1
    d.runner.close()
    p.runner.close()


def test_a_seeded_sampled_request_gives_a_colocated_engines_tokens():
    sampled = SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)
    reference = make_kv_engine("llama").generate([PROMPTS[0]], sampled)[0].token_ids
    p, d = producer(), consumer()
    first = p.add_request(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.9, seed=7,
                                                     ignore_eos=True),
                          kv_transfer_params={"do_remote_decode": True})
    while not first.finished:
        p.step()
    request = d.add_request(PROMPTS[0], sampled, kv_transfer_params=first.kv_transfer_result)
    step_both(p, d)
    assert tuple(request.output_token_ids) == reference
    assert d.stats()["prompt_tokens_computed"] == 0
    d.runner.close()
    p.runner.close()


def test_a_request_of_one_token_ends_with_ps_and_p_frees_its_blocks_at_once():
    p, d = producer(timeout_s=60.0), consumer()
    free = p.allocator.num_free
    params = prefill(p, PROMPTS[0])
    request = d.add_request(PROMPTS[0], PREFILL_ONLY, kv_transfer_params=params)
    assert tuple(request.output_token_ids) == tuple(params["first_token_ids"])
    outputs = step_both(p, d)  # D told P it needs nothing: done far below P's timeout
    assert [o.token_ids for o in outputs] == [tuple(params["first_token_ids"])]
    assert outputs[0].finished and d.stats()["steps"] == 0
    assert p.allocator.num_free == free
    d.runner.close()
    p.runner.close()


def test_a_first_token_outside_the_vocabulary_is_refused_naming_it():
    d = consumer()
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
              "remote_block_ids": [0], "first_token_ids": [10**6]}
    with pytest.raises(RequestError, match="first_token_ids.*token ids in"):
        d.add_request(PROMPTS[0], GREEDY, kv_transfer_params=params)
    assert not d.has_unfinished
    d.runner.close()


def test_a_step_the_runner_refuses_still_starts_the_pulls_its_requests_wait_for(monkeypatch):
    # The runner refuses a batch (BatchError) before its connector step runs: the step's
    # metadata, which starts the pull of a request admitted in it, must reach the worker all the
    # same, or that request would wait for its blocks forever.
    reference = generate(make_kv_engine("llama"), PROMPTS[:2])
    p, d = producer(), consumer()
    params = prefill(p, PROMPTS[1])
    running = d.add_request(PROMPTS[0], GREEDY)
    d.step()  # PROMPTS[0] prefilled: the next step decodes it and admits the pulled request
    prepare, refused = d.runner.prepare_step, []

    def refuse_once(chunks):
        if not refused:
            refused.append(len(chunks))
            raise kvgraph.BatchError("refused once, as a test")
        return prepare(chunks)

    monkeypatch.setattr(d.runner, "prepare_step", refuse_once)
    pulled = decode(p, d, PROMPTS[1], params)
    assert refused == [1]  # the decode of PROMPTS[0]; the pulled request was parked
    assert tuple(running.output_token_ids) == reference[0]
    assert tuple(pulled.output_token_ids) == reference[1]
    assert d.stats()["runner"]["kv_connector"]["received_blocks"] > 0
    d.runner.close()
    p.runner.close()


def test_a_prefill_engine_gone_means_decode_computes_the_prompt():
    reference = generate(make_kv_engine("llama"), PROMPTS[:1])
    p, d = producer(), consumer()
    params = prefill(p, PROMPTS[0])
    p.runner.close()  # its side channel closes with it
    request = decode(None, d, PROMPTS[0], params)
    assert tuple(request.output_token_ids) == reference[0]
    assert d.stats()["runner"]["kv_connector"]["failed_pulls"] == 1
    assert request.num_cached_tokens == 0
    d.runner.close()


def test_a_mismatched_pair_is_refused_and_decode_computes_the_prompt(caplog):
    reference = generate(make_kv_engine("llama"), PROMPTS[:1])
    # Refused, D never pulls: P frees the blocks after its timeout.
    p, d = producer(timeout_s=1.0), consumer(model_key="another-model")
    params = prefill(p, PROMPTS[0])
    request = decode(p, d, PROMPTS[0], params)
    assert p.stats()["runner"]["kv_connector"]["expired_requests"] == 1
    assert tuple(request.output_token_ids) == reference[0]
    assert "model_key" in caplog.text and "refuses to move KV blocks" in caplog.text
    d.runner.close()
    p.runner.close()


def test_blocks_are_freed_after_the_timeout_when_decode_never_comes():
    p = producer(timeout_s=0.2)
    free = p.allocator.num_free
    prefill(p, PROMPTS[0])
    assert p.allocator.num_free < free
    deadline = time.monotonic() + 30
    while p.has_unfinished:
        assert time.monotonic() < deadline
        p.step()
    assert p.allocator.num_free == free
    assert p.stats()["runner"]["kv_connector"]["expired_requests"] == 1
    p.runner.close()


def test_a_request_aborted_on_decode_frees_its_blocks_on_prefill_at_once():
    p, d = producer(timeout_s=60.0), consumer()
    free = p.allocator.num_free
    params = prefill(p, PROMPTS[0])
    request = d.add_request(PROMPTS[0], GREEDY, kv_transfer_params=params)
    assert d.abort(request.request_id)
    # D has no request left, but still steps to tell P (an idle engine steps only with work).
    while d.has_unfinished:
        d.step()
    deadline = time.monotonic() + 20  # far below P's timeout: D told P it needs nothing
    while p.has_unfinished:
        assert time.monotonic() < deadline
        p.step()
    assert p.allocator.num_free == free
    assert p.stats()["runner"]["kv_connector"]["expired_requests"] == 0
    d.runner.close()
    p.runner.close()
