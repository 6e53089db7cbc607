"""Serving overhead benchmark: what `tgq serve` adds over tgq's offline engine, per serving mode,
with the engine baseline measured in the same run, next to each mode's HTTP figures.

Medium Llama shape (random bf16 weights) whose vocabulary is a tokenizer trained on Python's
bundled docs, with a ChatML-like chat template (`bench.harness.chat_llama`, the model
bench_http serves); CPU. The offline engine (this process) and the served batcher get the same
weights, the same KV cache (`NUM_BLOCKS` x `BLOCK_SIZE`) and `--threads` torch threads
(`OMP_NUM_THREADS`: `THREADS_PER_RANK` only reaches tensor-parallel ranks). Modes, each a fresh
`tgq serve` on a free port (started, healthy, then stopped with SIGTERM and waited for):
- `embedded`: no DATABASE_URL/REDIS_URL: SQLite, the batcher on a thread of the api process;
- `services`: DATABASE_URL (a Postgres database created for the run) and REDIS_URL (a prefix of
  its own): api, batcher and Celery worker as child processes.

Per mode, in this order:
1. batch-1 decode step, offline (`OfflineEngine` over this process's `ModelRunner`), as
   bench_engine measures it: (time of N2 new tokens - time of N1) / (N2 - N1), on the stream's
   prompt (cached by a warm-up, so prefill cancels out); N2 is the stream's length by default,
   so the context spans the same lengths as the stream's;
2. one stream: a `--prompt-tokens` prompt, `--new-tokens` new tokens (`ignore_eos`,
   temperature 0), streaming `/v1/completions`; ITL = gaps between consecutive content chunks,
   TTFT = sent -> first content chunk. Steps 1 and 2 alternate `--repeats` times, fresh prompt
   text per repeat; the step is the fastest sample, ITL p50 and TTFT the fastest repeat's
   (interference only adds time), ITL p99 over all repeats;
3. the mixed workload (bench_http's: prompts uniform in 32..512 tokens, outputs 16..256, EOS
   ignored, as chat messages): the offline engine on the exact rendered prompt ids
   (`harness.run_offline`), then the same requests as streaming `/v1/chat/completions`, all
   sent at once; tokens/s = completion tokens / (last request done - t0), on both sides. In
   turns `--repeats` times, fresh prompt texts per repeat (no prefix-cache replay), best kept;
4. a server restarted with `--max-concurrent-requests 4`: one asyncio client opens and warms
   `--overload-requests` connections, then sends as many `--overload-tokens`-token completions
   at once (burst): all but 4 must be 429 with `Retry-After`; once the 4 admitted have streamed
   their first token, the rejected connections send again (during decode). Latency of a 429 =
   sent -> its whole answer read.

Also the CPU seconds of the server's processes during the mixed run. Prints one summary table,
writes JSON and a PNG (ITL CDFs per mode, ratio bars, 429 latency CDFs) to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
import torch
from tokenizers import Tokenizer

from bench.harness import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    RESULTS,
    ChatCase,
    Trace,
    chat_cases,
    chat_llama,
    longest_prefix,
    percentile,
    pyplot,
    run_offline,
    save_figure,
    sse_chunks,
    tokens_per_second,
    write_results,
)
from tests.api.stack import (
    create_database,
    delete_keys,
    drop_database,
    free_port,
    process_env,
    stop_process,
    wait_healthy,
)
from tgq.batcher.offline import OfflineEngine
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

MODEL_ID = "tgq-bench"
MODES = ("embedded", "services")
MAX_ADMITTED = 4  # --max-concurrent-requests of the overload server
TARGET_ITL_RATIO = 1.15
TARGET_TOK_RATIO = 0.90
TARGET_429_P99_MS = 50.0
QUICK = {"repeats": 1, "num_mixed": 8, "new_tokens": 32, "overload_tokens": 32}


# --- servers -----------------------------------------------------------------------------------


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def serving(
    mode: str, model_dir: Path, args: argparse.Namespace, flags: Sequence[str] = ()
) -> Iterator[Server]:
    """`tgq serve` in `mode`, healthy, in a folder of its own (the SQLite file, uploads and the
    beat schedule are relative to it); stopped with SIGTERM after the block."""
    run_dir = args.cache / "serving" / f"{mode}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True)
    port, prefix = free_port(), f"bench-{uuid.uuid4().hex[:8]}"
    settings = {
        "MODEL_ID": MODEL_ID, "MODEL_DIR": str(model_dir.resolve()), "HOSTNAME": "127.0.0.1",
        "PORT": str(port), "NUM_BLOCKS": str(NUM_BLOCKS), "BLOCK_SIZE": str(BLOCK_SIZE),
        "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    database_url = create_database() if mode == "services" else None
    if database_url is not None:
        settings |= {"DATABASE_URL": database_url, "REDIS_URL": args.redis_url}
        settings |= {"REDIS_PREFIX": prefix}
    log = run_dir / "serve.log"
    command = [sys.executable, "-m", "tgq.cli", "serve", *flags]
    try:
        with log.open("wb") as out:
            process = subprocess.Popen(
                command, cwd=run_dir, env=process_env(**settings), stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            wait_healthy(f"http://127.0.0.1:{port}", process, log, args.start_timeout_s)
            yield Server(f"http://127.0.0.1:{port}", process)
        finally:
            stop_process(process, 60)  # past `tgq serve`'s own 45 s for its children
    finally:
        if database_url is not None:
            delete_keys(args.redis_url, prefix)
            drop_database(database_url)


def tree_cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU seconds so far of `pid` and its descendants (Linux /proc), by the
    module each runs (`cli`: `tgq serve` itself; `api`, `batcher`, `celery`)."""
    found: dict[str, float] = {}
    todo = [pid]
    while todo:
        child = todo.pop()
        with contextlib.suppress(OSError):  # a process gone meanwhile
            proc = Path(f"/proc/{child}")
            todo += [int(p) for p in (proc / f"task/{child}/children").read_text().split()]
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            role = argv[2].decode().removeprefix("tgq.") if argv[1:2] == [b"-m"] else "other"
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            found[role] = found.get(role, 0.0) + seconds
    return found


