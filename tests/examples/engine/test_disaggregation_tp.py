"""Disaggregated prefill with tensor parallelism (issue 46): a prefill server (P, a real
examples/serve.py) and a decode engine (D, in this process, rank 0 of two) whose ranks each
pull their own shard of the prompt's blocks from P's rank of the same number.

Reference: the greedy tokens of a TP=1 engine with no connector (fp32; TP=2 gives the same).
D must give them whether it loaded the prompt or, paired with a P of another TP size (refused,
naming it), computed it; P must free the blocks once every one of D's ranks has them.
"""

from __future__ import annotations

import contextlib
import json
import socket

import pytest

from examples.engine import SamplingParams, build_engine
from examples.generate import MODELS, parse_args
from tests.support.kv_engines import PROMPTS
from tests.support.scripts import free_port
from tests.support.tp_engines import EAGER, FLAGS, threads_kept, tp_engine
from tests.support.transfer_engines import require_mooncake, require_nixl

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.support.disaggregated import launched  # noqa: E402
from tests.support.servers import wait_for_free_blocks  # noqa: E402

pytestmark = pytest.mark.slow  # a server of two ranks, and an engine of two

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
MODEL = [*FLAGS, "--block-size", str(BLOCK)]
CONNECTORS = ["TorchDistributedConnector", "MooncakeConnector", "NixlConnector"]
REQUIRE = {"MooncakeConnector": require_mooncake, "NixlConnector": require_nixl}


def free_ports(count: int) -> int:
    """A free port whose next `count - 1` are free too (P's rank r serves on port + r)."""
    for _ in range(50):
        base = free_port()
        with contextlib.ExitStack() as taken, contextlib.suppress(OSError):
            for port in range(base, base + count):
                taken.enter_context(socket.create_server(("127.0.0.1", port)))
            return base
    raise RuntimeError(f"found no {count} free consecutive ports")


def transfer(connector: str, role: str, **settings) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": connector, "kv_role": role,
                                                "kv_connector_extra_config": settings})]


@pytest.fixture(scope="module")
def reference():
    """The greedy tokens of PROMPTS with TP=1 and no connector."""
    with threads_kept():
        engine, _ = build_engine(parse_args([*MODEL, *EAGER]), MODELS)
    try:
        return [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    finally:
        engine.runner.close()


@contextlib.contextmanager
def prefill_server(tmp_path, connector: str, *flags: str):
    """P: examples/serve.py (eager) with `connector` as producer; its URL."""
    producer = transfer(connector, "kv_producer", port=free_ports(2), timeout_s=60)
    with launched(["examples/serve.py", *MODEL, *EAGER, *producer, *flags],
                  tmp_path / "p.log") as url:
        yield url


def prefill(url: str, prompt: list[int]) -> dict:
    """`prompt` prefilled on P as a router asks; P's kv_transfer_params."""
    answer = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert answer.status_code == 200, answer.text
    return answer.json()["kv_transfer_params"]


def decode(d, prompt: list[int], params: dict):
    """`prompt` run on D from P's params, to its end; the request."""
    request = d.add_request(prompt, GREEDY, kv_transfer_params=params)
    while d.has_unfinished:
        d.step()
    return request


@pytest.mark.parametrize("connector", CONNECTORS)
def test_two_decode_ranks_pull_their_shards_from_two_prefill_ranks(tmp_path, reference,
                                                                   connector):
    REQUIRE.get(connector, lambda: None)()
    consumer = transfer(connector, "kv_consumer", timeout_s=20)
    with prefill_server(tmp_path, connector, "--tensor-parallel-size", "2") as p, \
            tp_engine(*MODEL, *consumer) as d:
        requests = [decode(d, prompt, prefill(p, prompt)) for prompt in PROMPTS]
        p_health = wait_for_free_blocks(p)
        stats = d.stats()
    assert [tuple(r.output_token_ids) for r in requests] == reference
    for request, prompt in zip(requests, PROMPTS):
        # D loaded the prompt (all of it but at most the last token, which it computed).
        assert request.num_cached_tokens >= len(prompt) - 1
    # The second prompt found the common prefix in D's own prefix cache: the rest came from P.
    assert stats["kv_connector_loaded_tokens"] == (sum(r.num_cached_tokens for r in requests)
                                                   - stats["prefix_cache_hit_tokens"])
    assert stats["kv_connector_failed_blocks"] == 0
    assert stats["runner"]["kv_connector"]["failed_pulls"] == 0  # rank 0's; rank 1's merged in
    # P freed every block it held, once both of D's ranks had them (its timeout is 60 s).
    assert p_health["kv_blocks_free"] == p_health["kv_blocks_total"]


def test_two_decode_ranks_refuse_one_prefill_rank_and_compute_the_prompt(tmp_path, reference,
                                                                         caplog):
    consumer = transfer(CONNECTORS[0], "kv_consumer", timeout_s=20)
    with prefill_server(tmp_path, CONNECTORS[0]) as p, tp_engine(*MODEL, *consumer) as d:
        request = decode(d, PROMPTS[0], prefill(p, PROMPTS[0]))
        stats = d.stats()
    assert tuple(request.output_token_ids) == reference[0]
    assert request.num_cached_tokens == 0 and stats["kv_connector_loaded_tokens"] == 0
    assert stats["kv_connector_failed_blocks"] > 0
    # Rank 0 was refused by P's only rank, naming the difference (rank 1 found no rank 1).
    assert "tp_size: 1 here, 2 on the decode engine" in caplog.text
