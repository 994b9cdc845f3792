"""Serving, side by side: kvgraph's and vLLM's servers on one checkpoint, `vllm bench serve`
against each in turn (A, B, A, B ...), with the same random workload.

kvgraph's server is examples/serve.py with `--threads` the thread count; vLLM's is `vllm serve`
with its OpenMP threads bound to that many CPUs. Both serve the checkpoint under
its directory's name, without prefix caching (as offline), and stay up together: the one not
being measured is stopped meanwhile (quiet.py says why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.benchmarks.engine_worker import REPO
from examples.benchmarks.quiet import paused, wait_until_quiet
from examples.benchmarks.vllm_env import VllmEnv

STARTUP_TIMEOUT_S = 900  # both compile at start-up; a busy 2-core machine takes minutes
LOG_TAIL_CHARS = 3000
# What the bench run reports -> this script's metric name.
BENCH_METRICS = {"request_throughput": "serve_req_s", "p50_itl_ms": "serve_itl_p50_ms",
                 "p99_itl_ms": "serve_itl_p99_ms"}


@dataclass
class Server:
    """A server subprocess, its URL and its log file."""

    engine: str
    process: subprocess.Popen
    url: str
    log: Path

    def wait_ready(self) -> None:
        """Return once /health answers; a clear error, with the log's tail, if it never does."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.engine} server exited ({self.process.returncode})"
                                   f"; the end of {self.log}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"the {self.engine} server did not answer /health in "
                           f"{STARTUP_TIMEOUT_S} s; see {self.log}")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-LOG_TAIL_CHARS:]

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(engine: str, command: list[str], env: dict[str, str], port: int, logs: Path
           ) -> Server:
    log = logs / f"{engine}-server.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   cwd=REPO)
    return Server(engine, process, f"http://127.0.0.1:{port}", log)


def start_servers(vllm: VllmEnv, checkpoint: Path, dtype: str, cpus: list[int], args: Any,
                  logs: Path) -> dict[str, Server]:
    """Both servers, started together and ready."""
    common = ["--dtype", dtype, "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", str(args.max_num_seqs), "--no-enable-prefix-caching"]
    port = free_port()
    kvgraph = _start("kvgraph", [sys.executable, "-m", "examples.serve", "--model",
                                 str(checkpoint), "--port", str(port), *common,
                                 "--threads", str(len(cpus)), "--graph-mode", args.graph_mode,
                                 *args.kvgraph_arg], dict(os.environ), port, logs)
    port = free_port()
    vllm_server = _start("vllm", [str(vllm.cli), "serve", str(checkpoint), "--port", str(port),
                                  *common, "--served-model-name", checkpoint.name,
                                  "--gpu-memory-utilization", str(args.gpu_memory_utilization)],
                         vllm.environ(cpus, args.preload), port, logs)
    servers = {"kvgraph": kvgraph, "vllm": vllm_server}
    try:
        for server in servers.values():
            server.wait_ready()
    except BaseException:
        for server in servers.values():
            server.close()
        raise
    return servers


def bench(vllm: VllmEnv, server: Server, checkpoint: Path, args: Any, out: Path,
          warmups: int) -> dict[str, float]:
    """One `vllm bench serve` run against `server`: its requests/s and ITL p50 and p99."""
    result = out / f"{server.engine}-{time.monotonic_ns()}.json"
    command = [str(vllm.cli), "bench", "serve", "--backend", "openai", "--base-url", server.url,
               "--endpoint", "/v1/completions", "--model", checkpoint.name,
               "--tokenizer", str(checkpoint), "--dataset-name", "random",
               "--random-input-len", str(args.serve_input_len),
               "--random-output-len", str(args.serve_output_len),
               "--num-prompts", str(args.serve_prompts),
               "--max-concurrency", str(args.serve_concurrency), "--ignore-eos",
               "--num-warmups", str(warmups), "--percentile-metrics", "itl",
               "--metric-percentiles", "50,99", "--disable-tqdm", "--seed", "0",
               "--save-result", "--result-dir", str(out), "--result-filename", result.name]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not result.is_file():
        raise RuntimeError(f"vllm bench serve against {server.engine} failed "
                           f"({done.returncode}):\n{done.stdout[-LOG_TAIL_CHARS:]}"
                           f"{done.stderr[-LOG_TAIL_CHARS:]}\nserver log {server.log}:\n"
                           f"{server.log_tail()}")
    report = json.loads(result.read_text())
    if report.get("completed") != args.serve_prompts:
        raise RuntimeError(f"vllm bench serve against {server.engine}: "
                           f"{report.get('completed')} of {args.serve_prompts} requests "
                           f"completed; errors: {report.get('errors', [])[:3]}; server log "
                           f"{server.log}")
    return {name: float(report[key]) for key, name in BENCH_METRICS.items()}


def measure_serving(vllm: VllmEnv, checkpoint: Path, dtype: str, cpus: list[int], args: Any
                    ) -> dict[str, dict[str, list[float]]]:
    """metric -> engine -> one sample per round, rounds interleaved between the servers."""
    samples: dict[str, dict[str, list[float]]] = {
        metric: {"kvgraph": [], "vllm": []} for metric in BENCH_METRICS.values()}
    logs = Path(tempfile.mkdtemp(prefix="vs_vllm_serve_"))
    print(f"  serving: logs and bench results in {logs}", flush=True)
    servers = start_servers(vllm, checkpoint, dtype, cpus, args, logs)
    try:
        for round_ in range(args.serve_rounds):
            for engine, server in servers.items():
                wait_until_quiet([s.process.pid for s in servers.values()])
                # The first round warms each server up (its first requests compile nothing
                # new, but allocators and caches grow).
                with paused([s.process.pid for s in servers.values() if s is not server]):
                    row = bench(vllm, server, checkpoint, args, logs,
                                warmups=args.serve_concurrency if round_ == 0 else 0)
                for metric, value in row.items():
                    samples[metric][engine].append(value)
                print(f"  serve round {round_ + 1} {engine}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    finally:
        for server in servers.values():
            server.close()
    return samples
