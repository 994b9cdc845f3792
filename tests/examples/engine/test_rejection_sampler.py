"""The rejection sampler against references written the plain way.

Greedy: a walk taking each row's argmax, as decoding without speculation does. Sampled: a
chi-square test that each emitted token is distributed as the target's own filtered
distribution (computed here by a sort in float64), whatever the drafts; seeded requests emit
the same tokens in any batch; a row no token can be drawn from fails its request alone.
"""

from __future__ import annotations

import math

import pytest
import torch

from examples.engine.detokenizer import Detokenizer
from examples.engine.rejection_sampler import RejectionSampler
from examples.engine.request import Request
from examples.engine.sampler import Sampler, SamplingError
from examples.engine.sampling_params import SamplingParams
from examples.engine.tokenizer import ByteTokenizer
from tests.support import chi_square
from tests.support.filtered_probs import filtered_probs

ALPHA = 1e-4  # per chi-square test: the samples are seeded, so a pass is a pass for good
MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=0.8),
         SamplingParams(temperature=1.2, top_k=3), SamplingParams(temperature=0.9, top_p=0.8),
         SamplingParams(temperature=1.0, top_k=10, top_p=0.6)]


def make(params: SamplingParams, generator: torch.Generator | None = None,
         name: str = "r") -> Request:
    return Request(name, [1], params, Detokenizer(ByteTokenizer()), 0.0, generator=generator)


def seeded(params: list[SamplingParams], seeds: list[int]) -> list[Request]:
    return [make(p, torch.Generator().manual_seed(s), f"r{s}") for p, s in zip(params, seeds)]


