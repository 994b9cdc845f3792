"""Speculative decoding against none: decode tokens/s, acceptance, host time per step.

Two engines in one process, the same model, weights and flags but for `--speculative-config`
(default n-gram, K=3, n-grams of 2 to 4 tokens): "plain" decodes one token per request a step,
"spec" proposes up to K drafts per request, by prompt lookup or with a draft model
(`{"method": "draft_model", "model": "llama:small:1", ...}`: its first layer), and verifies them
in its next step.

The example models have random weights: what they generate, not what they are asked, decides
how often the lookups are right. Greedy decoding of the small Llama mostly falls into loops
whatever the prompt, so the workloads are measured and picked: from --pool candidates each,
"repeating" takes the prompts made of a repeated phrase whose greedy output accepted drafts
would cover most, "non-repeating" the random-id prompts whose output they would cover least (a
replay of the proposer on the plain engine's output, which counts exactly what the spec engine
will; the table reports what it did). A draft model's runs pick them by the same n-gram
replay (NGRAM), so both methods run on the same prompts. Each batch size decodes the same
--num-prompts prompts, in groups of that size.

Rounds interleave the engines (which goes first alternates). Decode time runs from the step
after every request of a group has its first token to the group's end, so prefill is left out;
tokens/s counts the tokens those steps emitted. Each step's wall time is split by timing
`runner.execute` (the model step: on the CPU its host work too) from the rest, the engine's own
host work (scheduling, sampling or verifying drafts, proposing, detokenizing), of which the
proposing is timed too (a draft model's steps are proposing, their `execute` timed apart); a
step is a "verify" step when some request in it ran drafts. The two engines' greedy tokens are
compared. Prints a table of medians, writes JSON (with a draft model, its runner's stats).

    python -m examples.benchmarks.speculative_decoding [--preset small] [--batch-sizes 1 8] \
        [--rounds 5] [--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}']
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any, Sequence

import torch

from examples.benchmarks.timing import machine, write_json
from examples.engine import LLMEngine, SamplingParams, add_engine_args, build_engine
from examples.engine.ngram_proposer import NgramProposer
from examples.engine.speculative_config import SpeculativeConfig
from examples.models import MODELS

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2,
                          prompt_lookup_max=4)
PROMPT_LEN = 32
PHRASE_LEN = 8
WORKLOADS = ("repeating", "non-repeating")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = add_engine_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per workload")
    parser.add_argument("--pool", type=int, default=64,
                        help="candidate prompts per workload to pick --num-prompts from")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="speculative_decoding.json")
    # Rounds repeat their prompts: prefix caching would skip their prefill after the first.
    parser.set_defaults(graph_mode="full", piece_compiler="inductor", threads=1,
                        max_model_len=256, enable_prefix_caching=False, speculative_config=NGRAM)
    args = parser.parse_args(argv)
    if (args.rounds < 1 or args.max_tokens < 2 or min(args.batch_sizes) < 1
            or args.pool < args.num_prompts or any(args.num_prompts % b for b in args.batch_sizes)):
        parser.error("--rounds >= 1, --max-tokens >= 2, batch sizes >= 1, --pool >= "
                     "--num-prompts, and --num-prompts a multiple of every batch size")
    args.max_num_seqs = max(args.batch_sizes)  # a group of the largest batch runs in one step
    return args


class StepClock:
    """Times an engine's steps and, inside them, its runner's `execute` (the model step), its
    speculator's `propose` and, in that, its draft model runner's `execute`."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.execute = engine.runner.execute
        # The engine calls them through their attributes: instance ones shadow the methods.
        engine.runner.execute = self._timed_execute
        if engine.speculator is not None:
            self.propose = engine.speculator.propose
            engine.speculator.propose = self._timed_propose
        draft = engine.speculator and engine.speculator.draft
        if draft:
            self.draft_execute = draft.runner.execute
            draft.runner.execute = self._timed_draft_execute
        self._execute_s = self._propose_s = self._draft_s = 0.0
        self._verify = False

    def _timed_execute(self, batch, *rest):
        # Drafts are the chunk's tokens past its first that ask for logits.
        self._verify = self._verify or any(c.num_logits > 1 for c in batch)
        start = time.perf_counter()
        try:
            return self.execute(batch, *rest)
        finally:
            self._execute_s += time.perf_counter() - start

    def _timed_draft_execute(self, batch, *rest):
        start = time.perf_counter()
        try:
            return self.draft_execute(batch, *rest)
        finally:
            self._draft_s += time.perf_counter() - start

    def _timed_propose(self, requests) -> None:
        start = time.perf_counter()
        self.propose(requests)
        self._propose_s += time.perf_counter() - start

    def step(self) -> tuple[str, tuple[float, float, float, float]]:
        """One engine step: its kind ("verify" or "decode"), and its wall, execute, propose and
        draft model execute seconds."""
        self._execute_s = self._propose_s = self._draft_s = 0.0
        self._verify = False
        start = time.perf_counter()
        self.engine.step()
        wall = time.perf_counter() - start
        return ("verify" if self._verify else "decode"), (wall, self._execute_s, self._propose_s,
                                                          self._draft_s)


