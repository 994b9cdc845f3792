"""The decode benchmark's reference rows: what kvgraph is measured against.

- `static`: a plain static-cache Llama (`static_llama.py`) whose decode step is compiled with
  `torch.compile(mode="reduce-overhead")` (CUDA graphs on a GPU; plain inductor on the CPU);
- `hf`: Hugging Face `generate` with `cache_implementation="static"`, which compiles its decode
  step itself where HF chooses to (on CUDA), per step as (t(N + k) - t(N)) / k;
- `bound`: the HBM bound, the bytes one step must read (weights, and the KV cache once) over
  the copy bandwidth measured here.

All use the same weights as the kvgraph rows, and the same prompts.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Mapping

import torch

from examples.benchmarks.decode_runner import WARMUP_STEPS, prompts, token_match
from examples.benchmarks.static_llama import StaticLlama
from examples.benchmarks.timing import copy_bandwidth, median_ms, synchronize, timed
from examples.models.llama import PRESETS, Llama

HF_SHORT = 4  # N: tokens of the shorter HF generate; the longer one adds --steps tokens
HF_REPEATS = 3


def free_compiled() -> None:
    """Drop compiled code and its graphs (and their device memory) before the next row."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompt_ids(batch: int, args, vocab: int) -> torch.Tensor:
    return torch.tensor(prompts(batch, args.prompt_len, vocab), device=args.device)


def static_decode(model: StaticLlama, step, batch: int, args, steps: int):
    """Prefill (eager), then `steps` compiled greedy steps: tokens `[batch, steps + 1]`, seconds."""
    model.setup_cache(batch, args.max_len)
    positions = torch.arange(args.max_len, device=args.device)
    with torch.no_grad():
        ids = prompt_ids(batch, args, model.config.vocab_size)
        synchronize(args.device)
        start = time.perf_counter()
        token = model(ids, positions[:args.prompt_len]).argmax(-1, keepdim=True)
        synchronize(args.device)
        seconds = [time.perf_counter() - start]  # the prefill first, then each decode step
        tokens = [token]
        for pos in range(args.prompt_len, args.prompt_len + steps):
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are consumed
            start = time.perf_counter()
            logits = step(token, positions[pos:pos + 1])
            synchronize(args.device)
            seconds.append(time.perf_counter() - start)
            token = logits.argmax(-1, keepdim=True)
            tokens.append(token)
    return torch.cat(tokens, dim=1).cpu(), seconds


def static_row(args, llama: Llama, reference: Mapping[int, torch.Tensor]) -> dict[str, Any]:
    """The static-cache Llama under `torch.compile(mode="reduce-overhead")`."""
    model = StaticLlama.like(llama)
    step = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
    row: dict[str, Any] = {"name": "static + reduce-overhead", "ms": {}, "token_match": {},
                           "prefill_tok_s": {}}
    for batch in args.batch_sizes:
        tokens, _ = static_decode(model, step, batch, args, args.parity_steps)
        row["token_match"][batch] = token_match(tokens, reference.get(batch))
        _, seconds = static_decode(model, step, batch, args, WARMUP_STEPS + args.steps)
        row["ms"][batch] = median_ms(seconds[1 + WARMUP_STEPS:])
        row["prefill_tok_s"][batch] = batch * args.prompt_len / seconds[0]
    del model, step
    free_compiled()
    return row


def hf_model(llama: Llama, args):
    """A transformers LlamaForCausalLM with `llama`'s config and weights."""
    import transformers

    config = transformers.LlamaConfig(**PRESETS[args.preset])
    with torch.device(args.device):  # built where it runs: random init there is fast
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=args.torch_dtype)
    model.load_state_dict(llama.hf_state_dict())
    return model.eval().requires_grad_(False)


def hf_batch(model, batch: int, args, reference: torch.Tensor | None) -> tuple[float, float]:
    """HF's ms per decode step at one batch size, (t(N + k) - t(N)) / k; its token match."""
    ids = prompt_ids(batch, args, model.config.vocab_size)

    def generate(new_tokens: int) -> torch.Tensor:
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              cache_implementation="static", pad_token_id=0)

    long = HF_SHORT + args.steps
    generate(long)  # warm-up, the longest first: later static caches keep its size
    match = token_match(generate(long)[:, args.prompt_len:].cpu(), reference)
    deltas = [(timed(lambda: generate(long), args.device)
               - timed(lambda: generate(HF_SHORT), args.device)) / args.steps
              for _ in range(HF_REPEATS)]
    return 1000 * statistics.median(deltas), match


def hf_prefill_tok_s(model, batch: int, args) -> float:
    """Tokens per second of HF's forward over `batch` prompts at once (its prefill)."""
    ids = prompt_ids(batch, args, model.config.vocab_size)
    with torch.no_grad():
        model(ids)  # warm-up
        return batch * args.prompt_len / timed(lambda: model(ids), args.device)


def hf_row(args, llama: Llama, reference: Mapping[int, torch.Tensor]) -> dict[str, Any] | None:
    """HF generate with a static cache; None (with the reason printed) without transformers."""
    try:
        model = hf_model(llama, args)
    except ImportError as error:
        print(f"skipping the HF row: transformers is not importable ({error})")
        return None
    row: dict[str, Any] = {"ms": {}, "token_match": {}, "prefill_tok_s": {}}
    for batch in args.batch_sizes:
        row["ms"][batch], row["token_match"][batch] = hf_batch(model, batch, args,
                                                               reference.get(batch))
        row["prefill_tok_s"][batch] = hf_prefill_tok_s(model, batch, args)
    row["compiled"] = hasattr(model, "_compiled_call")  # HF compiles where it chooses to
    row["name"] = "hf static cache" + (", compiled" if row["compiled"] else "")
    del model
    free_compiled()
    return row


def step_bytes(llama: Llama, batch: int, context: int) -> int:
    """Bytes one decode step must read: every weight but the embedding table (one row per
    token), and `context` cached keys and values per request."""
    weights = {id(p): p for name, p in llama.named_parameters(remove_duplicate=False)
               if not name.startswith("model.embed_tokens")}
    weight_bytes = sum(p.numel() * p.element_size() for p in weights.values())
    config, element = llama.config, llama.lm_head.weight.element_size()
    kv_bytes = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
                * element * batch * context)
    return weight_bytes + kv_bytes


def bound_row(args, llama: Llama) -> dict[str, Any]:
    """The HBM (on a CPU: memory) bound per batch size, at the timed steps' mean context."""
    bandwidth = copy_bandwidth(args.device)
    context = args.prompt_len + WARMUP_STEPS + args.steps // 2
    return {"name": "memory bound", "bandwidth_bytes_per_s": bandwidth, "context": context,
            "ms": {b: 1000 * step_bytes(llama, b, context) / bandwidth for b in args.batch_sizes},
            "bytes": {b: step_bytes(llama, b, context) for b in args.batch_sizes}}