# --- the HTTP client ---------------------------------------------------------------------------


def client_session(url: str, connections: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=connections)
    return aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(600))


async def stream(
    session: aiohttp.ClientSession, path: str, body: dict[str, Any], num_prompt_tokens: int
) -> Trace:
    """One streaming request to the end: its content chunks' arrival times."""
    body = body | {"model": MODEL_ID, "stream": True, "temperature": 0, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}
    trace = Trace(time.perf_counter())
    async with session.post(path, json=body) as response:
        async for chunk in sse_chunks(response, path):
            choices = chunk["choices"]
            if any(c.get("text") or c.get("delta", {}).get("content") for c in choices):
                trace.content_times.append(time.perf_counter())
            if usage := chunk.get("usage"):
                trace.num_tokens = usage["completion_tokens"]
                if usage["prompt_tokens"] != num_prompt_tokens:
                    raise RuntimeError(f"the api's prompt has {usage['prompt_tokens']} tokens")
    trace.end = time.perf_counter()
    return trace


def completion_prompt(tokenizer: Tokenizer, num_tokens: int, seed: int) -> tuple[str, list[int]]:
    """A text of at most `num_tokens` tokens as the api tokenizes a completion's prompt, and
    those ids."""
    rng = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, tokenizer.get_vocab_size(), (2 * num_tokens,), generator=rng).tolist()
    long_text = tokenizer.decode(ids, skip_special_tokens=True)
    text = longest_prefix(long_text, lambda t: len(tokenizer.encode(t).ids), num_tokens)
    return text, tokenizer.encode(text).ids


# --- measurements ------------------------------------------------------------------------------


def decode_step_s(engine: OfflineEngine, prompt_ids: list[int], n1: int, n2: int) -> float:
    def seconds(num_new: int) -> float:
        start = time.perf_counter()
        engine.generate([prompt_ids], max_new_tokens=num_new)
        return time.perf_counter() - start

    return (seconds(n2) - seconds(n1)) / (n2 - n1)


