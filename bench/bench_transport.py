"""Transport benchmark: the scheduler benchmark's workload through Redis and a real batcher
process, against the offline engine in the same run.

Medium Llama shape, random bf16 weights, CPU, 2 threads. The offline engine runs the 64 mixed
requests (prompts uniform in 32..512 tokens, outputs uniform in 16..256, EOS ignored) first; then
a `python -m tgq.batcher` process runs the same requests submitted through Redis, while one reader
thread per request follows its token stream through the api's side of the transport (one api
replica: its token hub reads every stream in one blocking XREAD).

Reports tokens/s both ways (best of `--repeats` runs each, taken in turns) and their ratio;
per-token publish latency, from the engine step that produced a token (the event's `created_at`)
to a reader holding it, p50/p99; and Redis commands per generated token (server-side
`INFO commandstats`: submits, publishes and reads together).
Prints one summary table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis
import torch

from bench.harness import (
    NUM_BLOCKS,
    TgqOffline,
    Workload,
    medium_llama_4k,
    percentile,
    random_workload,
    write_results,
)
from tests.api.stack import delete_keys
from tgq.batcher.messages import SubmitRequest
from tgq.batcher.request import StoppingParams
from tgq.batcher.transport.base import ApiTransport
from tgq.batcher.transport.blocking import BlockingApiTransport
from tgq.gpu_worker.plan import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def start_batcher(model_dir: Path, redis_url: str, prefix: str) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "tgq.batcher", "--model-id", str(model_dir), "--redis-url", redis_url,
        "--prefix", prefix, "--batcher-id", "bench", "--num-blocks", str(NUM_BLOCKS),
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, env=dict(os.environ), stderr=subprocess.DEVNULL)


def wait_until_live(transport: ApiTransport, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while not transport.live_batchers():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the batcher did not start")
        time.sleep(0.2)


def follow(transport: ApiTransport, request_id: str, latencies: list[float]) -> int:
    """Reads one request's events until its final result; returns its number of tokens. One
    blocking read per wake-up, as an SSE handler would; the final result is checked only when a
    read comes back empty (the end marker wakes it)."""
    seq_index = num_tokens = 0
    while True:
        events = transport.read_tokens(request_id, seq_index, 5.0)
        for event in events:
            latencies.append(time.time() - event.created_at)
            num_tokens += len(event.token_ids)
            seq_index += 1
        is_done = not events and transport.read_final(request_id) is not None
        if is_done and not transport.read_tokens(request_id, seq_index, 0):
            return num_tokens


def submit(transport: ApiTransport, workload: Workload, tag: str) -> list[str]:
    request_ids = []
    for i, (prompt, num_out) in enumerate(workload):
        request_id = f"{tag}-{i}"
        stopping = StoppingParams(max_new_tokens=num_out, ignore_eos=True)
        transport.submit(
            SubmitRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=SamplingParams(),
                stopping=stopping,
            )
        )
        request_ids.append(request_id)
    return request_ids


def run_through_redis(
    transport: ApiTransport, client: redis.Redis, workload: Workload, tag: str
) -> dict[str, float]:
    latencies: list[float] = []
    num_tokens: list[int] = []
    calls_before = total_calls(client)
    start = time.perf_counter()
    request_ids = submit(transport, workload, tag)
    readers = [
        threading.Thread(target=lambda r=r: num_tokens.append(follow(transport, r, latencies)))
        for r in request_ids
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    seconds = time.perf_counter() - start
    generated = sum(num_tokens)
    for request_id, (_, num_out) in zip(request_ids, workload, strict=True):
        final = transport.read_final(request_id)
        if final is None or len(final.token_ids) != num_out:
            raise RuntimeError(f"{request_id}: expected {num_out} tokens, got {final}")
    if generated != sum(num_out for _, num_out in workload):
        raise RuntimeError(f"the readers saw {generated} tokens; the final results hold more")
    latencies.sort()
    return {
        "tok_s": generated / seconds,
        "publish_latency_p50_ms": 1e3 * percentile(latencies, 0.5),
        "publish_latency_p99_ms": 1e3 * percentile(latencies, 0.99),
        "redis_commands_per_token": (total_calls(client) - calls_before) / generated,
    }


def total_calls(client: redis.Redis) -> int:
    stats: Any = client.info("commandstats")
    return sum(int(entry["calls"]) for entry in stats.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs each way, best kept")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = medium_llama_4k(args.cache)
    workload = random_workload(args.requests, (32, 512), (16, 256), seed=1)
    offline = TgqOffline(model_dir, num_blocks=NUM_BLOCKS)
    offline.run(random_workload(4, (32, 64), (4, 4), seed=2))  # warm-up
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(args.redis_url)
    transport = BlockingApiTransport.from_url(args.redis_url, prefix)
    process = start_batcher(model_dir, args.redis_url, prefix)
    offline_runs, redis_runs = [], []
    try:
        wait_until_live(transport, process)
        warm_up = random_workload(4, (32, 64), (4, 4), seed=2)
        for request_id in submit(transport, warm_up, "warm"):
            follow(transport, request_id, [])
        for repeat in range(args.repeats):  # in turns, so a slow phase hits both alike
            offline_runs.append(offline.run(workload)["tok_s"])
            redis_runs.append(run_through_redis(transport, client, workload, f"run{repeat}"))
    finally:
        process.terminate()
        process.wait(timeout=60)
        transport.close()
        client.close()
        delete_keys(args.redis_url, prefix)
    results: dict[str, Any] = {"offline_tok_s": max(offline_runs)}
    results |= max(redis_runs, key=lambda run: run["tok_s"])
    results["redis_over_offline"] = results["tok_s"] / results["offline_tok_s"]
    report(results, args)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    write_results("transport", args, results)
    rows = [
        ("offline engine, tok/s", results["offline_tok_s"], ".1f"),
        ("through Redis + batcher process, tok/s", results["tok_s"], ".1f"),
        ("Redis / offline", results["redis_over_offline"], ".3f"),
        ("publish latency p50, ms", results["publish_latency_p50_ms"], ".2f"),
        ("publish latency p99, ms", results["publish_latency_p99_ms"], ".2f"),
        ("Redis commands per generated token", results["redis_commands_per_token"], ".2f"),
    ]
    print(f"{'metric':<44}{'value':>12}")
    for name, value, fmt in rows:
        print(f"{name:<44}{value:>12{fmt}}")


if __name__ == "__main__":
    main()