def rows_of(counts: list[int], vocab: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(sum(counts) + len(counts), vocab, generator=generator) * 3


def test_greedy_emits_the_argmax_walk():
    generator = torch.Generator().manual_seed(0)
    greedy = [SamplingParams(temperature=0), SamplingParams(temperature=0, top_k=2, top_p=0.5)]
    for trial in range(40):
        counts = torch.randint(0, 5, (6,), generator=generator).tolist()
        logits = rows_of(counts, 50, generator)
        argmax = logits.argmax(dim=-1).tolist()
        drafts, start = [], 0
        for k in counts:  # mostly the argmax, so that long prefixes are accepted too
            drafts.append([argmax[start + j] if torch.rand(1, generator=generator) < 0.8
                           else int(torch.randint(0, 50, (1,), generator=generator))
                           for j in range(k)])
            start += k + 1
        q = (torch.rand(sum(counts), 50, generator=generator).softmax(dim=-1) if trial % 2
             else None)
        requests = [make(greedy[i % 2]) for i in range(5)] + [make(MIXED[1])]
        emitted = RejectionSampler(Sampler("cpu"))(logits, requests, drafts, q)
        start = 0
        for i, (k, d) in enumerate(zip(counts, drafts)):
            walk = []
            for j in range(k + 1):
                walk.append(argmax[start + j])
                if j == k or d[j] != walk[-1]:
                    break
            if i < 5:
                assert emitted[i] == walk, (trial, i)
            start += k + 1


# (name, target params, draft model's logits scale or None for one-hot drafts, first draft)
CASES = [("draft model", SamplingParams(temperature=0.8), 1.5, None),
         ("draft model, top-k and top-p", SamplingParams(temperature=1.3, top_k=5, top_p=0.9),
          1.5, None),
         ("n-gram, likely draft", SamplingParams(temperature=0.7, top_p=0.85), None, "likely"),
         ("n-gram, no filter", SamplingParams(temperature=0.9), None, "likely"),
         ("n-gram, draft top-k removes", SamplingParams(temperature=1.0, top_k=4), None,
          "removed")]


@pytest.mark.parametrize("name,params,draft_scale,first", CASES, ids=[c[0] for c in CASES])
def test_each_emitted_token_is_distributed_as_the_target(name, params, draft_scale, first):
    """k = 2 drafts per request; the target at position j depends on the token before it (a
    rolled row), as a model's does. Token 0 must follow p_0; token j (j > 0, emitted once
    drafts 0..j-1 were accepted), given token j - 1, must follow p_j given that token."""
    vocab, n = 8, 20_000
    gen = torch.Generator().manual_seed(7)
    bases = torch.randn(3, vocab, generator=gen)  # the target's logits at positions 0, 1, 2

    def p(position: int, before: int) -> torch.Tensor:
        return filtered_probs(bases[position].roll(before), params)

    if draft_scale is None:  # n-gram: drafts fixed by the context, q one-hot
        probs0 = p(0, 0)
        d0 = int(probs0.argmax()) if first == "likely" else int(probs0.argmin())
        d0s = torch.full((n,), d0)
        d1s = torch.full((n,), int(p(1, d0).argmax()))
        q = None
    else:  # a draft model whose distribution differs from the target's
        q_bases = torch.randn(2, vocab, generator=gen) * draft_scale
        q0 = q_bases[0].softmax(dim=0)
        q1 = torch.stack([q_bases[1].roll(t).softmax(dim=0) for t in range(vocab)])
        d0s = torch.multinomial(q0, n, replacement=True, generator=gen)
        d1s = torch.multinomial(q1[d0s], 1, generator=gen).squeeze(1)
        q = torch.stack([q0.expand(n, -1), q1[d0s]], dim=1).reshape(2 * n, vocab)
        if params.top_k == 0 and params.top_p == 1:  # the test tells q from p: drafts fail it
            assert chi_square.p_value(*chi_square.statistic(
            [(torch.bincount(d0s, minlength=vocab).tolist(), p(0, 0).tolist())])) < ALPHA
    logits = torch.stack([bases[0].expand(n, -1),
                          torch.stack([bases[1].roll(int(t)) for t in range(vocab)])[d0s],
                          torch.stack([bases[2].roll(int(t)) for t in range(vocab)])[d1s]],
                         dim=1).reshape(3 * n, vocab)
    drafts = torch.stack([d0s, d1s], dim=1).tolist()
    request = make(params)  # unseeded: the sampler's shared generator
    emitted = RejectionSampler(Sampler("cpu", seed=11))(logits, [request] * n, drafts, q)
    assert all(isinstance(e, list) and 1 <= len(e) <= 3 for e in emitted)
    for position in range(3):
        groups: dict[int, list[int]] = {}
        for e in emitted:
            if len(e) > position:
                key = e[position - 1] if position else 0
                groups.setdefault(key, [0] * vocab)[e[position]] += 1
        # Groups too small for the chi-square approximation are left out (their membership
        # depends only on earlier tokens, so the others' distribution is unchanged).
        tested = [(c, p(position, key).tolist()) for key, c in groups.items() if sum(c) >= 200]
        if position == 0:
            assert sum(sum(c) for c, _ in tested) == n
        if not tested:
            assert first == "removed" and position > 0  # p(d0) = 0: every draft rejected
            continue
        stat, df = chi_square.statistic(tested)
        assert chi_square.p_value(stat, df) > ALPHA, (name, position, stat, df)


def test_no_drafts_draw_what_the_sampler_draws():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(MIXED) * 4, 40, generator=gen) * 2
    params = (MIXED + [SamplingParams(temperature=0.7, repetition_penalty=1.3)]) * 4
    logits = torch.cat([logits, torch.randn(4, 40, generator=gen)])
    for seeds in (list(range(len(params))), None):
        def reqs() -> list[Request]:
            out = seeded(params, seeds) if seeds else [make(p) for p in params]
            for r in out:
                r.output_token_ids = [2, 5]  # for the penalties
            return out
        expected = Sampler("cpu", seed=5)(logits, reqs())
        emitted = RejectionSampler(Sampler("cpu", seed=5))(logits, reqs(), [[]] * len(params))
        assert emitted == [[t] for t in expected]


def _seeded_batch(vocab: int = 30):
    """Per request: its params, seed, drafts, verify rows and draft rows (q), fixed."""
    gen = torch.Generator().manual_seed(21)
    out = []
    for i in range(8):
        k = i % 4
        rows = torch.randn(k + 1, vocab, generator=gen) * 2
        drafts = [int(rows[j].argmax()) if j % 2 else int(torch.randint(0, vocab, (1,),
                                                                       generator=gen))
                  for j in range(k)]
        out.append((MIXED[i % len(MIXED)], 1000 + i, drafts, rows,
                    torch.rand(k, vocab, generator=gen).softmax(dim=-1)))
    return out


def _run(sampler: RejectionSampler, batch, requests, with_q: bool):
    logits = torch.cat([b[3] for b in batch])
    q = torch.cat([b[4] for b in batch]) if with_q else None
    return sampler(logits, requests, [b[2] for b in batch], q)