def single_stream(
    server: Server, engine: OfflineEngine, tokenizer: Tokenizer, args: argparse.Namespace
) -> dict[str, Any]:
    """Offline step samples and HTTP streams, in turns (see the module docstring)."""
    steps, itl_p50s, ttfts, itls = [], [], [], []
    for repeat in range(args.repeats):
        text, prompt_ids = completion_prompt(tokenizer, args.prompt_tokens, 1000 + repeat)
        engine.generate([prompt_ids], max_new_tokens=args.n1)  # caches the prompt
        steps.append(1e3 * decode_step_s(engine, prompt_ids, args.n1, args.new_tokens))
        body = {"prompt": text, "max_tokens": args.new_tokens}
        trace = asyncio.run(one_stream(server.url, body, len(prompt_ids)))
        gaps = sorted(1e3 * (b - a) for a, b in pairwise(trace.content_times))
        itl_p50s.append(percentile(gaps, 0.5))
        ttfts.append(1e3 * (trace.content_times[0] - trace.start))
        itls += gaps
    step_ms, itls = min(steps), sorted(itls)
    return {
        "step_ms": step_ms, "step_samples_ms": steps, "itl_p50_ms": min(itl_p50s),
        "itl_p99_ms": percentile(itls, 0.99), "itl_over_step": min(itl_p50s) / step_ms,
        "ttft_ms": min(ttfts), "itl_ms": itls,
    }  # fmt: skip


async def one_stream(url: str, body: dict[str, Any], num_prompt_tokens: int) -> Trace:
    async with client_session(url, 1) as session:
        return await stream(session, "/v1/completions", body, num_prompt_tokens)


async def http_mixed(url: str, cases: list[ChatCase]) -> float:
    """Tokens/s of the cases as streaming chats, all sent at once."""
    async with client_session(url, len(cases)) as session:
        start = time.perf_counter()
        bodies = [
            {"messages": [{"role": "user", "content": c.content}], "max_tokens": c.num_out}
            for c in cases
        ]
        traces = await asyncio.gather(
            *(stream(session, "/v1/chat/completions", body, len(case.prompt_ids))
              for body, case in zip(bodies, cases, strict=True))
        )  # fmt: skip
    for trace in traces:
        trace.start = start
    return tokens_per_second(start, list(traces), cases)