def decode(clock: StepClock, prompts: list[list[int]], batch: int, max_tokens: int
           ) -> dict[str, Any]:
    """Run `prompts` in groups of `batch`, greedy; decode seconds, tokens, steps and outputs."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine, seconds, tokens, outputs = clock.engine, 0.0, 0, []
    steps: dict[str, list[tuple[float, ...]]] = {"decode": [], "verify": []}
    for first in range(0, len(prompts), batch):
        requests = [engine.add_request(p, params) for p in prompts[first:first + batch]]
        while any(not r.output_token_ids for r in requests):
            clock.step()  # prefill (and, with chunked prefill, the first decodes beside it)
        emitted = sum(len(r.output_token_ids) for r in requests)
        while engine.has_unfinished:
            kind, times = clock.step()
            steps[kind].append(times)
            seconds += times[0]
        tokens += sum(len(r.output_token_ids) for r in requests) - emitted
        outputs += [tuple(r.output_token_ids) for r in requests]
    return {"seconds": seconds, "tokens": tokens, "outputs": outputs, "steps": steps}


def ngram_replay(proposer: NgramProposer, prompt: list[int], output: Sequence[int]
                 ) -> tuple[int, int]:
    """(accepted, proposed) draft tokens, were `output` decoded greedily with `proposer`'s
    drafts: what the spec engine will count for this prompt (its tokens are the same)."""
    sequence, proposed, accepted, i = list(prompt) + list(output), 0, 0, 0
    while i < len(output) - 1:  # i + 1 tokens out; room as the engine leaves it (speculation.py)
        drafts = proposer.propose(sequence[:len(prompt) + i + 1], min(
            proposer.num_speculative_tokens, len(output) - i - 2))
        right = next((j for j, t in enumerate(drafts) if sequence[len(prompt) + i + 1 + j] != t),
                     len(drafts))
        proposed, accepted, i = proposed + len(drafts), accepted + right, i + 1 + right
    return accepted, proposed


def pick_prompts(clock: StepClock, args: argparse.Namespace) -> dict[str, Any]:
    """Each workload's prompts: of its pool, those whose greedy output the drafts cover most
    (repeating) or least (non-repeating), by a replay of the proposer on the plain output."""
    rng, vocab = random.Random(args.seed), clock.engine.runner.vocab_size
    pools = {"repeating": [[rng.randrange(2, vocab) for _ in range(PHRASE_LEN)]
                           * (PROMPT_LEN // PHRASE_LEN) for _ in range(args.pool)],
             "non-repeating": [rng.sample(range(2, vocab), PROMPT_LEN) for _ in range(args.pool)]}
    spec = args.speculative_config
    proposer = NgramProposer(spec if spec.method == "ngram" else NGRAM)
    picked = {}
    for workload, pool in pools.items():
        outputs = decode(clock, pool, args.max_num_seqs, args.max_tokens)["outputs"]
        replays = [ngram_replay(proposer, p, o) for p, o in zip(pool, outputs)]
        # Coverage: the share of the output that accepted drafts would have emitted.
        order = sorted(range(len(pool)), key=lambda i: replays[i][0],
                       reverse=workload == "repeating")[:args.num_prompts]
        picked[workload] = {"prompts": [pool[i] for i in order],
                            "coverage": [replays[i][0] / args.max_tokens for i in order],
                            "acceptance": [replays[i][0] / max(replays[i][1], 1)
                                           for i in order]}
    return picked


def median_ms(steps: list[tuple[float, ...]], what: str) -> float:
    """Median ms per step of the engine's host work (wall less execute), execute, propose or
    the draft model's execute (a part of propose)."""
    pick = {"host": lambda w, e, p, d: w - e, "execute": lambda w, e, p, d: e,
            "propose": lambda w, e, p, d: p, "draft": lambda w, e, p, d: d}[what]
    return 1e3 * statistics.median(pick(*s) for s in steps) if steps else float("nan")


