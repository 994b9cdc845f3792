"""The incremental detokenizer against whole-sequence decoding, on real tokenizers.

Tokenizers are trained here with the `tokenizers` library: a byte-level BPE (GPT-2, Llama-3)
and two SentencePiece-style BPEs with byte fallback (Metaspace decoder; Llama-2's Replace,
ByteFallback, Fuse, Strip decoder). Test texts mix in characters the training corpus lacks, so
that they are spelt in byte tokens (<0xE2>...).

The reference, as vLLM defines it: the output's text in context is
`decode(prompt + output)[len(decode(prompt)):]`, for a prompt whose text is complete (does not
end in half a character). Streamed pieces must add up to it exactly.
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from examples.engine.detokenizer import (
    CONTEXT_TOKENS,
    MAX_CHARACTER_TOKENS,
    REPLACEMENT_CHAR,
    Detokenizer,
)
from examples.engine.tokenizer import ByteTokenizer, HFTokenizer

WORDS = ["the", "capital", "of", "France", "is", "Paris", "café", "naïve", "über", "東京",
         "こんにちは", "😀", "€", "hello", "world", ",", ".", "Ærø", "ñandú"]
# Not in the training corpus: these are spelt in byte tokens (or single bytes, byte-level).
UNSEEN = ["🚀", "🎉", "中文", "ß", "Ω", "👩‍💻", "ǅ", "é"]


def corpus(rng: random.Random, lines: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(lines)]


def random_text(rng: random.Random) -> str:
    """Words, unseen characters and odd spacing, as a model might write them."""
    pieces = [rng.choice(WORDS + UNSEEN) for _ in range(rng.randint(1, 12))]
    return "".join(p + rng.choice([" ", " ", "", "  ", "\n"]) for p in pieces)


def byte_level() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(random.Random(0), 300), trainer)
    return tokenizer


def sentencepiece(decoder: decoders.Decoder) -> Tokenizer:
    """A BPE on Metaspace pieces whose vocabulary ends with the 256 byte tokens, as Llama-2's."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    # A small alphabet leaves the corpus' rarer characters to byte fallback too.
    trainer = trainers.BpeTrainer(vocab_size=150, limit_alphabet=40, show_progress=False)
    tokenizer.train_from_iterator(corpus(random.Random(0), 300), trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoder
    return tokenizer


TOKENIZERS = {
    "byte-level": byte_level,
    "metaspace": lambda: sentencepiece(decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")])),
    "llama-2": lambda: sentencepiece(decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)])),
}


class CountingTokenizer(HFTokenizer):
    """The engine's tokenizer wrapper, noting how many tokens each decode is given."""

    def __init__(self, tokenizer: Tokenizer):
        super().__init__(tokenizer, {}, set())
        self.decoded: list[int] = []

    def decode(self, token_ids):
        self.decoded.append(len(token_ids))
        return super().decode(token_ids)


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request) -> CountingTokenizer:
    return CountingTokenizer(TOKENIZERS[request.param]())


def stream(detokenizer: Detokenizer, output: list[int]) -> list[str]:
    """The pieces the engine would send: one per token, the last one with the request done."""
    pieces = []
    for i, token in enumerate(output):
        stopped = detokenizer.add(token)
        pieces.append(detokenizer.take(stopped or i == len(output) - 1))
        if stopped:
            break
    return pieces


def in_context(tokenizer: HFTokenizer, prompt: list[int], output: list[int]) -> str:
    return tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]


def cases(tokenizer: HFTokenizer, seed: int, count: int):
    """Prompts and outputs split from one encoded text (as a model continues its prompt), and
    outputs encoded on their own after a prompt (as a model starts a new word)."""
    rng = random.Random(seed)
    for _ in range(count):
        prompt = tokenizer.encode(random_text(rng))
        if rng.random() < 0.5:
            whole = tokenizer.encode(random_text(rng) + random_text(rng))
            cut = rng.randint(1, max(len(whole) - 1, 1))
            prompt, output = whole[:cut], whole[cut:]
        else:
            output = tokenizer.encode(random_text(rng))
        if output and not tokenizer.decode(prompt).endswith(REPLACEMENT_CHAR):
            yield prompt, output


def test_pieces_add_up_to_the_output_decoded_in_context(tokenizer):
    checked = 0
    for prompt, output in cases(tokenizer, seed=1, count=300):
        pieces = stream(Detokenizer(tokenizer, prompt_token_ids=prompt), output)
        assert "".join(pieces) == in_context(tokenizer, prompt, output), (prompt, output)
        assert all(REPLACEMENT_CHAR not in p for p in pieces)  # half a character is never sent
        checked += 1
    assert checked > 200


