"""Stop strings on streamed text: the matcher alone, then `OutputText` over real tokenizers."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.batcher.test_detokenize import ALL, SENTENCEPIECE, continuation, encode
from tests.batcher.tokenizer_zoo import load
from tgq.batcher.detokenize import HFTokenDecoder
from tgq.batcher.stopping import OutputText, StopStringMatcher


def reference(text: str, stop_strings: Sequence[str]) -> tuple[str, str | None]:
    """Character by character: stop where a stop string first ends, the longest one ending there."""
    for end in range(1, len(text) + 1):
        ending = [stop for stop in stop_strings if text[:end].endswith(stop)]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


def run_matcher(chunks: Sequence[str], stop_strings: Sequence[str]) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stop_strings)
    released: list[str] = []
    for chunk in chunks:
        text, stop = matcher.feed(chunk)
        released.append(text)
        if stop is not None:
            return "".join(released), stop
    return "".join(released) + matcher.finish(), None


def test_stop_string_split_across_chunks() -> None:
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("Hello\n") == ("Hello", None)
    assert matcher.feed("\nworld") == ("", "\n\n")
    assert matcher.matched_stop == "\n\n"


def test_held_text_is_released_once_it_cannot_be_a_stop_string() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("the EN") == ("the ", None)
    assert matcher.feed("O") == ("ENO", None)
    assert matcher.feed("xE") == ("x", None)
    assert matcher.finish() == "E"


def test_overlapping_prefixes() -> None:
    matcher = StopStringMatcher(["ab", "b c"])
    assert matcher.feed("xb") == ("x", None)
    assert matcher.feed(" ") == ("", None)
    assert matcher.feed("c!") == ("", "b c")
    assert run_matcher(["a", "b c"], ["ab", "b c"]) == ("", "ab")
    assert run_matcher(["xab c"], ["b c", "ab"]) == ("x", "ab")


def test_the_stop_string_that_completes_first_wins_whatever_the_chunking() -> None:
    assert run_matcher(["abcd"], ["abcd", "bc"]) == ("a", "bc")
    assert run_matcher(list("abcd"), ["abcd", "bc"]) == ("a", "bc")
    assert run_matcher(["ab"], ["ab", "abc"]) == ("", "ab")
    assert run_matcher(["xab c"], ["b c", "c"]) == ("xa", "b c")  # same end: the longer one


def test_stop_in_the_first_chunk_and_nothing_after_it() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("STOP and more") == ("", "STOP")
    with pytest.raises(RuntimeError):
        matcher.feed("x")


def test_stop_string_inside_a_longer_word() -> None:
    assert run_matcher(["There", " is"], ["the", "The"]) == ("", "The")
    assert run_matcher(["a the", "ory"], ["theory"]) == ("a ", "theory")


def test_include_stop_string_keeps_it_as_tgi_does() -> None:
    matcher = StopStringMatcher(["</answer>"], include_stop_string=True)
    assert matcher.feed("42</ans") == ("42", None)
    assert matcher.feed("wer> tail") == ("</answer>", "</answer>")


def test_no_stop_strings_pass_everything_through() -> None:
    assert StopStringMatcher([]).feed("anything") == ("anything", None)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        StopStringMatcher(["ok", ""])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=30),
    stop_strings=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_matches_the_character_by_character_reference(
    text: str, stop_strings: list[str], cuts: list[int]
) -> None:
    bounds = [0, *sorted(cuts), len(text)]
    chunks = [text[start:end] for start, end in itertools.pairwise(bounds)]
    assert run_matcher(chunks, stop_strings) == reference(text, stop_strings)
    max_held = max((len(stop) for stop in stop_strings), default=1) - 1
    matcher, fed, released = StopStringMatcher(stop_strings), "", ""
    for chunk in chunks:
        out, stop = matcher.feed(chunk)
        if stop is not None:
            break
        fed, released = fed + chunk, released + out
        assert fed.startswith(released)
        assert len(fed) - len(released) <= max_held


def generate(
    name: str, prompt: str, generated: str, stop_strings: Sequence[str]
) -> tuple[OutputText, list[str], int, str]:
    """Streams `generated` as tokens; returns the output, its deltas, the number of tokens pushed
    and the continuation text the tokens decode to."""
    tokenizer = load(name)
    prompt_ids, token_ids = encode(tokenizer, prompt), encode(tokenizer, generated)
    output = OutputText(HFTokenDecoder(tokenizer), prompt_ids, stop_strings)
    deltas: list[str] = []
    for num_pushed, token_id in enumerate(token_ids, start=1):
        delta, stopped = output.push(token_id)
        deltas.append(delta)
        if stopped:
            return output, deltas, num_pushed, continuation(tokenizer, prompt_ids, token_ids)
    deltas.append(output.finish())
    return output, deltas, len(token_ids), continuation(tokenizer, prompt_ids, token_ids)


def word(name: str, text: str) -> str:
    """`text` as generated after a prompt: SentencePiece encodes it with its own leading space."""
    return text.removeprefix(" ") if name in SENTENCEPIECE else text


@pytest.mark.parametrize("name", ALL)
def test_stop_string_spanning_tokens(name: str) -> None:
    output, deltas, _, _ = generate(name, "Q:", word(name, " 42.\nUser: next"), ["\nUser:"])
    assert output.text == "".join(deltas) == " 42."
    assert output.matched_stop == "\nUser:"


@pytest.mark.parametrize("name", ALL)
def test_stop_string_ending_inside_a_token(name: str) -> None:
    """TGI misses these (its regex runs on whole-token text, issue #1039)."""
    output, _, _, _ = generate(name, "The", word(name, " answer is"), ["nsw"])
    assert output.text == " a"


@pytest.mark.parametrize("name", ALL)
def test_held_back_text_is_released(name: str) -> None:
    output, deltas, _, _ = generate(name, "A", word(name, " one\n\ntwo\n"), ["\n\nQ:", "\n\n\n"])
    assert output.matched_stop is None
    assert output.text == "".join(deltas) == " one\n\ntwo\n"
    assert deltas[-1].endswith("\n")  # the last newline came out only at finish()


@pytest.mark.parametrize("name", ALL)
def test_multibyte_characters_survive_streaming(name: str) -> None:
    output, deltas, _, _ = generate(name, "说", word(name, " 你好世界🤗 ok 🎉 done"), ["🎉"])
    assert output.text == " 你好世界🤗 ok "
    assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("name", ALL)
def test_stop_at_the_very_first_token(name: str) -> None:
    # Every tokenizer here starts " Hello" with a token that begins with the space.
    output, deltas, num_pushed, _ = generate(name, "x", word(name, " Hello world"), [" ", "H"])
    assert (output.text, deltas, num_pushed) == ("", [""], 1)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_output_text_matches_the_reference_on_the_decoded_text(
    name: str, data: st.DataObject
) -> None:
    alphabet = [*"ab \n.", "é", "你", "🤗"]
    generated = data.draw(st.lists(st.sampled_from(alphabet), max_size=20).map("".join))
    stops = st.text(alphabet="".join(alphabet), min_size=1, max_size=3)
    stop_strings = data.draw(st.lists(stops, max_size=3))
    output, deltas, _, decoded = generate(name, "go", generated, stop_strings)
    assert (output.text, output.matched_stop) == reference(decoded, stop_strings)
    assert output.text == "".join(deltas)
    assert output.finish() == ""
