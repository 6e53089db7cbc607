"""Speculative decoding's proposers: cheap guesses of a request's next tokens, which the runner
verifies in the same step (`gpu_worker.plan`, "Speculative decoding"). Pure Python, no torch.

- `NgramProposer` (prompt lookup, `--speculative-method ngram`): the longest of the request's last
  n tokens (n from `max_n` down to `min_n`) that occurred earlier in its prompt or output; the
  tokens that followed that occurrence are the guess. Extraction, quoting and edits copy the
  input, so these guesses land.
- `SuffixProposer` (`suffix`): the same lookup over the request's own tokens, over the recent
  outputs of requests that share its first prompt tokens (the lines of one bulk batch or job
  share a template, and their outputs a shape: a schema's keys, a form's sentences), and over
  the recent outputs of all requests (lines whose prompts differ from the start still share
  their output's shape), and over the outputs of the requests still running, as they grow (the
  lines of a batch that run together guess from each other before any finishes); the longest
  guess wins. Bounded: `max_groups` groups of at most `max_group_tokens` output tokens each, the
  all-requests pool one of them, and `max_live_ngrams` n-grams of running outputs.
- `DraftModelSlots` (`draft`, with `--speculative-model DIR`): a small model with the same
  tokenizer guesses, in the runner (`gpu_worker.drafter`); the scheduler only budgets how many.

Each index maps the request's `min_n`-grams to where they ended and grows with its tokens; a
lookup extends the latest matches backwards, so a proposal costs O(new tokens + matches) rather
than a scan of the sequence.

`Speculation` holds a proposer and the policy: how many drafts a request gets this step, from its
running acceptance rate (fewer when its guesses fail, never zero while it speculates, so it can
recover), and whether a step adds any (`DraftChoice`): the engine times every decode step and
counts the tokens it kept, and at each load level (decode rows, by powers of two) drafts are
added where the steps with drafts have kept at least as many tokens per second as those
without. A compute-bound batch on a CPU gets none; a step whose cost is mostly fixed (weights
streamed once, per-step overhead) gets them. Never past
`SchedulerConfig.speculative_max_batch_tokens` rows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

SPECULATIVE_METHODS = ("ngram", "suffix", "draft")
ACCEPTANCE_SMOOTHING = 0.3  # weight of the latest step in a request's running acceptance rate
GROUP_PREFIX_TOKENS = 16  # prompt tokens that name a suffix group
ALL_REQUESTS: tuple[int, ...] = (-1,)  # the suffix group of every request's outputs
ACCEPTANCE_BOUNDS = tuple(i / 10 for i in range(11))  # per-chunk acceptance histogram
MIN_CHOICE_STEPS = 3  # timed steps of each choice at a load level before comparing them
EXPLORE_EVERY = 64  # steps of a load level between two tries of the losing choice
RATE_SMOOTHING = 0.1  # weight of a step in its choice's running tokens per second
MAX_CANDIDATES = 64  # latest occurrences of a lookup's last tokens whose match is measured


class Proposer(Protocol):
    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:  # fmt: skip
        """Up to `max_tokens` guesses of the tokens after `token_ids` (possibly none)."""
        ...

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request is done: drop its state (and learn from its output)."""
        ...


@dataclass
class NgramIndex:
    """Where each n-gram of a growing token list ended, found from its last `min_n` tokens:
    each `min_n`-gram maps to the ends of its occurrences, and a lookup extends the match of
    the latest ones backwards, up to `max_n` tokens. One entry per token (not one per n), so
    indexing a long prompt costs a seventh of an entry per n-gram size at min 2, max 8."""

    min_n: int
    max_n: int
    num_indexed: int = 0  # `min_n`-grams ending at positions < this are indexed
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def extend(self, token_ids: Sequence[int], upto: int) -> None:
        """Index the `min_n`-grams that end before `upto`."""
        n = self.min_n
        for end in range(max(self.num_indexed, n), upto):
            self.ends.setdefault(tuple(token_ids[end - n : end]), []).append(end)
        self.num_indexed = max(self.num_indexed, upto)

    def follow(self, token_ids: Sequence[int], tail: Sequence[int], max_tokens: int) -> list[int]:
        """The tokens of `token_ids` after the indexed occurrence that matches the longest
        suffix of `tail` (`longest_match`)."""
        if len(tail) < self.min_n:
            return []
        ends = self.ends.get(tuple(tail[len(tail) - self.min_n :]))
        if not ends:
            return []
        occurrences = [(token_ids, end) for end in ends[-MAX_CANDIDATES:]]
        return longest_match(occurrences, tail, self.min_n, self.max_n, max_tokens)


