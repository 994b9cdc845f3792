"""The layer-by-layer push over HTTP (issue 46): its kv_transfer_params checks, P's side channel
on GET /v1/kv_transfer, and examples/disagg_proxy.py --push over real servers, answering as one
colocated server (the reference) with D computing one prompt token per request."""

from __future__ import annotations

import httpx
import pytest

from examples.engine.errors import RequestError
from tests.examples.test_disaggregated_serving import SERVE_FLAGS, parse, transfer_config
from tests.support.disaggregated import launched, settled_metrics
from tests.support.openai_answers import ask
from tests.support.scripts import free_port
from tests.support.servers import wait_for_free_blocks

PUSH_D = {"do_remote_prefill": True, "push": True, "remote_host": "127.0.0.1",
          "remote_port": 8150, "remote_request_id": "t1", "remote_block_ids": []}


def test_a_pushed_decode_request_needs_no_block_ids_but_the_transfer_id():
    assert parse({"kv_transfer_params": PUSH_D}).kv_transfer_params == PUSH_D
    without_id = {k: v for k, v in PUSH_D.items() if k != "remote_request_id"}
    with pytest.raises(RequestError, match="do_remote_prefill needs remote_request_id"):
        parse({"kv_transfer_params": without_id})


@pytest.mark.parametrize("params, message", [
    ({"do_remote_decode": True, "push": True}, "do_remote_decode needs transfer_id"),
    ({"push": "yes"}, "push must be a boolean"),
    ({"transfer_id": 3}, "transfer_id must be a transfer id"),
])
def test_a_pushed_prefill_request_is_checked_naming_the_key(params, message):
    with pytest.raises(RequestError, match=message):
        parse({"kv_transfer_params": params})


@pytest.mark.slow
def test_the_pushing_proxy_answers_as_one_colocated_server(checkpoint, tmp_path):
    model = ["examples/serve.py", *SERVE_FLAGS, "--model", str(checkpoint)]
    with launched(model, tmp_path / "colocated.log") as url:
        reference, reference_chat, reference_usage = ask(url, True)

    port = free_port()
    producer = transfer_config("kv_producer", port=port, push=True)
    with launched([*model, "--kv-transfer-config", producer], tmp_path / "p.log") as p, \
            launched([*model, "--kv-transfer-config", transfer_config("kv_consumer")],
                     tmp_path / "d.log") as d, \
            launched(["examples/disagg_proxy.py", "--push", "--prefill", p, "--decode", d],
                     tmp_path / "proxy.log") as proxy:
        assert httpx.get(f"{p}/v1/kv_transfer").json() == {
            "kv_role": "kv_producer", "kv_connector": "TorchDistributedConnector",
            "host": "127.0.0.1", "port": port}
        assert httpx.get(f"{d}/v1/kv_transfer").status_code == 404
        completion, streamed, usage = ask(proxy, True)
        prompts = [completion.usage.prompt_tokens, usage.prompt_tokens]
        pushed = [n - 1 for n in prompts]  # D computes each prompt's last token
        metrics = settled_metrics(d, "kvgraph_kv_connector_loaded_tokens_total", sum(pushed))
        p_health = wait_for_free_blocks(p)

    assert completion.choices[0].text == reference.choices[0].text
    assert streamed == reference_chat
    assert prompts == [reference.usage.prompt_tokens, reference_usage.prompt_tokens]
    assert [completion.usage.prompt_tokens_details.cached_tokens,
            usage.prompt_tokens_details.cached_tokens] == pushed
    assert metrics["kvgraph_kv_connector_failed_blocks_total"] == 0
    assert metrics["kvgraph_prompt_tokens_computed_total"] == len(prompts)
    assert p_health["kv_blocks_free"] == p_health["kv_blocks_total"]
