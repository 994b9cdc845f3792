"""A prefill server (P) that dies while a decode server (D) pulls from it, between real servers
(issue 46): D's other requests go on while the pull waits, and once P is gone D computes the
prompt itself and answers what a colocated server answers, never from a partial cache.

P is stopped (SIGSTOP: its sockets stay open, so D's pull waits on it) after answering a
prefill, then killed (SIGKILL) while D waits. That D's pull fails at once when P dies in the
middle of moving blocks is checked at the transport
(tests/kvgraph/kv_transfer/test_block_pair.py); here, that the servers around it do the right
thing. References: a colocated server's greedy text for the same requests.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.support.disaggregated import connector_metrics, launched  # noqa: E402
from tests.support.scripts import free_port  # noqa: E402

BLOCK = 16
SERVE_FLAGS = ["--graph-mode", "eager", "--block-size", str(BLOCK), "--max-num-seqs", "4",
               "--max-model-len", "256"]
PROMPTS = ["The paged cache keeps every layer's blocks in one tuple of tensors, " * 2,
           "A decode server continues what a prefill server began, " * 2,
           "Other requests must not wait while one request's blocks are pulled, " * 2]


def transfer_config(role: str, **settings) -> str:
    return json.dumps({"kv_connector": "TorchDistributedConnector", "kv_role": role,
                       "kv_connector_extra_config": settings})


def complete(url: str, prompt: str, **extra) -> dict:
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, **extra}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def prefill(p: str, prompt: str) -> dict:
    """What a router does first: P's kv_transfer_params for `prompt`."""
    answer = complete(p, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return answer["kv_transfer_params"]


def wait_for(url: str, name: str, value: float, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while connector_metrics(url).get(name) != value:
        assert time.monotonic() < deadline, f"{name} never read {value}"
        time.sleep(0.1)


@pytest.mark.slow
def test_p_dying_mid_pull_leaves_d_serving_and_computing_the_prompt(checkpoint, tmp_path):
    model = ["examples/serve.py", "--model", str(checkpoint), *SERVE_FLAGS]
    with launched(model, tmp_path / "colocated.log") as url:
        reference = [complete(url, prompt)["choices"][0]["text"] for prompt in PROMPTS]

    producer = transfer_config("kv_producer", port=free_port())
    with launched([*model, "--kv-transfer-config", producer], tmp_path / "p.log") as p, \
            launched([*model, "--kv-transfer-config", transfer_config("kv_consumer")],
                     tmp_path / "d.log") as d, \
            concurrent.futures.ThreadPoolExecutor(1) as client:
        # One request through the pair first: D has joined P, so the next pull is a pull.
        first = complete(d, PROMPTS[0], kv_transfer_params=prefill(p, PROMPTS[0]))
        params = prefill(p, PROMPTS[1])
        os.killpg(p.pid, signal.SIGSTOP)
        try:
            pulled = client.submit(complete, d, PROMPTS[1], kv_transfer_params=params)
            wait_for(d, "kvgraph_kv_connector_requests_waiting", 1)
            other = complete(d, PROMPTS[2])  # served while the pull waits on P
            assert not pulled.done()
        finally:
            os.killpg(p.pid, signal.SIGKILL)
        answer = pulled.result(timeout=120)
        metrics = connector_metrics(d)

    assert first["choices"][0]["text"] == reference[0]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        first["usage"]["prompt_tokens"]
    assert other["choices"][0]["text"] == reference[2]
    # P died before the blocks came: D computed the whole prompt, with a colocated answer.
    assert answer["choices"][0]["text"] == reference[1]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metrics["kvgraph_kv_connector_failed_pulls_total"] == 1
    assert metrics["kvgraph_kv_connector_requests_waiting"] == 0
