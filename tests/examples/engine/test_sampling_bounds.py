"""Sampling values are bounded where they are parsed, and a request whose logits row no token
can be sampled from fails alone.

One test per adversarial finding (issue 42, third round): a tiny repetition_penalty made a row
infinite (the sampler emitted token 256, the vocabulary size, and with logprobs the whole step
failed); chat's top_logprobs over its bound was refused naming logprobs; 300,000 stop strings
slowed every request beside them. The sampler's own defense is checked with a model whose
forward really makes one request's row NaN, and with a penalty past validation's bound; the
reference for the other requests is each run alone.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from examples.engine import RequestError, SamplingParams
from examples.engine import sampling_params as bounds
from examples.engine.detokenizer import Detokenizer
from examples.engine.protocol import parse_chat, parse_completion
from examples.engine.request import Request
from examples.engine.sampler import Sampler
from examples.engine.tokenizer import ByteTokenizer
from examples.models.llama import Llama
from tests.support.engines import PROMPTS, make_engine

VOCAB = 256  # the tiny Llama's
# A token whose hidden state NaNLlama makes NaN: a prompt ending in it has a NaN logits row.
# A byte no UTF-8 text holds, which the innocent requests never generate (`alone` checks).
NAN_TOKEN = 255
POISONED = [5, 6, 7, NAN_TOKEN]
HEALTHY = [5, 6, 7, 8]
# Short prompts, so that they and POISONED are prefilled in one step of 32 tokens.
INNOCENT = [PROMPTS[0], PROMPTS[1]]
INNOCENT_PARAMS = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
                   SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                                  ignore_eos=True, logprobs=2)]


class ChatByteTokenizer(ByteTokenizer):
    """Byte tokens, with a chat template: each message's content, one after another."""

    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def encode_chat(self, messages) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))


