"""Disaggregated prefill (1P1D, one core each) against a colocated server (both cores).

One streaming client, the same mix against both: decoding requests' inter-token latency (ITL)
and long prompts' time to first token (TTFT). Starts, as a user would (examples/serve.py and
examples/disagg_proxy.py, docs/kv-transfer.md):
- colocated: one server on the first two usable cores, two compute threads;
- 1P1D: a prefill server P (`kv_producer`) on the first core and a decode server D
  (`kv_consumer`) on the second, one compute thread each, the --transfer connector between
  them, and the proxy in front (not pinned, as this client is not).
Every server runs the example Llama with random weights (--preset, --dtype) and the same flags;
flags this script does not know (--graph-mode, --piece-compiler, ...) go to every server. One
client runs the same mix against each (streaming_client.py: --decoders short requests decoding
steadily while --long-prompts prompts of --long-len tokens arrive among them): a warm-up run
each, then --rounds rounds alternating which setup goes first, the other setup's processes
stopped meanwhile (quiet.py). Reported: medians over the rounds of each run's p50 and p99 of the
decoding requests' ITL (what disaggregation is meant to keep steady) and TTFT and of the long
prompts' TTFT; D's /metrics, which must show every prompt pulled from P; then each transport
against a memcpy of one long prompt's blocks (transfer_bandwidth.py). Prints tables, writes JSON.

    python -m examples.benchmarks.disaggregation [--rounds 5] [--transfer MooncakeConnector] \
        [--json disaggregation.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx
import torch

from examples.benchmarks import transfer_bandwidth
from examples.benchmarks.quiet import paused, wait_until_quiet
from examples.benchmarks.serve_throughput import free_port
from examples.benchmarks.streaming_client import MixedWorkload, run_mixed, summarize
from examples.benchmarks.timing import machine, write_json
from examples.models.llama import PRESETS

CONNECTORS = ("TorchDistributedConnector", "MooncakeConnector", "NixlConnector")
SETUPS = ("colocated", "1P1D")
REPO = Path(__file__).resolve().parents[2]
# The scripts import kvgraph and examples from this checkout whether or not it is installed.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get(
    "PYTHONPATH")]))}
START_TIMEOUT_S = 900  # three servers compiling at once on two cores
BLOCK_SIZE = 16  # the CPU's default, and the block transfer_bandwidth.py's caches have
# (table row, which requests, which number)
ROWS = (("decoding requests' ITL p50 (ms)", "decode", "itl_p50_ms"),
        ("decoding requests' ITL p99 (ms)", "decode", "itl_p99_ms"),
        ("decoding requests' ITL p99.9 (ms)", "decode", "itl_p99.9_ms"),
        ("decoding requests' longest gap (ms)", "decode", "itl_max_ms"),
        ("long prompts' TTFT p50 (ms)", "long", "ttft_p50_ms"),
        ("long prompts' TTFT p99 (ms)", "long", "ttft_p99_ms"),
        ("decoding requests' TTFT p50 (ms)", "decode", "ttft_p50_ms"),
        ("decoding requests' TTFT p99 (ms)", "decode", "ttft_p99_ms"),
        ("output tokens/s", "all", "tokens_per_s"))
WORKLOAD_HELP = {
    "decoders": "clients each streaming short requests back to back",
    "short_len": "their prompts' tokens",
    "decode_tokens": "their most output tokens (each request draws from half of it to all)",
    "long_prompts": "long prompts per run, one every --long-every-s",
    "long_len": "their prompts' tokens", "long_tokens": "their output tokens",
    "long_every_s": "seconds between long prompts"}


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Other flags (--graph-mode, --piece-compiler, ...) go to every server.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small",
                        help="the example Llama's size (random weights)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the weights' and the cache's dtype (default %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--transfer", choices=CONNECTORS, default=CONNECTORS[0],
                        help="the kv_connector between P and D (default %(default)s)")
    parser.add_argument("--push", action="store_true",
                        help="P pushes each layer's blocks into D's cache as it computes them "
                        "(disagg_proxy.py --push; TorchDistributedConnector only) instead of D "
                        "pulling the prompt's blocks once P is done")
    parser.add_argument("--rounds", type=int, default=5)
    for field in dataclasses.fields(MixedWorkload):
        default = field.default
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(default),
                            default=default, help=f"{WORKLOAD_HELP[field.name]} "
                            "(default %(default)s)")
    parser.add_argument("--bandwidth-rounds", type=int, default=3,
                        help="transfer_bandwidth.py's rounds (default %(default)s; 0: not run)")
    parser.add_argument("--log-dir", type=Path,
                        help="where the servers' logs go (default: a temporary directory)")
    parser.add_argument("--json", default="disaggregation.json")
    args, server_args = parser.parse_known_args(argv)
    longest = max(args.long_len + args.long_tokens, args.short_len + args.decode_tokens)
    if longest > args.max_model_len:
        parser.error(f"a request of {longest} tokens does not fit --max-model-len "
                     f"{args.max_model_len}")
    if args.rounds < 1 or args.decoders < 0 or args.long_prompts < 1:
        parser.error("--rounds and --long-prompts must be at least 1, --decoders at least 0")
    if args.push and args.transfer != CONNECTORS[0]:
        parser.error(f"--push runs on {CONNECTORS[0]} only, not {args.transfer}")
    if len(os.sched_getaffinity(0)) < 2:
        parser.error(f"needs two usable cores, has {sorted(os.sched_getaffinity(0))}")
    return args, server_args


@dataclasses.dataclass
class Server:
    """A script started by `start`: its process, URL and log."""

    name: str
    process: subprocess.Popen
    url: str
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def start(name: str, command: list[str], port: int, cores: set[int] | None, log_dir: Path
          ) -> Server:
    """`python <command> --port <port>`, pinned to `cores` (when given) from its first
    instruction, so every thread and process it starts shares them; output to a log."""
    log = log_dir / f"{name}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, *command, "--port", str(port)], cwd=REPO, env=ENV, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores))
    return Server(name, process, f"http://127.0.0.1:{port}", log)


def wait_healthy(servers: list[Server]) -> None:
    """Return once every server's /health answers 200; raise with its log when one exits."""
    deadline, waiting = time.monotonic() + START_TIMEOUT_S, list(servers)
    while waiting:
        for server in list(waiting):
            if server.process.poll() is not None:
                raise RuntimeError(f"{server.name} exited with status {server.process.returncode}"
                                   f"; the end of {server.log}:\n{server.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    waiting.remove(server)
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"{[s.name for s in waiting]} not healthy in {START_TIMEOUT_S} s")
        time.sleep(0.5)


