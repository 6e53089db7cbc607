"""Running `tgq bench`'s load: the arrival times, one streamed request, all of them at most
`--concurrency` in flight over one httpx connection pool, and the progress line."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import sys
import time
from typing import TextIO

import httpx

from tgq.cli.bench.backends import BACKENDS, sse_data
from tgq.cli.bench.datasets import Prompt
from tgq.cli.bench.records import RequestRecord, RequestTimer


def poisson_arrivals(num: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (s from the start) of a Poisson process: exponential gaps of mean 1 / rate,
    the first at 0; all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num
    gaps = (rng.expovariate(rate) for _ in range(num - 1))
    return list(itertools.accumulate(gaps, initial=0.0))


class Progress:
    """`37/100 done, 1 failed, 812 tok/s` redrawn in place on a terminal; silent elsewhere."""

    def __init__(self, stream: TextIO, label: str, num_total: int) -> None:
        self.stream, self.label, self.num_total = stream, label, num_total
        self.is_shown = stream.isatty()
        self.started = time.perf_counter()
        self.num_done = self.num_failed = self.num_tokens = 0

    def add(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_failed += not record.is_ok
        self.num_tokens += record.output_tokens
        if self.is_shown:
            rate = self.num_tokens / (time.perf_counter() - self.started)
            self.stream.write(
                f"\r{self.label}: {self.num_done}/{self.num_total} done, "
                f"{self.num_failed} failed, {rate:.0f} tok/s"
            )
            self.stream.flush()

    def end(self) -> None:
        if self.is_shown and self.num_done:
            self.stream.write("\n")


async def send(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    prompt: Prompt,
    index: int,
    run_started_at: float,
) -> RequestRecord:
    """One streamed request, timed from just before it is sent to the last byte read."""
    backend = BACKENDS[args.backend]
    body = backend.body(prompt, args.model, args.ignore_eos)
    timer = RequestTimer(index, time.perf_counter(), run_started_at, prompt.num_tokens)
    try:
        async with (
            asyncio.timeout(args.timeout_s),
            client.stream("POST", backend.path, json=body) as response,
        ):
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return timer.finish(time.perf_counter(), response.status_code, text)
            async for data in sse_data(response.aiter_lines()):
                timer.add(time.perf_counter(), backend.parse(data))
            return timer.finish(time.perf_counter(), response.status_code)
    except TimeoutError:
        return timer.finish(time.perf_counter(), None, f"timed out after {args.timeout_s:g} s")
    except (httpx.HTTPError, ValueError) as error:
        return timer.finish(time.perf_counter(), None, f"{type(error).__name__}: {error}")


async def send_all(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    prompts: list[Prompt],
    arrivals: list[float],
    progress: Progress,
) -> tuple[list[RequestRecord], float]:
    """Each prompt sent at its arrival time, at most `--concurrency` in flight; returns the
    records and the duration from the first send to the last answer."""
    started = time.perf_counter()
    in_flight = asyncio.Semaphore(args.concurrency or len(prompts))

    async def one(index: int, prompt: Prompt, arrival: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, started + arrival - time.perf_counter()))
        async with in_flight:
            record = await send(client, args, prompt, index, started)
        progress.add(record)
        return record

    records = await asyncio.gather(*map(one, itertools.count(), prompts, arrivals))
    duration_s = time.perf_counter() - started
    progress.end()
    return list(records), duration_s


async def run_load(
    args: argparse.Namespace, prompts: list[Prompt], warmups: list[Prompt], arrivals: list[float]
) -> tuple[list[RequestRecord], float]:
    """The warmup requests (all at once, within the concurrency; not recorded), then the run."""
    pool_size = args.concurrency or len(prompts)
    limits = httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, limits=limits, timeout=httpx.Timeout(None)
    ) as client:
        if warmups:
            warmup = Progress(sys.stderr, "warmup", len(warmups))
            await send_all(client, args, warmups, [0.0] * len(warmups), warmup)
        progress = Progress(sys.stderr, "bench", len(prompts))
        return await send_all(client, args, prompts, arrivals, progress)
