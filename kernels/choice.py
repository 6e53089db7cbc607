"""Kernels chosen by measurement on the CPU at hand, not by its flags.

An op the model runs (its linears, prefill attention) has several kernels that can serve it on a
given CPU: the own AVX-512 and AMX kernels, and torch's (oneDNN, which uses AMX where the CPU has
it; SDPA). Which is fastest depends on the CPU and on the shape: the AVX-512 kernel streams the
weights at the memory floor for a few rows, AMX tiles win from 16 rows on, oneDNN can win on
large GEMMs. So each op is timed at a few sizes (`ROW_BUCKETS`: rows of a linear, query tokens of
an attention call) with the model's own shapes, the fastest candidate per size is kept, and a
call of `rows` rows runs the choice of the smallest bucket that holds it (the last bucket past
them all).

Choices are measured once per CPU model, CPU flags, thread count, torch version and shapes, and
kept as JSON in the kernel cache ($TGQ_KERNEL_CACHE, else ~/.cache/tgq/kernels) under
`choices/`; start-up logs what was picked and why.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096)
# Timing per candidate and bucket: ROUNDS turns among the candidates, each a first call
# (warm-up) then REPEATS timed calls; a candidate's time is its fastest call (other work on the
# machine only ever adds time, so the minimum is the steadiest estimate).
ROUNDS = 3
REPEATS = 3
# Rounds before a clear lead may end the timing early: one round's burst of other work could
# make a 2x lead on its own (a CI run on the AMD EPYC once timed tgq's linear at 44.5 ms against
# oneDNN's 21.6 in the first round, where both take ~20 ms).
MIN_ROUNDS = 2
# Flags that decide which kernels can run (and so belong in the cache key).
_KEY_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Measured:
    """One op at one bucket: each candidate's time (fastest of its calls)."""

    op: str
    rows: int
    timings_ms: Mapping[str, float]
    # A factor on a candidate's time when picking: a candidate that costs something beyond its
    # time (a second copy of the weights) must win by that much (1.1: by more than 10%).
    handicap: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def picked(self) -> str:
        return min(self.timings_ms, key=lambda n: self.timings_ms[n] * self.handicap.get(n, 1.0))


@dataclasses.dataclass(frozen=True, slots=True)
class Choices:
    """The measurements of every op, and the kernel each call size runs."""

    key: Mapping[str, Any]
    measured: Sequence[Measured]

    def pick(self, op: str, rows: int) -> str:
        """The kernel for a call of `op` with `rows` rows: the smallest measured bucket that
        holds `rows`, the largest past them all."""
        buckets = sorted((m for m in self.measured if m.op == op), key=lambda m: m.rows)
        if not buckets:
            raise KeyError(f"no kernel measured for {op!r}")
        for entry in buckets:
            if rows <= entry.rows:
                return entry.picked
        return buckets[-1].picked

    def thresholds(self, op: str) -> list[tuple[int, str]]:
        """[(largest rows, kernel)] in order, runs of the same kernel merged; the last entry also
        serves every larger call."""
        out: list[tuple[int, str]] = []
        for entry in sorted((m for m in self.measured if m.op == op), key=lambda m: m.rows):
            if out and out[-1][1] == entry.picked:
                out[-1] = (entry.rows, entry.picked)
            else:
                out.append((entry.rows, entry.picked))
        return out

    def summary(self, op: str) -> str:
        """`1-4: avx512, 16-4096: amx (... ms)` for logs and benchmark reports."""
        parts = []
        low = 1
        for rows, kernel in self.thresholds(op):
            parts.append(f"{low}-{rows}: {kernel}")
            low = rows + 1
        return ", ".join(parts)


def kernel_for(thresholds: Sequence[tuple[int, str]], rows: int) -> str:
    """The kernel of the first `(largest rows, kernel)` entry of `Choices.thresholds` that holds
    `rows`; the last entry's past them all."""
    for largest, name in thresholds:
        if rows <= largest:
            return name
    return thresholds[-1][1]