def test_random_byte_level_tokens_add_up_even_when_they_are_not_utf8():
    # Byte-level decoding is local: an invalid byte stays one U+FFFD whatever follows it.
    tokenizer = CountingTokenizer(byte_level())
    rng = random.Random(2)
    vocab = tokenizer.tokenizer.get_vocab_size()
    for _ in range(300):
        prompt = tokenizer.encode(random_text(rng))
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        pieces = stream(Detokenizer(tokenizer, prompt_token_ids=prompt), output)
        assert "".join(pieces) == in_context(tokenizer, prompt, output), (prompt, output)


@pytest.mark.parametrize("name", ["metaspace", "llama-2"])
def test_random_sentencepiece_pieces_and_whole_characters_add_up(name):
    # A byte fallback decoder writes one U+FFFD per token for a run of byte tokens that is not
    # UTF-8 as a whole, so a run's text depends on all of it: runs here spell whole characters.
    tokenizer = CountingTokenizer(TOKENIZERS[name]())
    byte_ids = {tokenizer.tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    pieces = [i for i in range(tokenizer.tokenizer.get_vocab_size()) if i not in byte_ids]
    rng = random.Random(4)
    for _ in range(300):
        prompt = tokenizer.encode(random_text(rng))
        output = []
        for _ in range(rng.randint(1, 20)):
            output += [rng.choice(pieces)] if rng.random() < 0.7 else tokenizer.encode(
                rng.choice(UNSEEN))
        streamed = stream(Detokenizer(tokenizer, prompt_token_ids=prompt), output)
        assert "".join(streamed) == in_context(tokenizer, prompt, output), (prompt, output)


def test_the_first_output_token_keeps_its_leading_space(tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    output = tokenizer.encode("The capital of France is Paris")[len(prompt):]
    assert "".join(stream(Detokenizer(tokenizer, prompt_token_ids=prompt), output)) == " Paris"


def test_each_token_decodes_a_bounded_window(tokenizer):
    rng = random.Random(3)
    prompt = tokenizer.encode(random_text(rng))
    output = tokenizer.encode(" ".join(random_text(rng) for _ in range(60)))
    detokenizer = Detokenizer(tokenizer, prompt_token_ids=prompt)
    tokenizer.decoded.clear()
    stream(detokenizer, output)
    assert len(output) > 400
    assert len(tokenizer.decoded) == 2 * len(output)  # the window, and its final part
    # The context (CONTEXT_TOKENS, up to the end of a character) and a character being completed.
    assert max(tokenizer.decoded) <= CONTEXT_TOKENS + 2 * MAX_CHARACTER_TOKENS


def test_text_stops_before_a_stop_string_that_spans_tokens(tokenizer):
    prompt = tokenizer.encode("hello")
    output = tokenizer.encode("hello world café 東京 über alles, hello world")[len(prompt):]
    detokenizer = Detokenizer(tokenizer, stop=("東京 ü",), prompt_token_ids=prompt)
    pieces = stream(detokenizer, output)
    assert "".join(pieces) == detokenizer.text == " world café "
    assert len(pieces) < len(output)  # the request stopped at the token that completed it


def test_half_a_character_is_held_until_it_is_whole():
    detokenizer = Detokenizer(ByteTokenizer())
    assert stream(detokenizer, list("a😀".encode())) == ["a", "", "", "", "😀"]


def test_half_a_character_is_sent_as_it_is_when_the_request_ends():
    detokenizer = Detokenizer(ByteTokenizer())
    assert stream(detokenizer, list("a😀".encode())[:3]) == ["a", "", REPLACEMENT_CHAR]
    assert detokenizer.text == "a" + REPLACEMENT_CHAR


def test_text_cut_at_a_stop_string_is_the_whole_decode_cut_there(tokenizer):
    # Stop strings taken from the reference text itself, so they straddle tokens and split
    # characters' byte tokens wherever the text does.
    rng = random.Random(5)
    checked = 0
    for prompt, output in cases(tokenizer, seed=6, count=300):
        whole = in_context(tokenizer, prompt, output)
        if REPLACEMENT_CHAR in whole or len(whole) < 2:
            continue
        start = rng.randrange(len(whole) - 1)
        stop = whole[start:start + rng.randint(1, 4)]
        detokenizer = Detokenizer(tokenizer, stop=(stop,), prompt_token_ids=prompt)
        pieces = stream(detokenizer, output)
        assert "".join(pieces) == detokenizer.text == whole[:whole.find(stop)], (prompt, stop)
        checked += 1
    assert checked > 150