def longest_match(
    occurrences: Sequence[tuple[Sequence[int], int]],
    tail: Sequence[int],
    min_n: int,
    max_n: int,
    max_tokens: int,
) -> list[int]:
    """Of the occurrences (token list, end) of `tail`'s last `min_n` tokens, oldest first: what
    followed the one whose tokens before `end` match the longest suffix of `tail`, up to
    `max_n` tokens (the latest of equals), at most `max_tokens` of them. Only the latest
    `MAX_CANDIDATES` are measured."""
    limit = min(max_n, len(tail))
    best: tuple[Sequence[int], int] | None = None
    best_length = 0
    for token_ids, end in reversed(occurrences[-MAX_CANDIDATES:]):
        length = min_n
        while (
            length < limit
            and end > length
            and token_ids[end - length - 1] == tail[len(tail) - length - 1]
        ):
            length += 1
        if length > best_length:
            best, best_length = (token_ids, end), length
            if length == limit:
                break
    if best is None:
        return []
    token_ids, end = best
    return list(token_ids[end : end + max_tokens])


class NgramProposer:
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("n-gram sizes need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:  # fmt: skip
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.min_n, self.max_n)
        # Occurrences ending before the last token: the last n tokens themselves never match.
        index.extend(token_ids, len(token_ids))
        return index.follow(token_ids, token_ids[-self.max_n :], max_tokens)

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._indexes.pop(request_id, None)


@dataclass
class _Group:
    """The outputs of a group's finished requests, one after another (-1 between two)."""

    token_ids: list[int] = field(default_factory=list)
    index: NgramIndex | None = None


