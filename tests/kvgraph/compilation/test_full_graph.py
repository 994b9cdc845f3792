"""Whole-graph builds (attention inside the inductor graph) call the op on the caches in place."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import kvgraph
from tests.support.scenario import bind_fresh_caches, make_model, run_schedule


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_compile_state")
def test_generated_code_calls_attention_on_the_cache_inputs_without_copies(inductor_config):
    model, reference = make_model("llama"), make_model("llama")
    caches, reference_caches = bind_fresh_caches(model), bind_fresh_caches(reference)
    compiled = kvgraph.compile_model(model, inductor_config.replace(graph_mode="full"))
    logits, codes = run_and_get_code(lambda: run_schedule(compiled, model, [[(0, 5), (1, 2)]]))
    expected = run_schedule(reference, reference, [[(0, 5), (1, 2)]])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    for name in caches:
        for got, want in zip(caches[name], reference_caches[name]):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    code = "\n".join(codes)
    calls = re.findall(r"torch\.ops\.kvgraph\.unified_attention\.default\((.*)\)", code)
    # One call per layer in each build (general, and static for each compile size).
    assert calls and len(calls) % len(caches) == 0, code
    cache_args = [re.search(r"kv_cache=\[(\w+), (\w+)\]", call).groups() for call in calls]
    for key, value in cache_args:
        assert re.fullmatch(r"arg\d+_1", key) and re.fullmatch(r"arg\d+_1", value), "not graph inputs"
        for arg in (key, value):
            # Any kernel or copy touching a cache would read or write all of it.
            touching = [line for line in code.splitlines() if re.search(rf"\b{arg}\b", line)
                        and re.search(r"copy|clone|cpp_fused|extern_kernels|aten\.", line)]
            assert not touching, f"{arg} (a KV cache) is used outside attention: {touching}"