@contextlib.contextmanager
def setups(args: argparse.Namespace, server_args: list[str], log_dir: Path
           ) -> Iterator[dict[str, dict[str, Any]]]:
    """Both setups running until the block ends: each one's URL and server processes."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    model = ["examples/serve.py", "--model", "llama", "--preset", args.preset, "--dtype",
             args.dtype, "--max-model-len", str(args.max_model_len), *server_args]

    def transfer(role: str, **settings: Any) -> list[str]:
        return ["--kv-transfer-config", json.dumps({
            "kv_connector": args.transfer, "kv_role": role, "kv_connector_extra_config": settings})]

    push = {"push": True} if args.push else {}
    p_port, d_port = free_port(), free_port()
    proxy = ["examples/disagg_proxy.py", "--prefill", f"http://127.0.0.1:{p_port}", "--decode",
             f"http://127.0.0.1:{d_port}", *(["--push"] if args.push else [])]
    servers = [
        start("colocated", [*model, "--threads", "2"], free_port(), {first, second}, log_dir),
        start("P", [*model, "--threads", "1", *transfer("kv_producer", port=free_port(), **push)],
              p_port, {first}, log_dir),
        start("D", [*model, "--threads", "1", *transfer("kv_consumer")], d_port, {second},
              log_dir),
        start("proxy", proxy, free_port(), None, log_dir)]
    try:
        wait_healthy(servers)
        colocated, p, d, proxy = servers
        yield {"colocated": {"url": colocated.url, "pids": [colocated.process.pid]},
               "1P1D": {"url": proxy.url, "pids": [s.process.pid for s in (p, d, proxy)],
                        "p": p.url, "d": d.url}}
    finally:
        for server in servers:
            stop(server.process)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process's group (a server's engine process stops with it), then SIGKILL."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def timed_run(running: dict[str, dict[str, Any]], setup: str, work: MixedWorkload, seed: int
              ) -> dict[str, Any]:
    """One run of the mix against `setup`, the other setup's processes stopped meanwhile."""
    others = [pid for name, s in running.items() if name != setup for pid in s["pids"]]
    wait_until_quiet(others + running[setup]["pids"])
    with paused(others):
        results = asyncio.run(run_mixed(running[setup]["url"], work, seed))
    everything = results["decode"] + results["long"]
    return {"decode": summarize(results["decode"]), "long": summarize(results["long"]),
            "all": {"tokens_per_s": sum(r["tokens"] for r in everything) / results["seconds"]},
            "seconds": results["seconds"], "requests": len(everything),
            "prompt_tokens": sum(r["prompt_tokens"] for r in everything)}


