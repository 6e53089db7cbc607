"""Stop strings, matched on the detokenized text, and the per-request output text.

The scheduler's interface is `OutputText`, one per request:

    output = OutputText(decoder, prompt_ids, stop_strings, skip_special_tokens=True)
    delta, stopped = output.push(token_id)   # every sampled token, in order
    delta, _ = output.push(token_id, can_stop=False)   # before `min_tokens`: no stop yet
    ...                                      # stopped -> finish reason "stop_sequence"
    tail = output.finish()                   # once, when generation ends for any other reason
    output.text, output.matched_stop         # all released text; the stop string that fired

`delta` is the text that became final with this token: stream it as is. Text that could be the
start of a stop string is held back (at most `max(len(stop)) - 1` characters) and comes out in a
later delta, or from `finish()`. EOS and other stop tokens may be pushed or not: with
`skip_special_tokens` they add no text. `push()` after a stop or after `finish()` is an error;
`finish()` after a stop returns "".

Stop semantics: generation stops at the first character position where any stop string is
complete (so the result does not depend on how the text was split into tokens); of the stop strings
ending there, the longest wins. The released text ends just *before* the stop string, as in OpenAI's
API and vLLM; `include_stop_string=True` keeps it, as TGI's `generated_text` does. Nothing after
the stop string is ever released, even when it arrived in the same token. Text pushed with
`can_stop=False` (before the request's `min_tokens`) is never matched, as in vLLM: a stop string
complete in it does not stop, one that it only starts can still complete afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

from tgq.batcher.detokenize import IncrementalDetokenizer, TokenDecoder


class StopStringMatcher:
    """Streams text through, holding back what could still become a stop string."""

    def __init__(self, stop_strings: Sequence[str], *, include_stop_string: bool = False) -> None:
        if any(not stop for stop in stop_strings):
            raise ValueError("stop strings must not be empty")
        self._stop_strings = tuple(dict.fromkeys(stop_strings))
        self._include_stop_string = include_stop_string
        self._max_held = max((len(stop) for stop in self._stop_strings), default=1) - 1
        self._proper_prefixes = frozenset(
            stop[:end] for stop in self._stop_strings for end in range(1, len(stop))
        )
        self._held = ""
        self.matched_stop: str | None = None

    def feed(self, text: str, *, can_stop: bool = True) -> tuple[str, str | None]:
        """Returns (text now safe to release, the stop string that matched or None)."""
        if self.matched_stop is not None:
            raise RuntimeError("feed() after a stop string matched")
        # `_held` is shorter than every stop string it could start, so a match ends in `text`.
        buffer = self._held + text
        match = self._first_match(buffer) if can_stop else None
        if match is not None:
            start, stop = match
            self._held = ""
            self.matched_stop = stop
            end = start + len(stop) if self._include_stop_string else start
            return buffer[:end], stop
        num_held = self._num_held(buffer)
        self._held = buffer[len(buffer) - num_held :]
        return buffer[: len(buffer) - num_held], None

    def finish(self) -> str:
        """Releases the held text: generation ended without completing a stop string."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """The stop string that completes first in `buffer` (the longest on a tie), with its
        start."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stop_strings:
            start = buffer.find(stop)
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                best = candidate if best is None else min(best, candidate)
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _num_held(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that some stop string starts with."""
        for start in range(max(len(buffer) - self._max_held, 0), len(buffer)):
            if buffer[start:] in self._proper_prefixes:
                return len(buffer) - start
        return 0


class OutputText:
    """A request's generated text: incremental detokenization, then stop-string matching."""

    def __init__(
        self,
        decoder: TokenDecoder,
        prompt_ids: Sequence[int],
        stop_strings: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop_string: bool = False,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            decoder, prompt_ids, skip_special_tokens=skip_special_tokens
        )
        self._matcher = StopStringMatcher(stop_strings, include_stop_string=include_stop_string)
        self._chunks: list[str] = []
        self._is_done = False

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    @property
    def matched_stop(self) -> str | None:
        return self._matcher.matched_stop

    def push(self, token_id: int, *, can_stop: bool = True) -> tuple[str, bool]:
        """Returns (newly released text, whether a stop string matched)."""
        if self._is_done:
            raise RuntimeError("push() after the output text was finished or stopped")
        text = self._detokenizer.push(token_id)
        delta, stop = self._matcher.feed(text, can_stop=can_stop)
        self._is_done = stop is not None
        self._chunks.append(delta)
        return delta, self._is_done

    def finish(self) -> str:
        """Releases everything still held; the flushed tail can itself complete a stop string."""
        if self._is_done:
            return ""
        self._is_done = True
        delta, stop = self._matcher.feed(self._detokenizer.flush())
        if stop is None:
            delta += self._matcher.finish()
        self._chunks.append(delta)
        return delta
