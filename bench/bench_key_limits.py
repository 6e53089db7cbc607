"""Per-key isolation: does one key's burst hurt another key's latency? (issue 30, must-show 1)

One api process and one batcher (Redis, Postgres), the tests' tiny text model. Key `steady` has
no limits; key `bursty` has `--max-concurrent` concurrent requests and `--rpm`. The steady
client sends `--requests` streaming `/generate_stream` requests one after another (a prompt of
about 64 tokens, 8 new tokens) and records each one's time to first token. Phases alternate,
`--rounds` times: steady alone, then steady while `--burst` bursty clients send the same kind
of request back to back, each waiting what a refusal's `retry-after-ms` says (as the OpenAI SDKs
do). Reported: the steady key's TTFT p50 and p99 alone and under the burst, their ratio per
round, and the bursty key's admitted and refused requests.

Prints one summary, writes JSON and a PNG (steady TTFT CDFs) to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.harness import RESULTS, percentile, pyplot, save_figure, write_results
from tests.api.stack import Stack, create_api_key, migrated_database, write_text_model
from tgq.api.key_policy import KeyLimits

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6
BODY = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "ignore_eos": True}}


async def ttft(client: httpx.AsyncClient, url: str, key: str) -> float | None:
    """Seconds to the first streamed token, or None when refused (429)."""
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", f"{url}/generate_stream", json=BODY, headers=headers) as r:
        if r.status_code == 429:
            await r.aread()
            return None
        r.raise_for_status()
        first = None
        async for _ in r.aiter_bytes():
            first = first or time.perf_counter()
    return (first or time.perf_counter()) - start


async def steady_phase(client: httpx.AsyncClient, url: str, key: str, count: int) -> list[float]:
    times = [await ttft(client, url, key) for _ in range(count)]
    return sorted(t for t in times if t is not None)


async def burst(client: httpx.AsyncClient, url: str, key: str, counts: list[int]) -> None:
    """Back-to-back requests until cancelled; a 429 waits its `retry-after-ms`. Counts
    [admitted, refused] into `counts`."""
    headers = {"Authorization": f"Bearer {key}"}
    while True:
        async with client.stream("POST", f"{url}/generate_stream", json=BODY, headers=headers) as r:
            await r.aread()
            if r.status_code == 429:
                counts[1] += 1
                await asyncio.sleep(int(r.headers["retry-after-ms"]) / 1000)
            else:
                r.raise_for_status()
                counts[0] += 1


async def measure(url: str, keys: tuple[str, str], args: argparse.Namespace) -> dict[str, Any]:
    steady_key, bursty_key = keys
    limits = httpx.Limits(max_connections=args.burst + 8)
    rounds: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await steady_phase(client, url, steady_key, 4)  # warm-up
        for _ in range(args.rounds):
            alone = await steady_phase(client, url, steady_key, args.requests)
            counts = [0, 0]
            bursters = [
                asyncio.create_task(burst(client, url, bursty_key, counts))
                for _ in range(args.burst)
            ]
            loaded = await steady_phase(client, url, steady_key, args.requests)
            for task in bursters:
                task.cancel()
            await asyncio.gather(*bursters, return_exceptions=True)
            rounds.append(
                {"alone": alone, "burst": loaded, "bursty_admitted": counts[0],
                 "bursty_refused": counts[1]}
            )  # fmt: skip
    return {"rounds": rounds}


def summarize(results: dict[str, Any]) -> None:
    print(f"{'round':>5} {'alone p50':>10} {'alone p99':>10} {'burst p50':>10} {'burst p99':>10}"
          f" {'p99 ratio':>9} {'bursty ok':>9} {'bursty 429':>10}")  # fmt: skip
    ratios = []
    for i, r in enumerate(results["rounds"]):
        a99, b99 = percentile(r["alone"], 0.99), percentile(r["burst"], 0.99)
        ratios.append(b99 / a99)
        print(
            f"{i:>5} {percentile(r['alone'], 0.5) * 1e3:>8.1f}ms {a99 * 1e3:>8.1f}ms "
            f"{percentile(r['burst'], 0.5) * 1e3:>8.1f}ms {b99 * 1e3:>8.1f}ms {b99 / a99:>9.3f} "
            f"{r['bursty_admitted']:>9} {r['bursty_refused']:>10}"
        )
    results["p99_ratios"] = ratios
    print(f"steady key's TTFT p99 under the burst / alone: {min(ratios):.3f}-{max(ratios):.3f} "
          f"(median {sorted(ratios)[len(ratios) // 2]:.3f}; goal <= 1.10)")  # fmt: skip


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, r in enumerate(results["rounds"]):
        for phase, color in (("alone", "#999999"), ("burst", "#1f77b4")):
            values = [v * 1e3 for v in r[phase]]
            fractions = [(j + 1) / len(values) for j in range(len(values))]
            label = phase if i == 0 else None
            ax.step(values, fractions, where="post", color=color, alpha=0.7, label=label)
    ax.set_xlabel("steady key's TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=8)
    save_figure(fig, "Another key's burst (limited) vs the steady key alone", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60, help="steady requests per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=16, help="bursty clients at once")
    parser.add_argument("--max-concurrent", type=int, default=2, help="the bursty key's limit")
    parser.add_argument("--rpm", type=int, default=600, help="the bursty key's limit")
    parser.add_argument(
        "--priority", choices=("interactive", "bulk"), default="bulk", help="the bursty key's cap"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, migrated_database() as database_url:
        model = write_text_model(Path(tmp) / "model")
        env = {"REQUIRE_API_KEYS": "true", "MAX_CONCURRENT_REQUESTS": "256"}
        stack = Stack(model, database_url, Path(tmp) / "logs", api_env=env)
        bursty = KeyLimits(rpm=args.rpm, max_concurrent=args.max_concurrent, priority=args.priority)
        keys = (
            create_api_key(database_url, "steady"),
            create_api_key(database_url, "bursty", bursty),
        )
        try:
            stack.start_batcher()
            stack.start_api()
            results = asyncio.run(measure(stack.url, keys, args))
        finally:
            with contextlib.suppress(Exception):
                stack.stop()
    summarize(results)
    write_results("key_limits", args, results)
    plot(results, RESULTS / "key-limits-cpu.png")


if __name__ == "__main__":
    main()
