"""HTTP benchmark: the mixed workload as streaming chat completions through the api process,
Redis and a batcher process, against the offline engine on the same prompts, in the same run.

Medium Llama shape (random bf16 weights) whose vocabulary is a tokenizer trained on Python's
bundled docs, with a ChatML-like chat template; CPU; the batcher and the offline engine get
`--threads` torch threads. The 64 mixed requests (prompts uniform in 32..512 tokens, outputs
uniform in 16..256, EOS ignored) become one user message each, whose rendered chat prompt has
about the target length; the offline engine gets the exact token ids of that rendered prompt.
All requests start at once: the offline engine has all of them added at t0, the HTTP client
sends them concurrently (`stream: true`, `temperature: 0`, `ignore_eos: true`). Offline and HTTP
runs alternate `--repeats` times, with fresh prompt texts per repeat (same lengths), so neither
side replays its prefix cache; the best run of each is kept.

Metrics, the same on both sides (offline: wall-clock times of the engine's step outputs; a
"content event" is an output carrying text, which is exactly what the api streams as a chunk):
- tokens/s: completion tokens of all requests / (last request done - t0);
- TTFT: request sent -> first content token received;
- sent -> first step: request sent -> end of the engine step that made its first token (HTTP:
  that token event's `created_at`, read back from Redis; one machine, one clock): the part of
  TTFT spent before the token exists (api, queue, admission, prefill);
- TPOT: (E2E - TTFT) / (completion tokens - 1), per request;
- ITL: gaps between consecutive content chunks, over all requests;
- E2E: request sent -> stream done.

Then, with the same api process:
- POST -> first scheduled step: jobs of a short prompt and 1 new token, sent one by one at
  `--first-step-rate`/s to the idle batcher; the latency is the first token event's `created_at`
  (unix time the engine step that made it finished) minus the time just before the POST. It
  includes the prefill step of that short prompt; the offline column shows that step alone
  (the offline engine, same prompts, one at a time), so the difference is what the api, the
  database commit, Redis and the batcher loop add.
- jobs accepted/s with the engine idle: the batcher is stopped (nothing consumes), then
  `--num-jobs` single-prompt `POST /v1/jobs` from `--job-connections` concurrent connections of
  one asyncio client. The client, the api, Postgres and Redis share this machine's cores; the
  CPU seconds of the client and of the api process are reported next to the rate.

Prints one summary table, writes JSON and a PNG (CDFs of TTFT and ITL) to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import torch
from tokenizers import Tokenizer

from bench.harness import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    RESULTS,
    ChatCase,
    Run,
    Trace,
    bench_stack,
    chat_cases,
    chat_llama,
    percentile,
    pyplot,
    run_offline,
    save_figure,
    sse_chunks,
    tokens_per_second,
    write_results,
)
from tests.api.stack import Stack, migrated_database, running, stop_process
from tgq.api.ids import request_id_of
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine
from tgq.batcher.request import StoppingParams
from tgq.batcher.transport.aio import AsyncRedisApiTransport
from tgq.batcher.transport.blocking import BlockingApiTransport
from tgq.devtools.random_model import SHAPES
from tgq.gpu_worker.config import model_eos_token_ids
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

TARGET_RATIO = 0.90
TARGET_JOBS_S = 500.0
FIRST_STEP_PROMPT = "first step {}"


async def stream_chat(session: aiohttp.ClientSession, case: ChatCase, trace: Trace) -> None:
    body = {
        "model": "tgq-bench",
        "messages": [{"role": "user", "content": case.content}],
        "stream": True,
        "temperature": 0,
        "max_tokens": case.num_out,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post("/v1/chat/completions", json=body) as response:
        async for chunk in sse_chunks(response, "chat"):
            trace.job_id = chunk["id"].removeprefix("chatcmpl-")
            if any(choice["delta"].get("content") for choice in chunk["choices"]):
                trace.content_times.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
                trace.num_tokens = usage["completion_tokens"]
                if usage["prompt_tokens"] != len(case.prompt_ids):
                    raise RuntimeError(f"the api's prompt has {usage['prompt_tokens']} tokens")
    trace.end = time.perf_counter()


async def run_http(stack: Stack, cases: list[ChatCase]) -> Run:
    cpu = stack_cpu_seconds(stack)
    async with client_session(stack.url, len(cases)) as session:
        start, start_unix = time.perf_counter(), time.time()
        traces = [Trace(start) for _ in cases]
        await asyncio.gather(
            *(stream_chat(session, c, t) for c, t in zip(cases, traces, strict=True))
        )
    wall = time.perf_counter() - start
    cpu_s = {name: seconds - cpu[name] for name, seconds in stack_cpu_seconds(stack).items()}
    assert stack.redis_url is not None
    transport = AsyncRedisApiTransport.from_url(stack.redis_url, stack.prefix)
    step_times = []
    for trace in traces:  # the engine's clock for the first token, on the client's time base
        events = await transport.read_tokens(request_id_of(trace.job_id, 0), 0, 0)
        trace.first_step = start + (events[0].created_at - start_unix)
        step_times += [event.created_at for event in events if event.token_ids]
    await transport.close()
    step_times.sort()  # one step's events are stamped within a ms; steps are >= ms apart
    num_token_steps = 1 + sum(later - earlier > 2e-3 for earlier, later in pairwise(step_times))
    tok_s = tokens_per_second(start, traces, cases)
    return Run(tok_s, traces, cpu_s | {"wall": wall}, num_token_steps)


def latencies(traces: list[Trace]) -> dict[str, list[float]]:
    """Sorted latencies in ms: TTFT, TPOT and E2E per request, ITL per pair of chunks."""
    found: dict[str, list[float]] = {n: [] for n in ("ttft", "first_step", "tpot", "itl", "e2e")}
    for trace in traces:
        times = trace.content_times
        e2e = trace.end - trace.start
        found["e2e"].append(1e3 * e2e)
        found["first_step"].append(1e3 * (trace.first_step - trace.start))
        found["itl"] += [1e3 * (later - earlier) for earlier, later in pairwise(times)]
        if times:
            ttft = times[0] - trace.start
            found["ttft"].append(1e3 * ttft)
            found["tpot"].append(1e3 * (e2e - ttft) / max(1, trace.num_tokens - 1))
    return {name: sorted(values) for name, values in found.items()}


def summary(values: dict[str, list[float]]) -> dict[str, float]:
    return {
        f"{name}_p{round(100 * q)}_ms": percentile(sorted_values, q)
        for name, sorted_values in values.items()
        for q in (0.5, 0.9, 0.99)
    }


# --- the stack ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stack_cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU seconds so far of the batcher, the api and this process (the client)."""
    (batcher,) = stack.batchers
    assert stack.api is not None
    return {
        "batcher": cpu_seconds(batcher.pid),
        "api": cpu_seconds(stack.api.pid),
        "client": time.process_time(),
    }


