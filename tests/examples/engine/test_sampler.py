"""The batched sampler against a per-request reference written the plain way.

The reference takes one request at a time: a full sort for its top-k and top-p, float64
throughout, and the same uniform number from a generator seeded like the request's. The
batched sampler must pick the very same tokens, whatever else is in the batch.
"""

from __future__ import annotations

import collections

import pytest
import torch

from examples.engine.detokenizer import Detokenizer
from examples.engine.request import Request
from examples.engine.sampler import Sampler
from examples.engine.sampling_params import SamplingParams
from examples.engine.tokenizer import ByteTokenizer
from tests.support.filtered_probs import filtered_probs

VOCAB = 300
MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=0.7),
         SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=0.9, top_p=0.8),
         SamplingParams(temperature=1.0, top_k=40, top_p=0.5),
         SamplingParams(temperature=2.0, top_p=0.999), SamplingParams(temperature=0.5, top_k=1),
         SamplingParams(temperature=1.0, top_k=VOCAB + 5)]


def requests(sampler: Sampler, params: list[SamplingParams], seed: int) -> list[Request]:
    return [Request(f"r{i}", [1], p, Detokenizer(ByteTokenizer()), 0.0,
                    generator=sampler.new_generator(seed + i)) for i, p in enumerate(params)]


def reference(logits: torch.Tensor, params: SamplingParams, seed: int) -> int:
    """One request's token: greedy, or its filtered distribution at the draw of its seed
    (in vocabulary order without a filter, most likely first with one)."""
    logits = logits.double()
    if params.greedy:
        return int(logits.argmax())
    probs, order = filtered_probs(logits, params), torch.arange(len(logits))
    if 0 < params.top_k < len(logits) or params.top_p < 1:  # a filter: most likely first
        order = (logits / params.temperature).sort(descending=True).indices
        probs = probs[order]
    draw = torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return int(order[torch.searchsorted(probs.cumsum(dim=0), draw * probs.sum(), right=True)])


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat, typical, peaked distributions
def test_the_batch_picks_what_each_request_picks_alone(scale):
    generator = torch.Generator().manual_seed(int(scale * 10))
    for step in range(20):
        logits = torch.randn(len(MIXED), VOCAB, generator=generator) * scale
        batch = Sampler("cpu")(logits, requests(Sampler("cpu"), MIXED, seed=100 * step))
        expected = [reference(row, p, 100 * step + i)
                    for i, (row, p) in enumerate(zip(logits, MIXED))]
        assert batch == expected
        for i in range(len(MIXED)):  # and each alone, in a batch of one
            alone = Sampler("cpu")(logits[i:i + 1], requests(Sampler("cpu"), [MIXED[i]],
                                                               seed=100 * step + i))
            assert alone == [expected[i]]


def test_a_draw_at_the_top_of_the_range_never_picks_a_removed_token(monkeypatch):
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0] + [-50.0] * 20])
    sampler = Sampler("cpu")
    monkeypatch.setattr(sampler, "_uniforms",
                        lambda reqs: torch.full((len(reqs), 1), 1 - 2.0**-53, dtype=torch.float64))
    for params in (SamplingParams(top_k=2), SamplingParams(top_p=0.5), SamplingParams()):
        picked = sampler(logits, requests(sampler, [params], seed=0))[0]
        assert logits[0, picked] > -50, params


def test_frequencies_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5]])
    probs = logits[0, :3].softmax(dim=0)  # top-k 4, then top-p 0.8: 0.90 comes before the 4th
    sampler = Sampler("cpu", seed=0)
    request = requests(sampler, [SamplingParams(temperature=1.0, top_k=4, top_p=0.8)], 0)[0]
    request.generator = None  # the sampler's shared stream
    counts = collections.Counter(sampler(logits.expand(2000, -1), [request] * 2000))
    assert set(counts) <= {0, 1, 2}
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / 2000 - p) < 0.04, (token, counts)


def test_unseeded_requests_repeat_for_the_same_sampler_seed():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3))
    unseeded = [SamplingParams(temperature=1.0, top_p=0.9)] * 6

    def run(seed: int) -> list[int]:
        sampler = Sampler("cpu", seed=seed)
        reqs = requests(sampler, unseeded, 0)
        for r in reqs:
            r.generator = None
        return sampler(logits, reqs) + sampler(logits, reqs)

    assert run(1) == run(1)
    assert run(1) != run(2)