def cpu_key() -> dict[str, Any]:
    """What the measurements depend on besides the shapes."""
    model = ""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and not model:
                model = value.strip()
            elif name.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "flags": [flag for flag in _KEY_FLAGS if flag in flags],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def time_ms(fn: Callable[[], object], repeats: int = REPEATS, budget_s: float = 0.25) -> float:
    """Fastest wall time of `fn` over `repeats` calls, after one call to warm caches; past
    `budget_s` of calls, two are enough (a 4,096-token prefill can take half a second)."""
    fn()
    samples: list[float] = []
    begin = time.perf_counter()
    while len(samples) < repeats and (len(samples) < 2 or time.perf_counter() - begin < budget_s):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


def time_in_turns(
    calls: Mapping[str, Callable[[], object]], repeats: int = REPEATS, budget_s: float = 0.25
) -> dict[str, float]:
    """Each call's fastest wall time (ms) over `repeats` calls, the candidates taking turns call
    by call (A, B, A, B, ...) after one warm-up call each, so that a burst of other work on the
    machine slows a call of each rather than all the calls of one; past `budget_s` per
    candidate, two calls each are enough."""
    for call in calls.values():
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    begin = time.perf_counter()
    done = 0
    while done < repeats and (done < 2 or time.perf_counter() - begin < budget_s * len(calls)):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append((time.perf_counter() - start) * 1e3)
        done += 1
    return {name: min(times) for name, times in samples.items()}


def measure(
    op: str,
    candidates: Mapping[str, Callable[[int], Callable[[], object]]],
    rows: Sequence[int],
    handicap: Mapping[str, float] | None = None,
    *,
    prune: float = 5.0,
) -> list[Measured]:
    """Times each candidate at each bucket, in increasing order: `candidates[name](rows)` returns
    the call to time (inputs made beforehand, outside the timing). A candidate over `prune`
    times slower than the fastest at one bucket is not timed at the larger ones."""
    out = []
    remaining = dict(candidates)
    for count in sorted(rows):
        calls = {name: make(count) for name, make in remaining.items()}
        # In turns, up to ROUNDS times: a burst of other work on the machine slows one round of
        # one candidate, not all of its rounds. Rounds stop once the fastest leads by 25% after
        # MIN_ROUNDS of them (or at once with one candidate).
        timings = {name: float("inf") for name in calls}
        for done in range(1, ROUNDS + 1):
            for name, ms in time_in_turns(calls).items():
                timings[name] = min(timings[name], ms)
            ranked = sorted(timings.values())
            if len(ranked) < 2 or (done >= MIN_ROUNDS and ranked[1] > 1.25 * ranked[0]):
                break
        out.append(Measured(op, count, timings, dict(handicap or {})))
        best = min(timings.values())
        remaining = {
            name: make for name, make in remaining.items() if timings[name] <= prune * best
        }
    return out


def _cache_dir() -> Path:
    root = Path(os.environ.get("TGQ_KERNEL_CACHE", Path.home() / ".cache" / "tgq" / "kernels"))
    return root / "choices"


def choose(
    shapes: Mapping[str, Any], run: Callable[[], list[Measured]], *, cache: bool = True
) -> Choices:
    """The choices for these `shapes` on this CPU: from the cache, else measured by `run` and
    cached (`cache=False`: always measured, nothing read or written)."""
    key = {**cpu_key(), "shapes": shapes}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = _cache_dir() / f"{digest}.json"
    if cache and path.exists():
        try:
            data = json.loads(path.read_text())
            measured = [
                Measured(m["op"], m["rows"], m["timings_ms"], m["handicap"])
                for m in data["measured"]
            ]
            choices = Choices(key, measured)
            _log(choices, f"cached in {path}")
            return choices
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("kernel choices in %s unreadable (%s): measuring again", path, exc)
    choices = Choices(key, run())
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        record = {"key": key, "measured": [dataclasses.asdict(m) for m in choices.measured]}
        scratch.write_text(json.dumps(record, indent=1))
        scratch.replace(path)
    _log(choices, "measured now")
    return choices


def _log(choices: Choices, source: str) -> None:
    for op in sorted({m.op for m in choices.measured}):
        logger.info(
            "kernels for %s on %s, %d threads (%s): %s",
            op,
            choices.key["cpu"],
            choices.key["threads"],
            source,
            choices.summary(op),
        )
