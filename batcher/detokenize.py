"""Incremental detokenization: turn sampled token ids into text one token at a time.

A token does not map to a fixed piece of text. Byte-level BPE (GPT-2, Llama-3) tokens can hold half
of a UTF-8 character; SentencePiece byte-fallback tokens (`<0xE2>`, Llama-2, Mistral) hold one byte
each; and SentencePiece's decoder strips the leading space of whatever comes first, so decoding a
generated token on its own loses the space that separates it from the prompt.

The technique (vLLM's and TGI's `prefix_offset` / `read_offset`): decode a short window that starts
a few tokens *before* the new ones, and emit only what the window gained over its already-emitted
part. The tokens before `read_offset` give the new ones their context (the space, the rest of the
bytes); while the window's text ends in U+FFFD the last character is still incomplete, and nothing
is emitted until a later token completes it (or `flush()` gives up at the end of generation).

One known difference from a full decode, on invalid bytes only: SentencePiece's ByteFallback decoder
turns a whole run of byte tokens into one U+FFFD per token when the run is not valid UTF-8, so a
stray byte can retroactively spoil a newline or a character already streamed. The stream keeps what
it emitted; its U+FFFD count then differs from `decode`'s. Valid text is always exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first generated one (vLLM uses the same 5).
NUM_CONTEXT_TOKENS = 5
# How far further back to look for a context window that does not start inside a character.
MAX_CONTEXT_SEARCH = 8


class TokenDecoder(Protocol):
    """What detokenization needs from a tokenizer."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str: ...

    def is_special(self, token_id: int) -> bool: ...


class HFTokenDecoder:
    """`TokenDecoder` over a Hugging Face `tokenizers.Tokenizer` (a `tokenizer.json`)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)

    @classmethod
    def from_file(cls, path: str) -> HFTokenDecoder:
        return cls(Tokenizer.from_file(path))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids


class IncrementalDetokenizer:
    """Text of a generation, one token at a time; the pieces concatenate to the decoded output.

    `push(token_id)` returns the text that token made final (often "", e.g. mid-character);
    `flush()` returns whatever is still held when generation ends (an incomplete character decodes
    to U+FFFD there, as it does in a full decode). The concatenation equals
    `decode(prompt_ids + generated)` minus `decode(prompt_ids)`: for byte-level BPE that is
    `decode(generated)`; for SentencePiece it keeps the leading space of the first generated token.
    """

    def __init__(
        self,
        decoder: TokenDecoder,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decoder = decoder
        self._skip_special_tokens = skip_special_tokens
        # Invariant: the text of token_ids[prefix_offset:read_offset] has been emitted (or belongs
        # to the prompt) and ends on a complete character; tokens from read_offset on are pending.
        start = context_start(decoder, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._token_ids = list(prompt_ids[start:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def push(self, token_id: int) -> str:
        # A skipped special token decodes to nothing anywhere, so it never enters the window; that
        # keeps the window short and the context in front of the next real token intact.
        if self._skip_special_tokens and self._decoder.is_special(token_id):
            return ""
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._token_ids))
        self._advance()
        return new_text[len(prefix_text) :]

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        # Tokens before prefix_offset are never decoded again.
        del self._token_ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0

    def _decode(self, start: int, stop: int) -> str:
        return self._decoder.decode(
            self._token_ids[start:stop], skip_special_tokens=self._skip_special_tokens
        )


def context_start(
    decoder: TokenDecoder, prompt_ids: Sequence[int], *, skip_special_tokens: bool
) -> int:
    """Where the prompt context window starts: `NUM_CONTEXT_TOKENS` back, moved further back while
    the window would start inside a multibyte character (its bytes would decode to U+FFFD and,
    with SentencePiece byte fallback, turn the generated bytes next to them into U+FFFD too)."""
    start = max(len(prompt_ids) - NUM_CONTEXT_TOKENS, 0)
    for candidate in range(start, max(start - MAX_CONTEXT_SEARCH, 0) - 1, -1):
        text = decoder.decode(prompt_ids[candidate:], skip_special_tokens=skip_special_tokens)
        if not text.startswith(REPLACEMENT_CHAR):
            return candidate
    return start
