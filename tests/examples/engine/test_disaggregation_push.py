"""Prefill on one engine, decode on another, P pushing each layer's blocks into D's cache as it
computes them (issue 46, in one process, gloo): D is sent the request first, P its prefill.

Reference: the greedy tokens of an engine that computes everything itself (fp32). D computes
exactly the prompt's last token (P's first token is not known to it); P resolves to piecewise,
sends from inside the forward (before its later layers ran) and frees every block.
"""

from __future__ import annotations

import time
import uuid

import pytest

from examples.engine import SamplingParams
from kvgraph.kv_transfer import KVTransferConfig
from tests.support.kv_engines import BLOCK_SIZE, GREEDY, PROMPTS, generate, make_kv_engine
from tests.support.scripts import free_port

PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def pusher(kind="llama", mode="piecewise", timeout_s=60.0, push=True):
    transfer = KVTransferConfig("TorchDistributedConnector", "kv_producer",
                                {"port": free_port(), "timeout_s": timeout_s, "push": push})
    return make_kv_engine(kind, mode, transfer=transfer)


def receiver(kind="llama", timeout_s=20.0):
    transfer = KVTransferConfig("TorchDistributedConnector", "kv_consumer",
                                {"timeout_s": timeout_s})
    return make_kv_engine(kind, "full", transfer=transfer)


def connector(engine):
    return engine.runner.kv_connector.connector


def push_params(p, transfer_id):
    """What the proxy sends D for a push from `p`."""
    return {"do_remote_prefill": True, "push": True, "remote_host": "127.0.0.1",
            "remote_port": connector(p).port, "remote_request_id": transfer_id,
            "remote_block_ids": []}


def run(engines, deadline_s=60):
    deadline = time.monotonic() + deadline_s
    while any(e.has_unfinished for e in engines):
        assert time.monotonic() < deadline, "the pair did not finish"
        for engine in engines:
            engine.step()


def disaggregated(p, d, prompt, d_first=True):
    """`prompt` sent to D (push) and P (prefill) as the proxy does; D's request."""
    transfer_id = uuid.uuid4().hex
    prefill = {"do_remote_decode": True, "push": True, "transfer_id": transfer_id}
    if not d_first:  # D registers only once P is done with the prompt (and holds its blocks)
        p.add_request(prompt, PREFILL_ONLY, kv_transfer_params=prefill)
        while p.num_steps < 2:
            p.step()
    request = d.add_request(prompt, GREEDY, kv_transfer_params=push_params(p, transfer_id))
    # P starts once D registered (unless P refuses to push), so every layer is pushed as it is
    # written.
    deadline = time.monotonic() + 30
    while d_first and connector(p).push and not getattr(
            connector(p)._outgoing.get(transfer_id), "registered", False):
        assert time.monotonic() < deadline, "D did not register with P"
        d.step()
    if d_first:
        p.add_request(prompt, PREFILL_ONLY, kv_transfer_params=prefill)
    run([d, p])
    return request


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_decode_continues_from_blocks_pushed_layer_by_layer(kind):
    reference = generate(make_kv_engine(kind))
    p, d = pusher(kind, mode="full"), receiver(kind)
    free = p.allocator.num_free
    for prompt, expected in zip(PROMPTS, reference):
        request = disaggregated(p, d, prompt)
        assert tuple(request.output_token_ids) == expected
        assert request.num_cached_tokens == len(prompt) - 1
    assert p.allocator.num_free == free  # every block freed once pushed
    stats, p_stats = d.stats(), p.stats()
    assert stats["prompt_tokens_computed"] == len(PROMPTS)  # one per request: the last
    assert stats["runner"]["kv_connector"]["failed_pushes"] == 0
    assert stats["runner"]["graph_mode"] == "full"
    p_runner = p_stats["runner"]
    assert p_runner["graph_mode"] == "piecewise"  # full resolved: P works layer by layer
    layers = len(connector(p)._caches)
    # The 38-token prompt runs in two chunks (32 tokens a step), the 43-token one in one (its
    # first 24 tokens are in P's prefix cache): a save per layer and chunk.
    chunks = 3
    assert p_runner["kv_connector"]["layer_saves"] == chunks * layers
    # Layer by layer: each (layer, chunk) sent on its own, most while later layers had yet to
    # run (the last layer's blocks only after the forward's last layer, by definition).
    assert p_runner["kv_connector"]["pushed_messages"] == chunks * layers
    assert p_runner["kv_connector"]["overlapped_messages"] == chunks * (layers - 1)
    # The second prompt's first 6 blocks came from D's prefix cache: P pushed the others.
    pushed = [-(-(len(PROMPTS[0]) - 1) // BLOCK_SIZE), -(-(len(PROMPTS[1]) - 1) // BLOCK_SIZE) - 6]
    assert stats["runner"]["kv_connector"]["received_blocks"] == sum(pushed)
    d.runner.close()
    p.runner.close()


def test_decode_registering_after_the_prefill_ended_still_gets_every_block():
    reference = generate(make_kv_engine("llama"), PROMPTS[:1])
    p, d = pusher(), receiver()
    free = p.allocator.num_free
    request = disaggregated(p, d, PROMPTS[0], d_first=False)
    assert tuple(request.output_token_ids) == reference[0]
    assert request.num_cached_tokens == len(PROMPTS[0]) - 1
    assert d.stats()["prompt_tokens_computed"] == 1
    assert p.allocator.num_free == free
    d.runner.close()
    p.runner.close()


def test_a_prefill_that_never_runs_makes_decode_compute_the_prompt_after_timeout_s():
    reference = generate(make_kv_engine("llama"), PROMPTS[:1])
    p, d = pusher(timeout_s=1.0), receiver()
    request = d.add_request(PROMPTS[0], GREEDY,
                            kv_transfer_params=push_params(p, uuid.uuid4().hex))
    started = time.monotonic()
    run([d, p], deadline_s=30)
    assert time.monotonic() - started >= 1.0
    assert tuple(request.output_token_ids) == reference[0]
    assert request.num_cached_tokens == 0
    assert d.stats()["prompt_tokens_computed"] == len(PROMPTS[0])
    assert d.stats()["runner"]["kv_connector"]["failed_pushes"] == 1
    d.runner.close()
    p.runner.close()


def test_a_prefill_engine_without_push_refuses_and_decode_computes_the_prompt():
    reference = generate(make_kv_engine("llama"), PROMPTS[:1])
    p, d = pusher(timeout_s=1.0, push=False), receiver()
    assert p.stats()["runner"]["graph_mode"] == "piecewise"
    assert not connector(p).layerwise
    request = disaggregated(p, d, PROMPTS[0])
    assert tuple(request.output_token_ids) == reference[0]
    assert d.stats()["runner"]["kv_connector"]["failed_pushes"] == 1
    d.runner.close()
    p.runner.close()