# --- jobs --------------------------------------------------------------------------------------


def first_step_latency(stack: Stack, num_jobs: int, rate: float) -> list[float]:
    """POST -> first scheduled step, ms, sorted (see the module docstring)."""
    assert stack.redis_url is not None
    transport = BlockingApiTransport.from_url(stack.redis_url, stack.prefix)
    latencies_ms = []
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        next_at = time.monotonic()
        for i in range(num_jobs):
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += 1 / rate
            body = {"prompt": FIRST_STEP_PROMPT.format(i), "parameters": {"max_new_tokens": 1}}
            sent = time.time()
            response = client.post("/v1/jobs", json=body)
            if response.status_code != 202:
                raise RuntimeError(f"POST /v1/jobs: {response.status_code} {response.text}")
            events = transport.read_tokens(response.json()["request_ids"][0], 0, 30.0)
            if not events:
                raise RuntimeError("no token event within 30 s")
            latencies_ms.append(1e3 * (events[0].created_at - sent))
    transport.close()
    return sorted(latencies_ms)


def prefill_alone(runner: ModelRunner, model_dir: Path, num_jobs: int) -> list[float]:
    """The offline engine's one step for `first_step_latency`'s prompts, ms, sorted: the part of
    POST -> first step that is not the api, Redis or the batcher loop."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    engine = LLMEngine(runner, SchedulerConfig(), None, model_eos_token_ids(model_dir))
    stopping = StoppingParams(max_new_tokens=1, ignore_eos=True)
    step_ms = []
    for i in range(num_jobs):
        prompt_ids = tokenizer.encode(FIRST_STEP_PROMPT.format(i)).ids
        start = time.perf_counter()
        engine.add_request(prompt_ids, stopping=stopping)
        while engine.has_unfinished:
            engine.step()
        step_ms.append(1e3 * (time.perf_counter() - start))
    return sorted(step_ms)


async def accept_jobs(stack: Stack, num_jobs: int, connections: int) -> dict[str, float]:
    """Jobs accepted per second with nothing consuming them, and the POST latency."""
    assert stack.api is not None
    post_ms: list[float] = []
    async with client_session(stack.url, connections) as session:

        async def post(todo: Iterator[int]) -> None:
            for i in todo:
                body = {"prompt": f"job {i}: say hello", "parameters": {"max_new_tokens": 8}}
                sent = time.perf_counter()
                async with session.post("/v1/jobs", json=body) as response:
                    answer = await response.read()
                post_ms.append(1e3 * (time.perf_counter() - sent))
                if response.status != 202:
                    raise RuntimeError(f"POST /v1/jobs: {response.status} {answer!r}")

        warm_up = iter(range(connections))  # opens every connection
        await asyncio.gather(*(post(warm_up) for _ in range(connections)))
        post_ms.clear()
        todo = iter(range(num_jobs))
        api_cpu, client_cpu = cpu_seconds(stack.api.pid), time.process_time()
        machine = machine_cpu()
        start = time.perf_counter()
        await asyncio.gather(*(post(todo) for _ in range(connections)))
        seconds = time.perf_counter() - start
        machine_total, machine_idle = (b - a for a, b in zip(machine, machine_cpu(), strict=True))
    post_ms.sort()
    return {
        "jobs_per_s": num_jobs / seconds,
        "post_p50_ms": percentile(post_ms, 0.5),
        "post_p99_ms": percentile(post_ms, 0.99),
        "seconds": seconds,
        "api_cpu_s": cpu_seconds(stack.api.pid) - api_cpu,
        "client_cpu_s": time.process_time() - client_cpu,
        "machine_busy": 1 - machine_idle / machine_total,
    }


def machine_cpu() -> tuple[int, int]:
    """(all, idle + iowait) CPU ticks of the machine since boot (Linux /proc/stat)."""
    ticks = [int(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(ticks), ticks[3] + ticks[4]


def client_session(url: str, connections: int) -> aiohttp.ClientSession:
    """aiohttp rather than httpx: httpx's async client spent ~4 ms of CPU per POST here, on
    cores it shares with the api; aiohttp ~0.2 ms."""
    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=600)
    return aiohttp.ClientSession(url, connector=connector, timeout=timeout)


def jobs_results(
    stack: Stack, runner: ModelRunner, model_dir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """POST -> first step (and the offline prefill alone), then jobs accepted/s with the engine
    idle: the batcher is stopped, nothing consumes the jobs."""
    first_step = first_step_latency(stack, args.first_step_jobs, args.first_step_rate)
    alone = prefill_alone(runner, model_dir, args.first_step_jobs)
    stop_process(stack.batchers[0])
    return {
        "first_step": {
            "p50_ms": percentile(first_step, 0.5),
            "p99_ms": percentile(first_step, 0.99),
            "prefill_alone_p50_ms": percentile(alone, 0.5),
            "prefill_alone_p99_ms": percentile(alone, 0.99),
        },
        "jobs": asyncio.run(accept_jobs(stack, args.num_jobs, args.job_connections)),
    }


# --- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench-http"))
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="medium")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs each way, best kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batcher-threads", type=int, help="default: --threads")
    parser.add_argument("--num-jobs", type=int, default=2000)
    parser.add_argument("--job-connections", type=int, default=32)
    parser.add_argument("--first-step-jobs", type=int, default=200)
    parser.add_argument("--first-step-rate", type=float, default=20.0, help="jobs/s")
    parser.add_argument("--skip-jobs", action="store_true", help="chat streams only")
    args = parser.parse_args()
    began = time.perf_counter()
    torch.set_num_threads(args.threads)
    model_dir = chat_llama(args.cache, args.model_shape)
    workloads = [chat_cases(model_dir, args.num_requests, 1, r) for r in range(args.repeats)]
    warm_up = chat_cases(model_dir, 4, 2, 99)
    runner = ModelRunner(RunnerConfig(str(model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
    run_offline(runner, model_dir, warm_up)
    offline_runs, http_runs = [], []
    results: dict[str, Any] = {}
    with migrated_database() as database_url:
        threads, max_queued = args.batcher_threads or args.threads, max(4096, 2 * args.num_jobs)
        log_dir = args.cache / "logs"
        stack = bench_stack(model_dir, database_url, log_dir, args.redis_url, threads, max_queued)
        with running(stack, timeout_s=300):
            asyncio.run(run_http(stack, warm_up))
            for cases in workloads:  # in turns, so a slow phase hits both alike
                offline_runs.append(run_offline(runner, model_dir, cases))
                http_runs.append(asyncio.run(run_http(stack, cases)))
            if not args.skip_jobs:
                results |= jobs_results(stack, runner, model_dir, args)
    offline = max(offline_runs, key=lambda run: run.tok_s)
    http = max(http_runs, key=lambda run: run.tok_s)
    offline_latencies, http_latencies = latencies(offline.traces), latencies(http.traces)
    results |= {
        "offline": {"tok_s": offline.tok_s, **summary(offline_latencies), "cpu_s": offline.cpu_s},
        "http": {"tok_s": http.tok_s, **summary(http_latencies), "cpu_s": http.cpu_s},
        "http_over_offline": http.tok_s / offline.tok_s,
        "tokens_per_token_step": {
            "offline": sum(t.num_tokens for t in offline.traces) / offline.num_token_steps,
            "http": sum(t.num_tokens for t in http.traces) / http.num_token_steps,
        },
        "all_runs_tok_s": {
            "offline": [run.tok_s for run in offline_runs],
            "http": [run.tok_s for run in http_runs],
        },
        "seconds": time.perf_counter() - began,
    }
    title = (
        f"{args.num_requests} mixed streaming chats, {args.model_shape} Llama bf16, CPU "
        f"{args.threads} threads: HTTP + Redis + batcher vs offline engine"
    )
    plot(offline_latencies, http_latencies, title, RESULTS / "http-cpu.png")
    report(results, args)


def plot(
    offline: dict[str, list[float]], http: dict[str, list[float]], title: str, path: Path
) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, name in zip(axes, ("ttft", "itl"), strict=True):
        for label, values, color in (("offline", offline, "#999999"), ("HTTP", http, "#1f77b4")):
            points = values[name]
            ax.plot(
                points,
                [(i + 1) / len(points) for i in range(len(points))],
                label=label,
                color=color,
            )
        ax.set_xscale("log")
        ax.set_xlabel(f"{name.upper()} (ms)", fontsize=8)
        ax.set_ylabel("fraction", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=8)
    save_figure(fig, title, path)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    write_results("http-cpu", args, results)
    offline, http = results["offline"], results["http"]
    ratio = results["http_over_offline"]
    rows = [
        ("tokens/s", f"{offline['tok_s']:.1f}", f"{http['tok_s']:.1f}", ""),
        ("HTTP / offline", "", f"{ratio:.3f}", f"target >= {TARGET_RATIO:.2f}: "
         + ("met" if ratio >= TARGET_RATIO else "missed")),
    ]  # fmt: skip
    for name in ("ttft", "first_step", "tpot", "itl", "e2e"):
        for q in (50, 90, 99):
            key = f"{name}_p{q}_ms"
            label = "  sent -> first step" if name == "first_step" else name.upper()
            note = "engine clock: TTFT's queueing part" if key == "first_step_p50_ms" else ""
            rows.append((f"{label} p{q}, ms", f"{offline[key]:.1f}", f"{http[key]:.1f}", note))
    cpu_offline, cpu_http = offline["cpu_s"], http["cpu_s"]
    rows.append((
        "CPU s: engine | batcher/api/client", f"{cpu_offline['engine']:.0f}",
        f"{cpu_http['batcher']:.0f}/{cpu_http['api']:.0f}/{cpu_http['client']:.0f}",
        f"in {cpu_offline['wall']:.0f} s | {cpu_http['wall']:.0f} s",
    ))  # fmt: skip
    per_step = results["tokens_per_token_step"]
    rows.append(
        (
            "tokens per token-making step",
            f"{per_step['offline']:.1f}",
            f"{per_step['http']:.1f}",
            "",
        )
    )
    if "jobs" in results:
        jobs, first = results["jobs"], results["first_step"]
        met = "met" if jobs["jobs_per_s"] >= TARGET_JOBS_S else "missed"
        rows += [
            ("jobs accepted/s, engine idle", "", f"{jobs['jobs_per_s']:.0f}",
             f"target >= {TARGET_JOBS_S:.0f}: {met}"),
            ("  POST /v1/jobs p50 / p99, ms", "",
             f"{jobs['post_p50_ms']:.1f} / {jobs['post_p99_ms']:.1f}",
             f"{args.job_connections} connections"),
            ("  CPU s: api / client", "",
             f"{jobs['api_cpu_s']:.1f} / {jobs['client_cpu_s']:.1f}",
             f"in {jobs['seconds']:.1f} s; machine {jobs['machine_busy']:.0%} busy"),
            ("POST -> first step p50, ms", f"{first['prefill_alone_p50_ms']:.1f}",
             f"{first['p50_ms']:.1f}", "offline: that prefill step alone"),
            ("POST -> first step p99, ms", f"{first['prefill_alone_p99_ms']:.1f}",
             f"{first['p99_ms']:.1f}", ""),
        ]  # fmt: skip
    print(f"{'metric':<34}{'offline':>10}{'HTTP':>16}  note")
    for name, offline_value, http_value, note in rows:
        print(f"{name:<34}{offline_value:>10}{http_value:>16}  {note}")
    print(f"({args.model_shape} model, {args.threads} threads, {results['seconds']:.0f} s in all)")


if __name__ == "__main__":
    main()