def measure(clocks: dict[str, StepClock], prompts: list[list[int]], batch: int,
            args: argparse.Namespace) -> dict[str, Any]:
    """One (workload, batch) row: the engines interleaved over the rounds."""
    spec = clocks["spec"].engine
    before = spec.stats()
    ratios, rates, same = [], {"plain": [], "spec": []}, True
    steps: dict[str, dict[str, list]] = {"plain": {}, "spec": {}}
    for r in range(args.rounds):
        runs = {}
        for name in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
            runs[name] = decode(clocks[name], prompts, batch, args.max_tokens)
            rates[name].append(runs[name]["tokens"] / runs[name]["seconds"])
            for kind, rows in runs[name]["steps"].items():
                steps[name].setdefault(kind, []).extend(rows)
        same = same and runs["plain"]["outputs"] == runs["spec"]["outputs"]
        ratios.append(rates["spec"][-1] / rates["plain"][-1])
    after = spec.stats()
    drafts, proposed, accepted, draft_steps = (after.get(k, 0) - before.get(k, 0) for k in (
        "spec_decode_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
        "spec_decode_draft_model_steps"))
    return {
        "plain_tok_s": statistics.median(rates["plain"]),
        "spec_tok_s": statistics.median(rates["spec"]),
        "speedup": statistics.median(ratios), "tokens_identical": same,
        "acceptance": accepted / proposed if proposed else 0.0,
        "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
        "decode_tokens": runs["plain"]["tokens"],
        "plain_steps": len(steps["plain"]["decode"]) // args.rounds,
        "spec_verify_steps": len(steps["spec"]["verify"]) // args.rounds,
        "spec_decode_steps": len(steps["spec"]["decode"]) // args.rounds,
        "host_ms_plain_decode": median_ms(steps["plain"]["decode"], "host"),
        "host_ms_spec_verify": median_ms(steps["spec"]["verify"], "host"),
        "propose_ms_spec_verify": median_ms(steps["spec"]["verify"], "propose"),
        "execute_ms_plain_decode": median_ms(steps["plain"]["decode"], "execute"),
        "execute_ms_spec_verify": median_ms(steps["spec"]["verify"], "execute"),
        "draft_execute_ms_spec_verify": median_ms(steps["spec"]["verify"], "draft"),  # in propose
        "draft_model_steps": draft_steps // args.rounds, "tok_s_rounds": rates}


COLUMNS = (("workload", "{}"), ("batch", "{}"), ("plain tok/s", "{:.1f}"),
           ("spec tok/s", "{:.1f}"), ("spec/plain", "{:.2f}x"), ("accepted", "{:.0%}"),
           ("mean acc. len", "{:.2f}"), ("steps plain", "{}"), ("steps spec (verify)", "{}"),
           ("host ms/step plain", "{:.3f}"), ("host ms/verify", "{:.3f}"),
           ("of which propose (draft model)", "{}"),
           ("execute ms plain", "{:.2f}"), ("execute ms verify", "{:.2f}"),
           ("tokens identical", "{}"))


def table_row(workload: str, batch: int, row: dict[str, Any]) -> list[str]:
    values = (workload, batch, row["plain_tok_s"], row["spec_tok_s"], row["speedup"],
              row["acceptance"], row["mean_accepted_length"], row["plain_steps"],
              f"{row['spec_verify_steps'] + row['spec_decode_steps']} "
              f"({row['spec_verify_steps']})", row["host_ms_plain_decode"],
              row["host_ms_spec_verify"], f"{row['propose_ms_spec_verify']:.3f}" + (
                  f" ({row['draft_execute_ms_spec_verify']:.3f})" if row["draft_model_steps"]
                  else ""), row["execute_ms_plain_decode"],
              row["execute_ms_spec_verify"], "yes" if row["tokens_identical"] else "NO")
    return [fmt.format(v) for (_, fmt), v in zip(COLUMNS, values)]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = args.speculative_config
    # The plain engine's runner has num_speculative_tokens 0: it captures no verify graphs.
    clocks = {name: StepClock(build_engine(argparse.Namespace(**{
        **vars(args), "speculative_config": config}), MODELS)[0])
        for name, config in (("plain", None), ("spec", args.speculative_config))}
    picked = pick_prompts(clocks["plain"], args)  # also the plain engine's warm-up
    decode(clocks["spec"], picked["repeating"]["prompts"], args.max_num_seqs, args.max_tokens)
    rows = [(w, b, measure(clocks, picked[w]["prompts"], b, args))
            for w in WORKLOADS for b in args.batch_sizes]
    ngram = spec if spec.method == "ngram" else NGRAM
    method = (f"n-gram K={spec.num_speculative_tokens}, n " if spec.method == "ngram" else
              f"draft model {spec.model} K={spec.num_speculative_tokens}, prompts picked by "
              f"n-gram K={ngram.num_speculative_tokens}, n ")
    print(f"{args.model} {args.preset}, {args.dtype}, graph mode {args.graph_mode} "
          f"({args.piece_compiler} pieces), {args.threads} thread(s); {method}"
          f"{ngram.prompt_lookup_min}-{ngram.prompt_lookup_max}; {args.num_prompts} prompts of "
          f"{PROMPT_LEN} tokens per workload, greedy, {args.max_tokens} tokens each; median of "
          f"{args.rounds} interleaved rounds\n")
    print("| " + " | ".join(name for name, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for workload, batch, row in rows:
        print("| " + " | ".join(table_row(workload, batch, row)) + " |")
    losses = [f"{w} b={b} ({row['speedup']:.2f}x)" for w, b, row in rows if row["speedup"] < 1]
    print(f"\nspeculation loses: {', '.join(losses) or 'nowhere'}; greedy tokens identical "
          f"in every row: {'yes' if all(r['tokens_identical'] for *_, r in rows) else 'NO'}")
    stats = clocks["spec"].engine.stats()
    dispatch = ("hits", "padded_tokens", "fallbacks", "uncaptured")
    payload = {"machine": machine(torch.device("cpu")),
               "args": vars(args) | {"speculative_config": vars(spec)},
               "prompts": picked, "prompts_picked_by": vars(ngram),  # its replay's numbers
               "results": [{"workload": w, "batch": b, **row} for w, b, row in rows],
               "spec_runner": {key: v for key, v in stats["runner"].items() if key in dispatch}}
    if "draft_runner" in stats:  # the whole run's, its warm-up included
        payload["draft_runner"] = {key: v for key, v in stats["draft_runner"].items()
                                   if key in dispatch} | {
            key: stats[f"spec_decode_draft_model_{key}"] for key in ("steps", "failures")}
    write_json(args.json, json.loads(json.dumps(payload, default=str)))
    for clock in clocks.values():
        clock.engine.close()
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
