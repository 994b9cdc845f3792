"""N-gram speculative decoding on two tensor-parallel ranks (this process is rank 0): verify
steps (chunks asking for logits at every draft) are broadcast and run on both ranks.

Reference: the greedy tokens of a TP=1 engine without speculation (fp32; TP=2 gives the same).
"""

from __future__ import annotations

import json

from examples.engine import build_engine
from examples.generate import MODELS, parse_args
from tests.support.speculation import GREEDY, PROMPTS, tokens
from tests.support.tp_engines import FLAGS, threads_kept, tp_engine

K = 3
NGRAM_FLAG = ["--speculative-config", json.dumps(
    {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
     "prompt_lookup_max": 3})]


def test_ngram_speculation_on_two_ranks_gives_the_tokens_of_one_rank_without_it():
    with threads_kept():
        plain, _ = build_engine(parse_args(FLAGS), MODELS)
    try:
        expected = tokens(plain.generate(PROMPTS, GREEDY))
    finally:
        plain.close()
    with tp_engine(*NGRAM_FLAG) as engine:
        assert tokens(engine.generate(PROMPTS, GREEDY)) == expected
        stats = engine.stats()
    assert 0 < stats["spec_decode_accepted_tokens"] < stats["spec_decode_draft_tokens"]
    # Several tokens a step came out, and every step replayed captured piecewise graphs.
    assert stats["steps"] < sum(map(len, expected))
    hits = stats["runner"]["hits"]
    assert hits and all(key.startswith("piecewise:") for key in hits), hits