class NaNLlama(Llama):
    """The tiny Llama, whose output hidden state is NaN at every NAN_TOKEN (after the layers:
    the KV cache, and so every other token, stays as it is)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = super().forward(input_ids, positions)
        return hidden.masked_fill((input_ids == NAN_TOKEN)[:, None], torch.nan)


def nan_model():
    return NaNLlama.from_preset("tiny", seed=1)


def run(engine, prompts, params) -> list[tuple]:
    """Every request to its end: per request, (tokens, their logprobs, error)."""
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_unfinished:
        for output in engine.step():
            outputs[output.request_id].append(output)
    return [(tuple(t for o in outputs[r.request_id] for t in o.token_ids),
             tuple(o.logprobs for o in outputs[r.request_id] if o.token_ids),
             r.error) for r in requests]


def assert_same(runs, expected) -> None:
    """The same tokens, errors and top ids; logprobs equal to rounding (a batch's matmuls may
    round differently from a single request's)."""
    def exact(run):
        tokens, logprobs, error = run
        return tokens, error, [(lp.token_id, [i for i, _ in lp.top]) for lp in logprobs]

    def values(run):
        return [v for lp in run[1] for v in (lp.logprob, *(v for _, v in lp.top))]

    assert [exact(r) for r in runs] == [exact(r) for r in expected]
    for got, want in zip(runs, expected):
        assert values(got) == pytest.approx(values(want), abs=1e-4)


@pytest.fixture(scope="module")
def alone():
    """Each innocent request run alone on a healthy engine (the same weights)."""
    engine = make_engine(nan_model)
    runs = [run(engine, [p], [sp])[0] for p, sp in zip(INNOCENT, INNOCENT_PARAMS)]
    assert all(NAN_TOKEN not in tokens and error is None for tokens, _, error in runs)
    return runs


def assert_fails_alone(engine, prompt, params: SamplingParams, alone, reason: str) -> None:
    """`prompt` with `params` beside the innocent requests, in one step: it fails with
    `reason`, and they get the tokens and logprobs they get alone."""
    *others, failed = run(engine, INNOCENT + [prompt], INNOCENT_PARAMS + [params])
    assert_same(others, alone)
    tokens, _, error = failed
    assert tokens == () and error == f"sampling failed: SamplingError: {reason}"
    assert engine.stats()["failed"] == 1
    assert engine.allocator.num_free == engine.allocator.num_blocks


# --- bounds where the values are parsed -------------------------------------------------------

@pytest.mark.parametrize("name, value", [
    ("repetition_penalty", 1e-45), ("repetition_penalty", 5e-324),
    ("stop", ["x"] * 300_000), ("stop", ["x" * 100_000]),
])
def test_values_past_their_bounds_are_refused_naming_them(name, value):
    with pytest.raises(RequestError) as refused:
        SamplingParams(**{name: value})
    assert refused.value.param == name and str(refused.value).startswith(name)


def test_the_bounds_themselves_are_accepted_and_one_past_them_refused():
    at_bounds = dict(repetition_penalty=bounds.MIN_REPETITION_PENALTY,
                     stop=["x" * bounds.MAX_STOP_CHARS] * bounds.MAX_STOP_STRINGS)
    SamplingParams(**at_bounds)
    for name, past in [("repetition_penalty", bounds.MIN_REPETITION_PENALTY / 2),
                       ("stop", at_bounds["stop"] + ["x"]),
                       ("stop", ["x" * (bounds.MAX_STOP_CHARS + 1)])]:
        with pytest.raises(RequestError, match=f"^{name}") as refused:
            SamplingParams(**{**at_bounds, name: past})
        assert refused.value.param == name


def test_chat_top_logprobs_over_its_bound_is_refused_naming_top_logprobs():
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    for top in (21, -1):
        with pytest.raises(RequestError) as refused:
            parse_chat({**body, "top_logprobs": top}, ByteTokenizer())
        assert refused.value.param == "top_logprobs"
        assert str(refused.value) == f"top_logprobs must be an integer in [0, 20], got {top}"


def test_tiny_temperatures_and_top_ps_are_greedy_not_a_division():
    engine = make_engine(nan_model)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = engine.generate(INNOCENT, greedy)
    for tiny in (dict(temperature=1e-45), dict(temperature=5e-324),
                 dict(top_p=5e-324, seed=3), dict(top_p=1e-45, seed=3)):
        got = engine.generate(INNOCENT, SamplingParams(max_tokens=8, ignore_eos=True, **tiny))
        assert [c.token_ids for c in got] == [c.token_ids for c in expected], tiny


# --- the sampler's defense: a broken row stays in its request --------------------------------

@pytest.mark.parametrize("temperature", [0, 1.0], ids=["greedy", "sampled"])
def test_a_row_the_model_makes_nan_fails_alone(alone, temperature):
    poisoned = SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True, logprobs=2)
    assert_fails_alone(make_engine(nan_model), POISONED, poisoned, alone,
                       "the logits of this request's row are not finite (NaN) from the model")


def test_a_penalty_past_the_bound_makes_its_row_infinite_and_fails_only_that_request(alone):
    # What validation now refuses, put past it as a bug elsewhere could: the row's positive
    # logits divided by float32's smallest number are +inf.
    poisoned = SamplingParams(max_tokens=8, seed=5, ignore_eos=True, logprobs=2)
    object.__setattr__(poisoned, "repetition_penalty", 1e-45)
    assert_fails_alone(make_engine(nan_model), HEALTHY, poisoned, alone,
                       "the logits of this request's row are not finite (+inf) after its "
                       "penalties")


def test_every_sampled_token_lies_in_the_vocabulary(alone):
    """Broken rows through each of the sampler's paths (greedy, plain, top-k, top-p), beside
    the innocent requests: only ids in the vocabulary come out, and only the innocent ones."""
    broken = [SamplingParams(max_tokens=8, ignore_eos=True, seed=2, **f)
              for f in (dict(temperature=0), {}, dict(top_k=3), dict(top_p=0.5))]
    for params in broken[:2]:
        object.__setattr__(params, "repetition_penalty", 5e-324)  # 0 in float32: logit / 0
    results = run(make_engine(nan_model), INNOCENT + [HEALTHY] * 2 + [POISONED] * 2,
                  INNOCENT_PARAMS + broken)
    assert all(0 <= t < VOCAB for tokens, _, _ in results for t in tokens)
    assert_same(results[:2], alone)
    assert all(tokens == () and error.startswith("sampling failed: SamplingError: the logits")
               for tokens, _, error in results[2:])