def connector_metrics(url: str) -> dict[str, float]:
    """The server's kvgraph_kv_connector_* counters from /metrics."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return {name: float(value) for name, value in (line.split()[:2] for line in lines
            if line.startswith("kvgraph_kv_connector_"))}


def pulled(running: dict[str, dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """P's and D's connector counters, and what D should have loaded from P for `runs`: every
    prompt token, less at most each prompt's last (which D computes unless P handed it its
    first token). Read once D's count reaches that (the stats may trail the answers a little),
    or after 10 s."""
    prompt_tokens = sum(r["prompt_tokens"] for r in runs)
    at_least = prompt_tokens - sum(r["requests"] for r in runs)
    deadline = time.monotonic() + 10
    while True:
        d = connector_metrics(running["1P1D"]["d"])
        loaded = d.get("kvgraph_kv_connector_loaded_tokens_total", 0)
        if loaded >= at_least or time.monotonic() > deadline:
            return {"prompt_tokens": prompt_tokens, "loaded_at_least": at_least,
                    "loaded_tokens": loaded, "d": d,
                    "p": connector_metrics(running["1P1D"]["p"])}
        time.sleep(0.2)


def bandwidth(args: argparse.Namespace) -> dict[str, Any] | None:
    """transfer_bandwidth.py on caches of this model's shape, pulling one long prompt's blocks."""
    if args.bandwidth_rounds < 1:
        return None
    preset = PRESETS[args.preset]
    blocks = -(-args.long_len // BLOCK_SIZE)
    head_size = preset.get("head_dim", preset["hidden_size"] // preset["num_attention_heads"])
    return transfer_bandwidth.main([
        "--layers", str(preset["num_hidden_layers"]), "--blocks", str(max(4 * blocks, 64)),
        "--kv-heads", str(preset["num_key_value_heads"]), "--head-size", str(head_size),
        "--dtype", args.dtype, "--pull", str(blocks), "--rounds", str(args.bandwidth_rounds),
        "--json", str(Path(args.json).with_suffix(".bandwidth.json"))])


def print_table(medians: dict[str, dict[str, dict[str, float]]]) -> None:
    print("| what | colocated, 2 cores | 1P1D, 1 core each | 1P1D / colocated |")
    print("|---|---|---|---|")
    for label, part, key in ROWS:
        colocated, disaggregated = (medians[s][part][key] for s in SETUPS)
        ratio = f"{disaggregated / colocated:.2f}×" if colocated else "-"
        print(f"| {label} | {colocated:.1f} | {disaggregated:.1f} | {ratio} |")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args, server_args = parse_args(argv)
    work = MixedWorkload(**{f.name: getattr(args, f.name)
                            for f in dataclasses.fields(MixedWorkload)})
    rounds: dict[str, list[dict[str, Any]]] = {setup: [] for setup in SETUPS}
    with contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="kvgraph-disagg-")))
        log_dir.mkdir(parents=True, exist_ok=True)
        running = stack.enter_context(setups(args, server_args, log_dir))
        warm_up = {setup: timed_run(running, setup, work, seed=-1) for setup in SETUPS}
        for round_ in range(args.rounds):
            for setup in (SETUPS if round_ % 2 else SETUPS[::-1]):
                rounds[setup].append(timed_run(running, setup, work, seed=round_))
        counters = pulled(running, [warm_up["1P1D"], *rounds["1P1D"]])
    medians = {setup: {part: {key: statistics.median(r[part][key] for r in rounds[setup])
                              for key in rounds[setup][0][part]} for part in ("decode", "long",
                                                                               "all")}
               for setup in SETUPS}
    print(f"{args.transfer} ({'push' if args.push else 'pull'}), {args.preset} Llama, "
          f"{args.dtype}; medians of {args.rounds} rounds:")
    print_table(medians)
    print(f"D loaded {counters['loaded_tokens']:.0f} prompt tokens from P, of "
          f"{counters['prompt_tokens']} sent to it (at least {counters['loaded_at_least']} "
          f"expected); P: {counters['p'].get('kvgraph_kv_connector_failed_pulls_total', 0):.0f}"
          f" pulls failed, "
          f"{counters['p'].get('kvgraph_kv_connector_expired_requests_total', 0):.0f} expired")
    payload = {"machine": machine(torch.device("cpu")), "args": vars(args),
               "server_args": server_args, "workload": dataclasses.asdict(work),
               "medians": medians, "rounds": rounds, "connector": counters,
               "bandwidth": bandwidth(args)}
    write_json(args.json, payload)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
