"""`--kv-transfer-config` as a user runs it: examples/serve.py started, stopped and started again
on one shared-storage directory serves the same prompt from the blocks its predecessor saved
(the same greedy text, `usage.prompt_tokens_details.cached_tokens` through the official `openai`
client, the counts on /metrics), examples/generate.py run twice does the same, and a bad config
is refused.

Expected counts come from the block rule, not from the server: the first server saves each full
prompt block (`P // BLOCK` of them), the second loads all but the one holding the prompt's last
token, whose logits it must compute (`(P - 1) // BLOCK`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.examples.test_fail_fast import refused
from tests.support.disaggregated import launched, settled_metrics
from tests.support.openai_answers import MAX_TOKENS, ask
from tests.support.scripts import REPO, SCRIPT_ENV

BLOCK = 16
SERVE_FLAGS = ["--graph-mode", "eager", "--block-size", str(BLOCK), "--max-num-seqs", "4",
               "--max-model-len", "256"]


def transfer_config(path: Path, connector: str = "SharedStorageConnector") -> str:
    return json.dumps({"kv_connector": connector, "kv_role": "kv_both",
                       "kv_connector_extra_config": {"shared_storage_path": str(path)}})


def served(log: Path, *flags: str):
    """examples/serve.py in a process of its own, healthy, until the block ends: its URL."""
    return launched(["examples/serve.py", *flags], log)


@pytest.mark.slow
def test_a_restarted_server_serves_the_prompt_blocks_its_predecessor_saved(checkpoint,
                                                                          tmp_path):
    flags = ["--model", str(checkpoint), *SERVE_FLAGS,
             "--kv-transfer-config", transfer_config(tmp_path / "kv")]
    with served(tmp_path / "first.log", *flags) as url:
        first, first_chat, first_chat_usage = ask(url)
        prompts = [first.usage.prompt_tokens, first_chat_usage.prompt_tokens]
        assert min(prompts) > 3 * BLOCK  # several blocks each
        saved = sum(p // BLOCK * BLOCK for p in prompts)
        before = settled_metrics(url, "kvgraph_kv_connector_saved_tokens_total", saved)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first_chat_usage.prompt_tokens_details.cached_tokens == 0
    assert before["kvgraph_kv_connector_loaded_tokens_total"] == 0
    assert any((tmp_path / "kv").rglob("*.kvblock"))

    with served(tmp_path / "second.log", *flags) as url:
        second, second_chat, second_chat_usage = ask(url)
        cached = [second.usage.prompt_tokens_details.cached_tokens,
                  second_chat_usage.prompt_tokens_details.cached_tokens]
        after = settled_metrics(url, "kvgraph_kv_connector_loaded_tokens_total", sum(cached))
    assert second.choices[0].text == first.choices[0].text and second_chat == first_chat
    assert second.usage.completion_tokens == MAX_TOKENS
    assert cached == [(p - 1) // BLOCK * BLOCK for p in prompts]
    assert all(c > 0 and c % BLOCK == 0 for c in cached)
    # Every block it needed was on disk: none failed to load, none was computed and saved anew.
    assert after["kvgraph_kv_connector_failed_blocks_total"] == 0
    assert after["kvgraph_kv_connector_saved_tokens_total"] == 0


def generated_texts(stdout: str) -> list[str]:
    return [line.strip() for line in stdout.splitlines() if line.strip().startswith("text ")]


@pytest.mark.slow
def test_generate_run_twice_loads_the_blocks_the_first_run_saved(tmp_path):
    store = tmp_path / "kv"
    command = [sys.executable, "examples/generate.py", "--preset", "tiny", "--graph-mode",
               "eager", "--block-size", str(BLOCK), "--max-new-tokens", "6",
               "--kv-transfer-config", transfer_config(store)]
    first = subprocess.run(command, cwd=REPO, env=SCRIPT_ENV, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    blocks = sorted(store.rglob("*.kvblock"))
    assert blocks
    # A load refreshes a block file's modification time (a save never rewrites one): set them
    # back an hour, and the second run's loads show.
    old = time.time() - 3600
    for block in blocks:
        os.utime(block, (old, old))
    second = subprocess.run(command, cwd=REPO, env=SCRIPT_ENV, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    texts = generated_texts(first.stdout)
    assert len(texts) == 4 and generated_texts(second.stdout) == texts
    assert sorted(store.rglob("*.kvblock")) == blocks
    assert any(block.stat().st_mtime > old + 1800 for block in blocks)


# --- a bad config --------------------------------------------------------------------------

def run_serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "examples/serve.py", "--preset", "tiny",
                           "--graph-mode", "eager", "--port", "0", *flags], cwd=REPO,
                          env=SCRIPT_ENV, capture_output=True, text=True, timeout=120)


def test_a_config_that_is_not_json_is_refused_by_the_flags_parser(tmp_path):
    result = run_serve("--kv-transfer-config", "{kv_connector: SharedStorageConnector}")
    assert result.returncode == 2 and result.stdout == ""
    assert "Traceback" not in result.stderr
    last = result.stderr.splitlines()[-1]  # after argparse's usage, as for any flag it refuses
    assert last.startswith("serve.py: error: argument --kv-transfer-config: ")
    assert "not JSON" in last


@pytest.mark.parametrize("script", ["serve.py", "generate.py"])
def test_an_unknown_connector_is_refused_before_the_model_loads(script, tmp_path):
    """Preflight asks the registry: exit 2 with one line naming the connector, nothing built."""
    line = refused(script, "--kv-transfer-config", transfer_config(tmp_path, "NoSuchConnector"))
    assert line == ("--kv-transfer-config: unknown kv_connector 'NoSuchConnector'; registered: "
                    "['MooncakeConnector', 'NixlConnector', 'SharedStorageConnector', "
                    "'TorchDistributedConnector'] (register_kv_connector adds one)")


def test_shared_storage_settings_are_checked_before_the_model_loads(tmp_path):
    config = json.loads(transfer_config(tmp_path, "SharedStorageConnector"))
    config["kv_connector_extra_config"]["max_size_gib"] = 0
    line = refused("serve.py", "--kv-transfer-config", json.dumps(config))
    assert line.startswith("--kv-transfer-config: max_size_gib: expected a positive number")
