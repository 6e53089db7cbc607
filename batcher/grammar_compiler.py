"""Compiled grammars for the engine: one llguidance tokenizer per model, a bounded LRU cache of
compiled grammars keyed by spec, and compiles on a thread of their own so a step never waits for
one (the engine parks a request until its grammar is ready, see `LLMEngine`).

A cached entry is a matcher that has consumed nothing; each request gets a `Constraint` over a
copy of it, which masks that request's next token and advances with each token it accepts.
llguidance drops the GIL while it builds a grammar and while it computes a mask, so a compile
runs beside the step loop rather than inside it.
"""

from __future__ import annotations

import bisect
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import numpy

from tgq.batcher.grammar import GrammarError, GrammarSpec, check, tidy

DEFAULT_MAX_CACHE = 1024  # compiled grammars kept (`--max-grammar-cache`)
# Upper bounds (seconds) of the compile-time histogram the heartbeat carries; one more for +Inf.
COMPILE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Constraint:
    """One request's grammar state: the mask of its next token, advanced token by token."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    @property
    def error(self) -> str | None:
        """Why the grammar state broke (a token it did not allow, a parser limit), or None."""
        if not self._matcher.is_error():
            return None
        return f"grammar state: {self._matcher.get_error().splitlines()[0]}"  # the rest: a dump

    def consume(self, token_id: int) -> None:
        """Advance past an accepted token. A token the mask did not allow leaves the matcher in
        its error state, which `error` reports."""
        self._matcher.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """The grammar allows nothing more (EOS at most): the output is whole."""
        return self._matcher.is_stopped() and not self._matcher.is_error()


@dataclass
class GrammarStats:
    """Since the start: compiles (a histogram by `COMPILE_BUCKETS_S`), cache hits, failures, and
    the masks the engine computed for constrained rows and the time they took."""

    num_compiles: int = 0
    num_failures: int = 0
    num_cache_hits: int = 0
    compile_seconds: list[float] = field(default_factory=list)  # the most recent, bounded
    compile_buckets: list[int] = field(default_factory=lambda: [0] * (len(COMPILE_BUCKETS_S) + 1))
    compile_seconds_sum: float = 0.0
    num_masks: int = 0
    mask_seconds: float = 0.0

    def record(self, seconds: float) -> None:
        self.num_compiles += 1
        self.compile_seconds.append(seconds)
        del self.compile_seconds[:-1000]
        self.compile_buckets[bisect.bisect_left(COMPILE_BUCKETS_S, seconds)] += 1
        self.compile_seconds_sum += seconds


class GrammarCompiler:
    def __init__(
        self,
        tokenizer_json: str,
        eos_token_ids: Iterable[int],
        *,
        max_cache: int = DEFAULT_MAX_CACHE,
    ) -> None:
        """`tokenizer_json`: the model's `tokenizer.json` text. Its llguidance tokenizer (about a
        second for a 128k vocabulary) is built on the compile thread, starting now."""
        if max_cache < 1:
            raise ValueError("the grammar cache holds at least one grammar")
        self.max_cache = max_cache
        self.stats = GrammarStats()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        eos = sorted(eos_token_ids)
        self._tokenizer = self._executor.submit(
            llguidance.LLTokenizer, tokenizer_json, eos_token=eos or None
        )
        self._mask_threads = llguidance.LLExecutor(os.cpu_count() or 1)
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[GrammarSpec, Future[llguidance.LLMatcher]] = {}

    def cached(self, spec: GrammarSpec) -> Constraint | None:
        """A constraint at once when the spec is compiled already, else None (see `compile`)."""
        matcher = self._cache.get(spec)
        if matcher is None:
            return None
        self._cache.move_to_end(spec)
        self.stats.num_cache_hits += 1
        return Constraint(matcher.deep_copy())

    def compile(self, spec: GrammarSpec) -> Future[llguidance.LLMatcher]:
        """Starts compiling the spec (or joins the compile already running for it); take the
        result with `take` once it is done."""
        future = self._compiling.get(spec)
        if future is None:
            future = self._executor.submit(self._compile, spec)
            self._compiling[spec] = future
        return future

    def take(self, spec: GrammarSpec, future: Future[llguidance.LLMatcher]) -> Constraint:
        """The constraint of a finished compile (raises its GrammarError); the grammar is cached."""
        if self._compiling.get(spec) is future:
            del self._compiling[spec]
        try:
            matcher = future.result()
        except GrammarError:
            self.stats.num_failures += 1
            raise
        if spec not in self._cache:
            self._cache[spec] = matcher
            while len(self._cache) > self.max_cache:
                self._cache.popitem(last=False)
        return Constraint(matcher.deep_copy())

    def masks(self, constraints: Sequence[Constraint]) -> list[bytes]:
        """The next-token masks of several constraints (none broken: see `Constraint.error`),
        computed on llguidance's own threads at once: token t is allowed when bit `t % 32` of
        little-endian 32-bit word `t // 32` is set, in words enough for the vocabulary."""
        size = (self._tokenizer.result().vocab_size + 31) // 32 * 4
        out = numpy.empty(len(constraints) * size, dtype=numpy.uint8)
        matchers = [(constraint._matcher, row) for row, constraint in enumerate(constraints)]
        self._mask_threads.unsafe_compute_mask_ptr(matchers, out.ctypes.data, size, len(matchers))
        data = out.tobytes()
        return [data[row * size : (row + 1) * size] for row in range(len(constraints))]

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        tokenizer = self._tokenizer.result()
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, check(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {tidy(matcher.get_error(), spec.kind)}")
        matcher.compute_bitmask()  # the first mask builds the lexer's start: here, not in a step
        self.stats.record(time.perf_counter() - started)
        return matcher

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