@pytest.mark.parametrize("with_q", [True, False])
def test_seeded_requests_emit_the_same_tokens_in_any_batch(with_q):
    batch = _seeded_batch()
    alone = []
    for b in batch:  # two steps each, in a batch of one
        sampler, request = RejectionSampler(Sampler("cpu")), seeded([b[0]], [b[1]])[0]
        alone.append([_run(sampler, [b], [request], with_q)[0] for _ in range(2)])
    for order in (list(range(8)), list(range(7, -1, -1)), [3, 0, 6, 1, 5, 2, 7, 4]):
        sampler = RejectionSampler(Sampler("cpu", seed=order[0]))
        stranger = _seeded_batch()[2]  # unseeded: it takes the shared generator's numbers
        mixed = [batch[i] for i in order] + [stranger]
        requests = seeded([b[0] for b in mixed[:-1]], [b[1] for b in mixed[:-1]])
        requests.append(make(stranger[0]))
        steps = [_run(sampler, mixed, requests, with_q) for _ in range(2)]
        assert [[steps[s][j] for s in range(2)] for j in range(8)] == [alone[i] for i in order]
    other = RejectionSampler(Sampler("cpu"))
    different = [_run(other, [b], seeded([b[0]], [b[1] + 1]), with_q)[0] for b in batch]
    assert different != [a[0] for a in alone]  # the seed matters


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_row_that_cannot_be_sampled_fails_only_its_request(bad):
    gen = torch.Generator().manual_seed(4)
    counts = [2, 3, 1, 2]
    logits = rows_of(counts, 20, gen)
    q = torch.rand(sum(counts), 20, generator=gen)
    drafts = [torch.randint(0, 20, (k,), generator=gen).tolist() for k in counts]
    params = [MIXED[1], MIXED[3], MIXED[0], MIXED[2]]
    broken = logits.clone()
    if bad == -math.inf:
        broken[3 + 2] = bad  # request 1's third verify row, -inf everywhere
    else:
        broken[3 + 2, 7] = bad
    emitted = RejectionSampler(Sampler("cpu", seed=9))(broken, [make(p) for p in params],
                                                      drafts, q)
    assert isinstance(emitted[1], SamplingError) and "not finite" in str(emitted[1])
    keep = torch.tensor([r for r in range(len(logits)) if not 3 <= r < 7])
    keep_q = torch.tensor([r for r in range(sum(counts)) if not 2 <= r < 5])
    without = RejectionSampler(Sampler("cpu", seed=9))(
        logits[keep], [make(params[i]) for i in (0, 2, 3)], [drafts[i] for i in (0, 2, 3)],
        q[keep_q])
    assert [emitted[i] for i in (0, 2, 3)] == without


def test_drafts_for_a_penalised_request_are_its_error_alone():
    gen = torch.Generator().manual_seed(5)
    logits = rows_of([2, 1], 20, gen)
    requests = [make(SamplingParams(presence_penalty=0.5)), make(MIXED[1])]
    sampler = RejectionSampler(Sampler("cpu"))
    with pytest.raises(ValueError, match="penalties"):
        sampler(logits, requests, [[1, 2], [3]])
    emitted = sampler.emitted_or_errors(logits, requests, [[1, 2], [3]])
    assert isinstance(emitted[0], ValueError) and isinstance(emitted[1], list)


def test_inputs_that_disagree_are_refused():
    sampler = RejectionSampler(Sampler("cpu"))
    requests = [make(MIXED[1])] * 2
    with pytest.raises(ValueError, match="rows"):
        sampler(torch.zeros(4, 10), requests, [[1], [2, 3]])
    with pytest.raises(ValueError, match="draft_probs"):
        sampler(torch.zeros(5, 10), requests, [[1], [2, 3]], torch.zeros(2, 10))
    with pytest.raises(ValueError, match="vocabulary"):
        sampler(torch.zeros(5, 10), requests, [[1], [2, 10]])


def test_the_chi_square_tail_matches_closed_forms():
    for x in (0.1, 1.0, 5.0, 15.137, 40.0):
        assert math.isclose(chi_square.p_value(x, 2), math.exp(-x / 2), rel_tol=1e-10)
        assert math.isclose(chi_square.p_value(x, 1), math.erfc(math.sqrt(x / 2)),
                            rel_tol=1e-10)