def test_the_sampler_names_each_broken_row_and_samples_the_others_as_alone():
    """The sampler alone, on rows no model here produces: masked tokens (-inf) at a
    temperature float32 cannot hold, and a row masked everywhere."""
    sampler = Sampler("cpu")
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[0, 10:] = -torch.inf  # masked: -inf / inf would be NaN
    logits[1] = -torch.inf
    logits[2, 7] = torch.nan
    params = [SamplingParams(temperature=1e300, seed=1), SamplingParams(seed=2),
              SamplingParams(temperature=0), SamplingParams(top_p=0.9, seed=4)]
    requests = [Request(f"r{i}", [1], p, Detokenizer(ByteTokenizer()), 0.0,
                        generator=sampler.new_generator(p.seed or 0))
                for i, p in enumerate(params)]
    picked = sampler(logits, requests)
    assert 0 <= picked[0] < 10
    assert [str(e) for e in picked[1:3]] == [
        "the logits of this request's row are not finite (-inf everywhere) from the model",
        "the logits of this request's row are not finite (NaN) from the model"]
    requests[3].generator = sampler.new_generator(4)
    assert picked[3] == sampler(logits[3:], requests[3:])[0]


# --- through the server -----------------------------------------------------------------------

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.support.servers import stream_text  # noqa: E402

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    from examples.engine import AsyncEngine
    from examples.serve import BackgroundServer, build_app

    engine = make_engine(nan_model, tokenizer=ChatByteTokenizer())
    with BackgroundServer(build_app(AsyncEngine(engine), "tiny")) as background:
        yield background.url


@pytest.mark.parametrize("path, fields, name", [
    (COMPLETIONS, {"repetition_penalty": 1e-45, "logprobs": 2}, "repetition_penalty"),
    (COMPLETIONS, {"repetition_penalty": 5e-324}, "repetition_penalty"),
    (COMPLETIONS, {"stop": ["x"] * 300_000}, "stop"),
    (COMPLETIONS, {"stop": ["x" * 100_000]}, "stop"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_out_of_bound_values_are_a_400_naming_the_field(server, path, fields, name, stream):
    base = ({"prompt": "hello"} if path == COMPLETIONS
            else {"messages": [{"role": "user", "content": "hello"}]})
    response = httpx.post(f"{server}{path}", json={**base, **fields, "stream": stream},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and error["message"].startswith(name), error


def test_a_nan_row_fails_its_request_alone_and_a_concurrent_one_is_answered(server):
    innocent = {"prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                "logprobs": 2}
    poisoned = {"prompt": POISONED, "max_tokens": 4, "temperature": 1.0, "logprobs": 2}

    async def beside_poisoned(client):
        started = asyncio.Event()
        other = asyncio.create_task(stream_text(client, innocent, started))
        await started.wait()
        failed = await asyncio.gather(client.post(COMPLETIONS, json=poisoned),
                                      client.post(COMPLETIONS, json={**poisoned, "stream": True}))
        return failed, not other.done(), await other

    async def with_client(work):
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            return await work(client)

    expected = httpx.post(f"{server}{COMPLETIONS}", json=innocent, timeout=60).json()
    failed, in_flight, text = asyncio.run(with_client(beside_poisoned))
    assert in_flight and text == expected["choices"][0]["text"]
    for response in failed:  # the streamed one too: it failed before its first token
        assert response.status_code == 500, response.text
        assert ("the logits of this request's row are not finite (NaN) from the model"
                in response.json()["error"]["message"])


def test_completions_logprobs_over_its_bound_still_names_logprobs():
    with pytest.raises(RequestError) as refused:
        parse_completion({"prompt": "hi", "logprobs": 21}, ByteTokenizer())
    assert refused.value.param == "logprobs"