class SuffixProposer:
    def __init__(
        self,
        min_n: int = 2,
        max_n: int = 8,
        max_groups: int = 64,
        max_group_tokens: int = 16384,
        max_live_ngrams: int = 1 << 20,
    ) -> None:
        self.own = NgramProposer(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.max_groups, self.max_group_tokens = max_groups, max_group_tokens
        self._groups: OrderedDict[tuple[int, ...], _Group] = OrderedDict()  # least recent first
        # The outputs of the requests still running, as they grow: each `min_n`-gram -> where
        # it ended, as (the request's token list, end), oldest first (`longest_match`). Lines
        # of one bulk batch that run together guess from each other before any of them
        # finishes. Emptied past `max_live_ngrams` entries.
        self.max_live_ngrams = max_live_ngrams
        self._live: dict[tuple[int, ...], list[tuple[Sequence[int], int]]] = {}
        self.num_live_ngrams = 0
        self._live_indexed: dict[str, int] = {}  # per running request: output indexed up to

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:  # fmt: skip
        guess = self.own.propose(request_id, token_ids, num_prompt_tokens, max_tokens)
        tail = token_ids[-self.max_n :]
        if len(guess) < max_tokens:
            live = self._follow_live(tail, max_tokens)
            guess = live if len(live) > len(guess) else guess
        self._index_live(request_id, token_ids, num_prompt_tokens)
        for key in (_group_key(token_ids, num_prompt_tokens), ALL_REQUESTS):
            group = self._groups.get(key)
            if group is None or len(guess) == max_tokens:
                continue
            if group.index is None:
                group.index = NgramIndex(self.min_n, self.max_n)
            group.index.extend(group.token_ids, len(group.token_ids) + 1)
            shared = group.index.follow(group.token_ids, tail, max_tokens)
            shared = shared[: shared.index(-1)] if -1 in shared else shared
            guess = shared if len(shared) > len(guess) else guess
        return guess

    def _follow_live(self, tail: Sequence[int], max_tokens: int) -> list[int]:
        """What followed the longest suffix of `tail` in a running request's output."""
        if len(tail) < self.min_n:
            return []
        found = self._live.get(tuple(tail[len(tail) - self.min_n :]))
        if not found:
            return []
        return longest_match(found, tail, self.min_n, self.max_n, max_tokens)

    def _index_live(
        self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int
    ) -> None:
        """Index the request's output `min_n`-grams that have a token after them (their end <
        its length), after its own lookup."""
        if self.num_live_ngrams > self.max_live_ngrams:
            self._live.clear()
            self.num_live_ngrams = 0
        n = self.min_n
        start = self._live_indexed.get(request_id, num_prompt_tokens + n)
        for end in range(start, len(token_ids)):
            self._live.setdefault(tuple(token_ids[end - n : end]), []).append((token_ids, end))
        self.num_live_ngrams += max(len(token_ids) - start, 0)
        self._live_indexed[request_id] = max(start, len(token_ids))

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.own.finish(request_id, token_ids, num_prompt_tokens)
        self._live_indexed.pop(request_id, None)
        output = token_ids[num_prompt_tokens:]
        if not output:
            return
        for key in (_group_key(token_ids, num_prompt_tokens), ALL_REQUESTS):
            group = self._groups.pop(key, None) or _Group()
            self._groups[key] = group  # now the most recent
            group.token_ids += [*output, -1]
            if len(group.token_ids) > self.max_group_tokens:  # keep the newest half, re-indexed
                del group.token_ids[: len(group.token_ids) - self.max_group_tokens // 2]
                group.index = None
        while len(self._groups) > self.max_groups:
            self._groups.popitem(last=False)

    @property
    def num_group_tokens(self) -> int:
        return sum(len(group.token_ids) for group in self._groups.values())


def _group_key(token_ids: Sequence[int], num_prompt_tokens: int) -> tuple[int, ...]:
    return tuple(token_ids[: min(num_prompt_tokens, GROUP_PREFIX_TOKENS)])


class DraftModelSlots:
    """Method `draft`: the runner's draft model guesses the tokens (`gpu_worker.drafter`); the
    scheduler only budgets how many (placeholders here, never sent)."""

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:  # fmt: skip
        return [-1] * max_tokens

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        pass


def make_proposer(method: str) -> Proposer:
    if method == "ngram":
        return NgramProposer()
    if method == "suffix":
        return SuffixProposer()
    if method == "draft":
        return DraftModelSlots()
    methods = ", ".join(SPECULATIVE_METHODS)
    raise ValueError(f"speculative method {method!r} is not one of {methods}")


@dataclass
class SpeculationStats:
    """Since the scheduler started: drafts proposed and accepted, and the verifying chunks."""

    num_proposed: int = 0
    num_accepted: int = 0
    num_verified: int = 0  # chunks that carried drafts
    # Histogram of per-chunk acceptance r = accepted / proposed: [0] counts r = 0, [i] counts
    # (i - 1) / 10 < r <= i / 10 (Prometheus buckets `ACCEPTANCE_BOUNDS`), with their sum.
    acceptance_counts: list[int] = field(default_factory=lambda: [0] * len(ACCEPTANCE_BOUNDS))
    acceptance_sum: float = 0.0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_verified += 1
        self.acceptance_counts[-(-num_accepted * 10 // num_proposed)] += 1
        self.acceptance_sum += num_accepted / num_proposed

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens kept per verifying chunk (1 without speculation)."""
        return 1 + self.num_accepted / self.num_verified if self.num_verified else 1.0


class DraftChoice:
    """Whether drafts pay at a load level, measured: for each level (decode rows, by powers of
    two) the running tokens per second of the steps that verified drafts and of those that did
    not; drafts go where theirs is at least as high. An untried choice is tried first, and the
    losing one again every `EXPLORE_EVERY` steps of its level, so the answer follows the
    machine and the acceptance. Timings only ever add noise, and each rate averages many steps."""

    def __init__(self) -> None:
        self._rates: dict[tuple[int, bool], float] = {}  # (level, drafted) -> tokens/s
        self._counts: dict[tuple[int, bool], int] = {}
        self._steps: dict[int, int] = {}

    def drafts_pay(self, rows: int) -> bool:
        level = rows.bit_length()
        step = self._steps[level] = self._steps.get(level, 0) + 1
        for drafted in (True, False):
            if self._counts.get((level, drafted), 0) < MIN_CHOICE_STEPS:
                return drafted
        better = self._rates[level, True] >= self._rates[level, False]
        return not better if step % EXPLORE_EVERY == 0 else better

    def record(self, rows: int, drafted: bool, num_tokens: int, seconds: float) -> None:
        """A decode step of `rows` rows (drafts apart) kept `num_tokens` tokens in `seconds`."""
        key = (rows.bit_length(), drafted)
        rate = num_tokens / max(seconds, 1e-9)
        count = self._counts[key] = self._counts.get(key, 0) + 1
        old = self._rates.get(key, rate)
        self._rates[key] = old + max(RATE_SMOOTHING, 1 / count) * (rate - old)

    def rates(self) -> dict[tuple[int, bool], float]:
        return dict(self._rates)


class Speculation:
    """The proposer, how many drafts each request gets and how many a step has room for."""

    def __init__(self, proposer: Proposer, max_drafts: int, max_batch_tokens: int) -> None:
        if max_drafts < 1:
            raise ValueError("speculation needs at least one draft token (--speculate >= 1)")
        self.proposer = proposer
        self.max_drafts = max_drafts
        self.max_batch_tokens = max_batch_tokens
        self.stats = SpeculationStats()
        self.choice = DraftChoice()
        self._acceptance: dict[str, float] = {}  # per request, running

    def draft_room(self, num_tokens: int, budget: int) -> int:
        """How many drafts a step of `num_tokens` tokens may add (at most `budget`): none where
        they do not pay at this load (`DraftChoice`), never past `max_batch_tokens`."""
        room = min(budget, self.max_batch_tokens - num_tokens)
        return room if room > 0 and self.choice.drafts_pay(num_tokens) else 0

    @property
    def uses_draft_model(self) -> bool:
        return isinstance(self.proposer, DraftModelSlots)

    def num_drafts(self, request_id: str) -> int:
        """This request's draft length: `max_drafts` scaled by its running acceptance rate,
        at least one."""
        rate = self._acceptance.get(request_id, 1.0)
        return max(1, round(self.max_drafts * rate))

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:  # fmt: skip
        max_tokens = min(max_tokens, self.num_drafts(request_id))
        if max_tokens < 1:
            return []
        return self.proposer.propose(request_id, token_ids, num_prompt_tokens, max_tokens)[
            :max_tokens
        ]

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        self.stats.record(num_proposed, num_accepted)
        latest = num_accepted / num_proposed
        rate = self._acceptance.get(request_id, 1.0)
        self._acceptance[request_id] = rate + ACCEPTANCE_SMOOTHING * (latest - rate)

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._acceptance.pop(request_id, None)
        self.proposer.finish(request_id, token_ids, num_prompt_tokens)
