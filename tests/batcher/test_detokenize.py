"""Incremental detokenization against full decodes, byte-level BPE and SentencePiece alike."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.batcher.tokenizer_zoo import load
from tgq.batcher.detokenize import HFTokenDecoder, IncrementalDetokenizer

BYTE_LEVEL = ["bpe", "llama3"]
SENTENCEPIECE = ["sentencepiece", "mistral"]
ALL = BYTE_LEVEL + SENTENCEPIECE
# ASCII, accented, CJK, emoji (4 bytes, byte fallback in SentencePiece), spaces and newlines.
ALPHABET = [*"ab xyz.,\n", "  ", "é", "ö", "ß", "你", "好", "界", "🤗", "🎉", "👍🏽", "ñ"]
texts = st.lists(st.sampled_from(ALPHABET), max_size=24).map("".join)


def stream(tokenizer: Tokenizer, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(HFTokenDecoder(tokenizer), prompt_ids)
    return [detokenizer.push(token_id) for token_id in token_ids] + [detokenizer.flush()]


def continuation(tokenizer: Tokenizer, prompt_ids: list[int], token_ids: list[int]) -> str:
    """What the generated tokens add to the prompt's text."""
    prompt_text = tokenizer.decode(prompt_ids)
    full_text = tokenizer.decode(prompt_ids + token_ids)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text) :]


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=60, deadline=None)
@given(prompt=texts, generated=texts)
def test_stream_concatenates_to_the_decoded_continuation(
    name: str, prompt: str, generated: str
) -> None:
    tokenizer = load(name)
    prompt_ids, token_ids = encode(tokenizer, prompt), encode(tokenizer, generated)
    chunks = stream(tokenizer, prompt_ids, token_ids)
    expected = continuation(tokenizer, prompt_ids, token_ids)
    assert "".join(chunks) == expected
    assert not any("\ufffd" in chunk for chunk in chunks)
    if name in BYTE_LEVEL or not prompt_ids:
        assert "".join(chunks) == tokenizer.decode(token_ids)


@pytest.mark.parametrize("name", BYTE_LEVEL)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_byte_level_tokens_match_the_full_decode(name: str, data: st.DataObject) -> None:
    """Arbitrary ids, so arbitrary (also invalid) bytes: U+FFFD only where decode has it."""
    tokenizer = load(name)
    special_ids = set(tokenizer.get_added_tokens_decoder())
    vocab_ids = st.integers(0, tokenizer.get_vocab_size() - 1).filter(
        lambda i: i not in special_ids
    )
    prompt_ids = encode(tokenizer, data.draw(texts))
    token_ids = data.draw(st.lists(vocab_ids, max_size=20))
    assert "".join(stream(tokenizer, prompt_ids, token_ids)) == tokenizer.decode(token_ids)


@pytest.mark.parametrize("name", ALL)
def test_first_generated_token_keeps_its_leading_space(name: str) -> None:
    tokenizer = load(name)
    prompt_ids = encode(tokenizer, "Hello")
    # SentencePiece encodes a new text with a leading "▁", as the model would generate it.
    token_ids = encode(tokenizer, "world" if name in SENTENCEPIECE else " world")
    assert "".join(stream(tokenizer, prompt_ids, token_ids)) == " world"
    if name in SENTENCEPIECE:
        assert not tokenizer.decode(token_ids[:1]).startswith(" ")  # decoding the token alone


@pytest.mark.parametrize("name", ALL)
def test_spaces_between_generated_words_survive(name: str) -> None:
    tokenizer = load(name)
    token_ids = encode(tokenizer, "one two  three" if name in SENTENCEPIECE else " one two  three")
    chunks = stream(tokenizer, encode(tokenizer, "count:"), token_ids)
    assert "".join(chunks) == " one two  three"


@pytest.mark.parametrize("name", ALL)
def test_a_multibyte_character_is_emitted_whole(name: str) -> None:
    tokenizer = load(name)
    token_ids = encode(tokenizer, "x🤗")
    assert len(token_ids) >= 3  # the emoji spans several tokens in every tokenizer here
    chunks = stream(tokenizer, encode(tokenizer, "emoji:"), token_ids)
    assert [chunk for chunk in chunks if chunk] in ([" x", "🤗"], ["x", "🤗"], [" x🤗"], ["x🤗"])


@pytest.mark.parametrize("name", ALL)
def test_incomplete_character_is_held_until_flush(name: str) -> None:
    tokenizer = load(name)
    prompt_ids, token_ids = encode(tokenizer, "b"), encode(tokenizer, "a🤗")[:-1]
    detokenizer = IncrementalDetokenizer(HFTokenDecoder(tokenizer), prompt_ids)
    pushed = "".join(detokenizer.push(token_id) for token_id in token_ids)
    assert pushed.strip() == "a"
    flushed = detokenizer.flush()
    assert "\ufffd" in flushed
    assert pushed + flushed == continuation(tokenizer, prompt_ids, token_ids)


def test_prompt_context_that_starts_inside_a_character() -> None:
    """Byte-fallback prompt "好好好" is 9 byte tokens; 5 back from its end is mid-character."""
    tokenizer = load("sentencepiece")
    prompt_ids = encode(tokenizer, "好好好")
    assert len(prompt_ids) == 10  # "▁" + 3 x 3 bytes
    assert "".join(stream(tokenizer, prompt_ids, encode(tokenizer, "好")[1:])) == "好"


@pytest.mark.parametrize("name", ["sentencepiece", "mistral", "llama3"])
def test_skipped_special_tokens_leave_text_and_spaces_alone(name: str) -> None:
    tokenizer = load(name)
    special_id = max(tokenizer.get_added_tokens_decoder())
    first, second = encode(tokenizer, " well"), encode(tokenizer, " done")
    if name in SENTENCEPIECE:
        first, second = encode(tokenizer, "well"), encode(tokenizer, "done")
    chunks = stream(tokenizer, encode(tokenizer, "Hi"), [*first, special_id, *second])
    assert "".join(chunks) == " well done"


def test_special_tokens_are_text_when_not_skipped() -> None:
    tokenizer = load("mistral")
    token_ids = [*encode(tokenizer, "yes"), 2]
    detokenizer = IncrementalDetokenizer(
        HFTokenDecoder(tokenizer), encode(tokenizer, "ok?"), skip_special_tokens=False
    )
    text = "".join(detokenizer.push(token_id) for token_id in token_ids) + detokenizer.flush()
    assert text == " yes</s>"


class RecordingDecoder(HFTokenDecoder):
    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.longest_window = 0

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        self.longest_window = max(self.longest_window, len(token_ids))
        return super().decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_per_token_work_does_not_grow_with_the_output() -> None:
    tokenizer = load("mistral")
    prompt_ids = encode(tokenizer, "A long prompt " * 50)
    decoder = RecordingDecoder(tokenizer)
    detokenizer = IncrementalDetokenizer(decoder, prompt_ids)
    token_ids = encode(tokenizer, "Grüße, 世界 🤗! " * 200)
    pieces = []
    for index, token_id in enumerate(token_ids):
        pieces.append(detokenizer.push(token_id))
        if index % 7 == 0:
            pieces.append(detokenizer.push(2))  # skipped specials never widen the window
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == " " + tokenizer.decode(token_ids)
    assert decoder.longest_window <= 16