def mixed(
    server: Server, runner: ModelRunner, model_dir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """Offline and HTTP in turns, `--repeats` times, fresh prompt texts (same lengths) per
    repeat so that neither replays its prefix cache; the best of each is kept."""
    offline, http, cpu_s = [], [], {}
    for repeat in range(args.repeats):
        cases = chat_cases(model_dir, args.num_mixed, 1, repeat)  # bench_http's workload
        offline.append(run_offline(runner, model_dir, cases).tok_s)
        before = tree_cpu_seconds(server.process.pid)
        http.append(asyncio.run(http_mixed(server.url, cases)))
        after = tree_cpu_seconds(server.process.pid)
        if http[-1] == max(http):
            cpu_s = {role: seconds - before.get(role, 0.0) for role, seconds in after.items()}
    return {
        "tok_s": max(http), "offline_tok_s": max(offline), "over_offline": max(http) / max(offline),
        "cpu_s": cpu_s, "all_tok_s": http, "all_offline_tok_s": offline,
    }  # fmt: skip


@dataclass
class Answer:
    status: int
    ms: float  # sent -> whole answer (not 200), or -> headers (200)
    has_retry_after: bool
    stream: asyncio.Task[int] | None = None  # a 200's: the number of its content chunks
    first_token: asyncio.Event = field(default_factory=asyncio.Event)


async def ask(session: aiohttp.ClientSession, body: dict[str, Any]) -> Answer:
    sent = time.perf_counter()
    response = await session.post("/v1/completions", json=body)
    if response.status != 200:
        await response.read()
        ms = 1e3 * (time.perf_counter() - sent)
        response.release()
        return Answer(response.status, ms, "Retry-After" in response.headers)
    answer = Answer(200, 1e3 * (time.perf_counter() - sent), False)

    async def read() -> int:
        num_chunks = 0
        async with response:
            async for chunk in sse_chunks(response, "overload"):
                choices = chunk.get("choices", [])
                if any(choice["text"] for choice in choices):
                    num_chunks += 1
                    answer.first_token.set()
        return num_chunks

    answer.stream = asyncio.create_task(read())
    return answer


async def overload(url: str, text: str, args: argparse.Namespace) -> dict[str, Any]:
    """The burst, then the rejected connections again while the admitted requests decode."""
    body = {"model": MODEL_ID, "prompt": text, "max_tokens": args.overload_tokens}
    body |= {"stream": True, "temperature": 0, "ignore_eos": True}
    count = args.overload_requests
    async with client_session(url, count) as session:

        async def warm() -> None:
            async with session.get("/v1/models") as response:
                await response.read()

        await asyncio.gather(*(warm() for _ in range(count)))  # `count` connections, now idle
        burst = await asyncio.gather(*(ask(session, body) for _ in range(count)))
        admitted = [answer for answer in burst if answer.stream is not None]
        first_tokens = asyncio.gather(*(answer.first_token.wait() for answer in admitted))
        await asyncio.wait_for(first_tokens, 600)
        rejected = [answer for answer in burst if answer.stream is None]
        decoding = await asyncio.gather(*(ask(session, body) for _ in rejected))
        streams = [a.stream for a in (*admitted, *decoding) if a.stream is not None]
        num_chunks = await asyncio.gather(*streams)
    return {"burst": rejections(burst), "during_decode": rejections(decoding)} | {
        "num_admitted": len(streams),
        "admitted_chunks": list(num_chunks),
    }


def rejections(answers: Sequence[Answer]) -> dict[str, Any]:
    ms = sorted(a.ms for a in answers if a.status == 429)
    return {
        "num_sent": len(answers), "num_429": len(ms),
        "num_429_retry_after": sum(a.status == 429 and a.has_retry_after for a in answers),
        "p50_ms": percentile(ms, 0.5), "p99_ms": percentile(ms, 0.99), "ms": ms,
    }  # fmt: skip


# --- one mode ----------------------------------------------------------------------------------


def measure_mode(
    mode: str, runner: ModelRunner, model_dir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    engine = OfflineEngine(runner)
    warm_up = chat_cases(model_dir, 4, 2, 99)
    found: dict[str, Any] = {"load_avg": os.getloadavg()[0]}  # this noisy machine's, at start
    with serving(mode, model_dir, args) as server:
        asyncio.run(http_mixed(server.url, warm_up))
        found["stream"] = single_stream(server, engine, tokenizer, args)
        found["mixed"] = mixed(server, runner, model_dir, args)
    text, _ = completion_prompt(tokenizer, args.prompt_tokens, 2000)
    flags = ("--max-concurrent-requests", str(MAX_ADMITTED))
    with serving(mode, model_dir, args, flags) as server:
        found["overload"] = asyncio.run(overload(server.url, text, args))
    return found


# --- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench-http"))
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256, help="the stream's; step's N2")
    parser.add_argument("--n1", type=int, default=8, help="the step's N1")
    parser.add_argument("--repeats", type=int, default=3, help="runs of steps 1-3, in turns")
    parser.add_argument("--num-mixed", type=int, default=64)
    parser.add_argument("--overload-requests", type=int, default=40)
    parser.add_argument("--overload-tokens", type=int, default=200)
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    if "--quick" in sys.argv[1:]:  # new defaults: flags given still win
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    began = time.perf_counter()
    torch.set_num_threads(args.threads)
    model_dir = chat_llama(args.cache, "medium")
    runner = ModelRunner(RunnerConfig(str(model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
    run_offline(runner, model_dir, chat_cases(model_dir, 4, 2, 99))  # warm-up
    results: dict[str, Any] = {m: measure_mode(m, runner, model_dir, args) for m in args.modes}
    results["seconds"] = time.perf_counter() - began
    write_results("serving", args, results, runner)
    plot(results, args, RESULTS / "serving.png")
    report(results, args)


def plot(results: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for mode in args.modes:
        for ax, values in (
            (axes[0], results[mode]["stream"]["itl_ms"]),
            (axes[2], results[mode]["overload"]["burst"]["ms"]),
        ):
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=mode)
    step = min(results[m]["stream"]["step_ms"] for m in args.modes)
    axes[0].axvline(step, color="#999999", linestyle="--", label="offline step")
    ratios = {f"{m}\nITL/step": results[m]["stream"]["itl_over_step"] for m in args.modes} | {
        f"{m}\ntok/s ratio": results[m]["mixed"]["over_offline"] for m in args.modes
    }
    bars = axes[1].bar(list(ratios), list(ratios.values()), color="#1f77b4")
    axes[1].bar_label(bars, fmt="%.2f", fontsize=8)
    axes[1].axhline(TARGET_ITL_RATIO, color="#d62728", linestyle=":", linewidth=1)
    axes[1].axhline(TARGET_TOK_RATIO, color="#2ca02c", linestyle=":", linewidth=1)
    titles = ("one stream: ITL (ms)", "HTTP / offline", "429 latency, burst (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in (axes[0], axes[2]):
        ax.set_ylabel("fraction", fontsize=8)
        ax.legend(fontsize=7)
    title = (
        f"tgq serve vs offline engine, medium Llama bf16, CPU {args.threads} threads "
        f"(goals: ITL/step <= {TARGET_ITL_RATIO}, tok/s >= {TARGET_TOK_RATIO})"
    )
    save_figure(fig, title, path)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    def goal(met: bool, text: str) -> str:
        return f"{text}: {'met' if met else 'missed'}"

    rows: list[tuple[str, ...]] = []

    def row(name: str, values: Sequence[str], note: str = "") -> None:
        rows.append((name, *values, note))

    modes = [results[m] for m in args.modes]
    streams, mixes, over = ([m[k] for m in modes] for k in ("stream", "mixed", "overload"))
    itl_ratio = max(s["itl_over_step"] for s in streams)
    tok_ratio = min(m["over_offline"] for m in mixes)
    p99_429 = max(o[w]["p99_ms"] for o in over for w in ("burst", "during_decode"))
    row(
        "engine batch-1 step, ms (offline)",
        [f"{s['step_ms']:.1f}" for s in streams],
        f"N1={args.n1}, N2={args.new_tokens}, best of {args.repeats}",
    )
    row(
        "ITL p50 / p99, ms",
        [f"{s['itl_p50_ms']:.1f} / {s['itl_p99_ms']:.1f}" for s in streams],
        f"{args.prompt_tokens}-token prompt, {args.new_tokens} new",
    )
    row(
        "ITL p50 / step",
        [f"{s['itl_over_step']:.3f}" for s in streams],
        goal(itl_ratio <= TARGET_ITL_RATIO, f"<= {TARGET_ITL_RATIO}"),
    )
    row("TTFT, ms", [f"{s['ttft_ms']:.1f}" for s in streams])
    row(f"{args.num_mixed} mixed: HTTP tok/s", [f"{m['tok_s']:.1f}" for m in mixes])
    row(
        "  offline tok/s",
        [f"{m['offline_tok_s']:.1f}" for m in mixes],
        f"same prompts; best of {args.repeats} each",
    )
    row(
        "  HTTP / offline",
        [f"{m['over_offline']:.3f}" for m in mixes],
        goal(tok_ratio >= TARGET_TOK_RATIO, f">= {TARGET_TOK_RATIO}"),
    )
    row("  CPU s: api / batcher / celery", [
        "/".join(f"{m['cpu_s'].get(r, 0):.0f}" for r in ("api", "batcher", "celery"))
        for m in mixes
    ], "embedded: the api runs the batcher")  # fmt: skip
    for wave, label in (("burst", "429 burst"), ("during_decode", "429 during decode")):
        row(f"{label} p50 / p99, ms",
            [f"{o[wave]['p50_ms']:.1f} / {o[wave]['p99_ms']:.1f}" for o in over],
            goal(p99_429 < TARGET_429_P99_MS, f"p99 < {TARGET_429_P99_MS:.0f}")
            if wave == "burst" else "")  # fmt: skip
        row(
            "  429s with Retry-After / sent",
            [f"{o[wave]['num_429_retry_after']} / {o[wave]['num_sent']}" for o in over],
            f"expected {args.overload_requests - MAX_ADMITTED}" if wave == "burst" else "",
        )
    row(
        "machine load (1-min avg) at start",
        [f"{m['load_avg']:.1f}" for m in modes],
        f"{os.cpu_count()} CPUs",
    )
    print(f"{'metric':<36}" + "".join(f"{m:>18}" for m in args.modes) + "  goal")
    for name, *values, note in rows:
        print(f"{name:<36}" + "".join(f"{v:>18}" for v in values) + f"  {note}")
    print(f"(medium model, {args.threads} threads, {results['seconds']:.0f} s in all)")


if __name__ == "__main__":
    main()
