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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import numpy

from tgq.batcher.grammar import GrammarError, GrammarSpec, check, tidy

DEFAULT_MAX_CACHE = 1024  # compiled grammars kept (`--max-grammar-cache`)
# llguidance's thread pool computes a step's masks only on machines with at least this many CPUs.
# Each call wakes its threads (~0.05-0.1 ms) and, on a CPU server, takes cores from the model's
# threads: on 2 CPUs (AMD EPYC, 2026-12-06), masks of 1 to 64 rows in a JSON string took
# 1.5-3x longer on the pool than one after the other on the engine's thread (64 rows: 0.49 ms
# against 0.34 ms while torch ran on both cores). Where the pool starts to pay is not measured:
# 8 CPUs is a guess that leaves small machines on the engine's thread.
POOL_MIN_CPUS = 8
# After the free argmax of a constrained greedy row missed its grammar, the steps that compute its
# mask up front before it checks the argmax first again: 1, 2, 4 ... at most this many (see
# `Constraint`).
MAX_MASK_FIRST_STEPS = 64
# A step lets at most this many misses be expected among its rows that check their argmax first
# (rows x the recent miss rate; at least one row checks, so the rate stays measured). Any miss
# costs a second pass over the lm head for the rows that missed, about as much as one pass for
# all of them (the weights are read once either way); a mask costs each row ~0.05-0.2 ms.
MAX_EXPECTED_MISSES = 0.25
MISS_RATE_WEIGHT = 0.05  # of each check in the moving average of the miss rate
# Upper bounds (seconds) of the compile-time histogram the heartbeat carries; one more for +Inf.
COMPILE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Constraint:
    """One request's grammar state: the mask of its next token, advanced token by token.

    It also says whether a greedy step should check the model's free argmax against the grammar
    before computing a mask (`checks_argmax_first`): after the argmax missed, the next step
    computes the mask up front, then 2, 4 ... up to `MAX_MASK_FIRST_STEPS` steps after each
    further miss in a row, so a state the model keeps missing (a key it does not know) costs a
    few wasted head passes, not one per step."""

    __slots__ = ("_backoff", "_eos_token_ids", "_masks_first", "_matcher", "_vocab_size")

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size  # the tokenizer's: llguidance breaks on a token past it
        self._eos_token_ids = eos_token_ids
        self._backoff = 1  # steps with the mask up front after the next miss
        self._masks_first = 0  # steps left with the mask up front

    def checks_argmax_first(self) -> bool:
        """Whether this step (one greedy step of this request) checks the argmax first: not
        where the grammar forces the next bytes, whose mask holds only the token that spells
        them as the tokenizer would (`allows` would take any token that is a prefix of them)."""
        if self._masks_first:
            self._masks_first -= 1
            return False
        return not self._matcher.compute_ff_bytes()

    def allows(self, token_id: int, *, is_eos: bool) -> bool:
        """Whether the grammar allows this token next, as the mask's bit would say where
        `checks_argmax_first` (an EOS where the output may end); a miss makes the next steps
        compute the mask up front (see the class)."""
        matcher = self._matcher
        allowed = matcher.is_accepting() if is_eos else matcher.validate_tokens([token_id]) == 1
        if allowed:
            self._backoff = 1
        else:
            self._masks_first = self._backoff
            self._backoff = min(2 * self._backoff, MAX_MASK_FIRST_STEPS)
        return allowed

    def num_draftable(self, draft_token_ids: Sequence[int]) -> int:
        """How many of speculation's guesses, in a row, the grammar allows from its state (it
        consumes none). Not an EOS or a token past the tokenizer's vocabulary: the drafts end
        before one."""
        usable = 0
        for token_id in draft_token_ids:
            if token_id >= self._vocab_size or token_id in self._eos_token_ids:
                break
            usable += 1
        return int(self._matcher.validate_tokens(list(draft_token_ids[:usable]))) if usable else 0

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
    num_argmax_checks: int = 0  # greedy rows whose free argmax was checked against the grammar
    num_argmax_misses: int = 0  # of those, the ones the grammar did not allow (masked again)

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
        mask_threads: int | None = None,
    ) -> None:
        """`tokenizer_json`: the model's `tokenizer.json` text. Its llguidance tokenizer (about a
        second for a 128k vocabulary) is built on the compile thread, starting now.
        `mask_threads`: llguidance's pool for the masks of a step's rows (0 or 1: none, every
        mask on the engine's thread; None: as many as CPUs, from `POOL_MIN_CPUS` CPUs)."""
        if max_cache < 1:
            raise ValueError("the grammar cache holds at least one grammar")
        self.max_cache = max_cache
        self.stats = GrammarStats()
        # Of greedy rows' free argmax checks, recently (a moving average; see `step_masks`).
        self.miss_rate = 0.1
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        eos = sorted(eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self._tokenizer = self._executor.submit(
            llguidance.LLTokenizer, tokenizer_json, eos_token=eos or None
        )
        if mask_threads is None:
            cpus = os.cpu_count() or 1
            mask_threads = cpus if cpus >= POOL_MIN_CPUS else 0
        self._mask_threads = llguidance.LLExecutor(mask_threads) if mask_threads > 1 else None
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[GrammarSpec, Future[llguidance.LLMatcher]] = {}

    def cached(self, spec: GrammarSpec) -> Constraint | None:
        """A constraint at once when the spec is compiled already, else None (see `compile`)."""
        matcher = self._cache.get(spec)
        if matcher is None:
            return None
        self._cache.move_to_end(spec)
        self.stats.num_cache_hits += 1
        return self._constraint(matcher)

    def _constraint(self, matcher: llguidance.LLMatcher) -> Constraint:
        return Constraint(matcher.deep_copy(), self.vocab_size, self.eos_token_ids)

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
        return self._constraint(matcher)

    def step_masks(
        self,
        masks_now: dict[str, Constraint],
        argmax_first: dict[str, Constraint],
        drafts: Mapping[str, Sequence[int]] | None = None,
    ) -> StepMasks:
        """A step's masks by request id (`plan.StepPlan.token_masks`): those of `masks_now`
        computed now, together; those of `argmax_first` (greedy rows that may check their free
        argmax first) only if the runner asks, after their argmax missed the grammar, for as
        many rows as `MAX_EXPECTED_MISSES` lets at the recent miss rate (the rest now too).
        `drafts`: the guesses a request of `masks_now` verifies (speculation, each allowed by
        its grammar: `Constraint.num_draftable`); its entry is then one mask per row it
        samples, one after another: before the drafts, then after each (`masks_along`)."""
        limit = max(1, int(MAX_EXPECTED_MISSES / max(self.miss_rate, 1e-6)))
        if len(argmax_first) > limit:
            rows = list(argmax_first.items())
            masks_now = masks_now | dict(rows[limit:])
            argmax_first = dict(rows[:limit])
        drafts = drafts or {}
        plain = {key: c for key, c in masks_now.items() if not drafts.get(key)}
        computed = dict(zip(plain, self._step_masks(list(plain.values())), strict=True))
        computed |= {
            key: self.masks_along(constraint, drafts[key])
            for key, constraint in masks_now.items()
            if key not in plain
        }
        return StepMasks(self, computed, argmax_first)

    def masks_along(self, constraint: Constraint, draft_token_ids: Sequence[int]) -> bytes:
        """The masks of a row and of each draft after it: the state now, then after each draft
        in turn (the grammar must allow them all), concatenated; the state is left as it was."""
        matcher = constraint._matcher
        started = time.perf_counter()
        masks = []
        for token_id in draft_token_ids:
            masks += self.masks([constraint])
            matcher.consume_token(token_id)
        masks += self.masks([constraint])
        matcher.rollback(len(draft_token_ids))
        self.stats.num_masks += len(masks)
        self.stats.mask_seconds += time.perf_counter() - started
        return b"".join(masks)

    def _step_masks(self, constraints: list[Constraint]) -> list[bytes]:
        """`masks`, counted and timed in `stats` as a step's."""
        if not constraints:
            return []
        started = time.perf_counter()
        masks = self.masks(constraints)
        self.stats.num_masks += len(masks)
        self.stats.mask_seconds += time.perf_counter() - started
        return masks

    def _record_check(self, allowed: bool) -> None:
        """One greedy row's argmax check: the counters and the miss rate's moving average."""
        self.stats.num_argmax_checks += 1
        self.stats.num_argmax_misses += not allowed
        self.miss_rate += MISS_RATE_WEIGHT * ((not allowed) - self.miss_rate)

    def masks(self, constraints: Sequence[Constraint]) -> list[bytes]:
        """The next-token masks of several constraints (none broken: see `Constraint.error`):
        token t is allowed when bit `t % 32` of little-endian 32-bit word `t // 32` is set, in
        words enough for the vocabulary. On this thread for one row or on a machine of few
        CPUs; else on llguidance's own threads at once (see `POOL_MIN_CPUS`)."""
        size = (self.vocab_size + 31) // 32 * 4
        out = numpy.empty(len(constraints) * size, dtype=numpy.uint8)
        start = out.ctypes.data
        if len(constraints) == 1 or self._mask_threads is None:
            for row, constraint in enumerate(constraints):
                constraint._matcher.unsafe_compute_mask_ptr(start + row * size, size)
        else:
            matchers = [(constraint._matcher, row) for row, constraint in enumerate(constraints)]
            self._mask_threads.unsafe_compute_mask_ptr(matchers, start, size, len(matchers))
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

    @property
    def vocab_size(self) -> int:
        """The tokenizer's tokens (the masks' bits); a model may have more rows than that."""
        return int(self._tokenizer.result().vocab_size)


class StepMasks(Mapping[str, bytes]):
    """One step's grammar masks by request id, as the runner reads them (`plan.StepPlan`).

    Greedy rows may check their free argmax first (`checks_argmax_first`): when the grammar
    allows it, it is the argmax over the allowed tokens too, and no mask is computed; when not,
    reading the row's mask computes it, and the runner takes the argmax again under it. A mask
    costs ~0.2 ms in a step (llguidance walks the vocabulary's trie after the weights have
    flushed the caches); a check, a few microseconds. The runner must be done with this object
    before the constraints advance (the engine consumes the step's tokens after it returns)."""

    def __init__(
        self,
        compiler: GrammarCompiler,
        computed: dict[str, bytes],
        argmax_first: dict[str, Constraint],
    ) -> None:
        self._compiler = compiler
        self._computed = computed
        self._argmax_first = argmax_first

    def checks_argmax_first(self, request_id: str) -> bool:
        return request_id in self._argmax_first and request_id not in self._computed

    def allows(self, request_id: str, token_id: int) -> bool:
        """Whether the grammar of a row that checks its argmax first allows this token."""
        compiler = self._compiler
        allowed = token_id < compiler.vocab_size and self._argmax_first[request_id].allows(
            token_id, is_eos=token_id in compiler.eos_token_ids
        )
        compiler._record_check(allowed)
        return allowed

    def __getitem__(self, request_id: str) -> bytes:
        mask = self._computed.get(request_id)
        if mask is None:
            constraint = self._argmax_first[request_id]  # KeyError: not a constrained row
            (mask,) = self._compiler._step_masks([constraint])
            self._computed[request_id] = mask
        return mask

    def __iter__(self) -> Iterator[str]:
        yield from self._computed
        yield from (key for key in self._argmax_first if key not in self._computed)

    def __len__(self) -> int:
        return len(self._computed.keys() | self._argmax_first.keys())
