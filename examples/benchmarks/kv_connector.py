"""The shared-storage KV connector: time to first token of a long prompt, and the hooks' cost.

Time to first token (TTFT) of one greedy request with a --prompt-len token prompt, four ways,
every engine built fresh (same model and flags), rounds alternating which is built first:
- cold: no connector, nothing cached (the prompt is computed);
- cold+save: the connector on an empty store (computed, and its blocks saved);
- storage: a fresh engine on the store cold+save filled (a restart: blocks loaded from disk);
- memory: the cold engine asked again (in-memory prefix caching).
Then the host cost of a layer-by-layer connector's hooks: decode steps of a runner in piecewise
mode with a connector whose hooks do nothing, against one without (steps interleaved), and the
hook calls each counted (zero without a connector). Prints medians, writes JSON.

    python -m examples.benchmarks.kv_connector [--preset small] [--prompt-len 1024] \
        [--threads 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from typing import Any, Sequence

import torch

import kvgraph
from examples.benchmarks.timing import machine, write_json
from examples.engine import LLMEngine, SamplingParams, add_engine_args, build_engine
from examples.models import MODELS
from kvgraph.kv_transfer import KVConnectorBase, KVConnectorRole, KVTransferConfig

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
WAYS = ("cold", "cold+save", "storage", "memory")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = add_engine_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-steps", type=int, default=200,
                        help="decode steps timed per runner for the hooks' cost")
    parser.add_argument("--json", default="kv_connector.json")
    parser.set_defaults(max_model_len=2048, threads=1)
    args = parser.parse_args(argv)
    if args.prompt_len >= args.max_model_len or args.rounds < 1 or args.decode_steps < 1:
        parser.error("--prompt-len must be below --max-model-len; --rounds and --decode-steps "
                     "at least 1")
    return args


def engine(args: argparse.Namespace, store: str | None) -> LLMEngine:
    config = None if store is None else KVTransferConfig.from_dict({
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"shared_storage_path": store}})
    return build_engine(argparse.Namespace(**{**vars(args), "kv_transfer_config": config}),
                        MODELS)[0]


def ttft_s(engine: LLMEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.generate([prompt], FIRST_TOKEN)
    return time.perf_counter() - start


def ttft_round(args: argparse.Namespace, prompt: list[int], storage_first: bool
               ) -> dict[str, float]:
    """One sample of each way. cold+save fills a fresh store first; then, in the order asked,
    the restart on that store, and a fresh engine's first request (cold) and second (memory)."""
    store = tempfile.mkdtemp(prefix="kvgraph-bench-kv-")
    try:
        saving = engine(args, store)
        samples = {"cold+save": ttft_s(saving, prompt)}
        saving.runner.close()
        for part in (("storage", "cold") if storage_first else ("cold", "storage")):
            fresh = engine(args, store if part == "storage" else None)
            samples[part] = ttft_s(fresh, prompt)
            if part == "cold":
                samples["memory"] = ttft_s(fresh, prompt)
            fresh.runner.close()
        return samples
    finally:
        shutil.rmtree(store, ignore_errors=True)


class NoOpLayerConnector(KVConnectorBase):
    """A layer-by-layer connector whose hooks do nothing: what the hooks cost by themselves."""

    layerwise = True


def hook_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Median decode step (ms) of a piecewise runner with and without no-op layer hooks."""
    runners = {}
    for name, connector in (("off", None), ("on", NoOpLayerConnector(
            KVTransferConfig("NoOp"), KVConnectorRole.WORKER, 16))):
        torch.manual_seed(args.seed)
        model = MODELS[args.model].from_preset(args.preset, dtype=torch.float32, seed=args.seed)
        config = kvgraph.CompilationConfig(graph_mode="piecewise", piece_compiler="eager",
                                           capture_sizes=[1])
        runners[name] = kvgraph.ModelRunner(model, config, num_blocks=64, block_size=16,
                                            max_num_seqs=1, max_model_len=1024,
                                            kv_connector=connector)
        runners[name].capture()
    times: dict[str, list[float]] = {"off": [], "on": []}
    for step in range(args.decode_steps):
        for name in (("off", "on") if step % 2 else ("on", "off")):
            chunk = kvgraph.RequestChunk([step % 200 + 2], step % 60, [0, 1, 2, 3])
            start = time.perf_counter()
            runners[name].execute([chunk])
            times[name].append(time.perf_counter() - start)
    stats = {name: runner.stats()["kv_connector"] for name, runner in runners.items()}
    layers = len(kvgraph.attention_layers(runners["on"].model))
    direct = direct_cost_us(runners["on"])
    for runner in runners.values():
        runner.close()
    off, on = (1e3 * statistics.median(times[n]) for n in ("off", "on"))
    return {"step_ms_off": off, "step_ms_on": on, "hooks_us_per_step": 1e3 * (on - off),
            "layers": layers, "hook_calls_on": stats["on"]["layer_hook_calls"],
            "hook_calls_off": stats["off"]["layer_hook_calls"], "steps": args.decode_steps,
            **direct}


def direct_cost_us(runner: kvgraph.ModelRunner, calls: int = 100_000) -> dict[str, float]:
    """The hooks' own host time, timed alone (a decode step's difference is within its noise
    on a shared VM): one layer's two calls, and the step's wrapper around the forward."""
    connector = runner.kv_connector
    kv_cache = list(next(iter(runner.kv_caches.values())))
    start = time.perf_counter()
    for _ in range(calls):
        connector.hooks.before_attention(kv_cache)
        connector.hooks.after_attention(kv_cache, None)
    layer = (time.perf_counter() - start) / calls
    start = time.perf_counter()
    for _ in range(calls // 10):
        with connector.step(None, None):
            pass
    return {"hooks_us_per_layer": 1e6 * layer,
            "step_wrapper_us": 1e6 * (time.perf_counter() - start) / (calls // 10)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    prompt = [random.Random(args.seed).randrange(2, 256) for _ in range(args.prompt_len)]
    samples = [ttft_round(args, prompt, storage_first=bool(r % 2)) for r in range(args.rounds)]
    medians = {way: 1e3 * statistics.median(s[way] for s in samples) for way in WAYS}
    hooks = hook_cost(args)
    print(f"TTFT of a {args.prompt_len}-token prompt ({args.model} {args.preset}, "
          f"{args.threads} thread(s), median of {args.rounds} rounds, ways interleaved):")
    for way in WAYS:
        print(f"  {way:10s} {medians[way]:9.1f} ms   {medians['cold'] / medians[way]:5.2f}x "
              "cold's speed")
    print(f"layer hooks, piecewise decode step: {hooks['step_ms_off']:.3f} ms off, "
          f"{hooks['step_ms_on']:.3f} ms on ({hooks['hooks_us_per_step']:+.1f} us per step, "
          f"{hooks['hook_calls_on']} calls over {hooks['layers']} layers; "
          f"{hooks['hook_calls_off']} calls off); timed alone: "
          f"{hooks['hooks_us_per_layer']:.2f} us per layer, {hooks['step_wrapper_us']:.2f} us "
          "per step around the forward")
    payload = {"machine": machine(torch.device("cpu")), "args": vars(args) | {
        "kv_transfer_config": None}, "ttft_ms": medians, "samples": samples, "hooks": hooks}
    write_json(args.json, json.loads(json.dumps(payload, default=str)))
    return payload


if __name__ == "__main__":
    main()
