"""Batch benchmark: a 1,000-line batch (the mixed workload as chat completions) through the
Batches API end to end, against the offline engine on the same prompts, in the same run.

Medium Llama shape (random bf16 weights) whose vocabulary is a tokenizer trained on Python's
bundled docs (`bench_http`'s model and workload, from `bench/harness.py`: prompts uniform in
32..512 tokens, outputs uniform in 16..256, EOS ignored, greedy). The stack is the harness's
(a fresh Postgres database, Redis, the api process and one batcher process with `--threads`
torch threads) plus the batch runner: a Celery worker (`--runner celery`, the default with
Redis) or a task of the api process (`--runner api`).

- offline: every prompt added to the offline engine at t0 (it schedules them as the batcher
  does); tokens/s = completion tokens / (last request done - t0);
- batch: the JSONL of batch lines is uploaded (`POST /v1/files`), the batch created
  (`POST /v1/batches`) and polled every 0.25 s until it ends, then its output file downloaded;
  tokens/s = the output's `usage.completion_tokens` summed / (upload started -> output
  downloaded). The batch's time includes validation (tokenizing and committing every line),
  feeding the batcher through a window of `BATCH_WINDOW` requests, persisting every result and
  writing the output file.

The offline engine runs first, then the batch; `--repeats` alternates them more times and keeps
each one's best. Prints one summary, writes JSON and a PNG (lines done over time) to
bench/results/.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.harness import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    RESULTS,
    ChatCase,
    bench_stack,
    chat_cases,
    chat_llama,
    pyplot,
    run_offline,
    save_figure,
    write_results,
)
from tests.api.stack import Stack, migrated_database, running
from tgq.devtools.random_model import SHAPES
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

TARGET_RATIO = 0.90
POLL_S = 0.25
TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class BatchRun:
    tok_s: float
    seconds: float  # upload started -> output downloaded
    validating_s: float  # batch created -> in_progress
    first_line_s: float  # upload started -> first line completed
    progress: list[tuple[float, int]]  # (seconds since the upload started, lines completed)
    num_lines: int
    num_tokens: int


def batch_lines(cases: list[ChatCase]) -> bytes:
    rows = [
        {
            "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": case.content}],
                "max_tokens": case.num_out, "temperature": 0, "ignore_eos": True,
            },
        }
        for i, case in enumerate(cases)
    ]  # fmt: skip
    return "\n".join(json.dumps(row) for row in rows).encode()


def run_batch(stack: Stack, cases: list[ChatCase]) -> BatchRun:
    content = batch_lines(cases)
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        start = time.perf_counter()
        uploaded = client.post(
            "/v1/files", files={"file": ("bench.jsonl", content)}, data={"purpose": "batch"}
        )
        uploaded.raise_for_status()
        body = {
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        created = client.post("/v1/batches", json=body)
        created.raise_for_status()
        batch_id = created.json()["id"]
        progress: list[tuple[float, int]] = []
        while True:
            batch = client.get(f"/v1/batches/{batch_id}").json()
            progress.append((time.perf_counter() - start, batch["request_counts"]["completed"]))
            if batch["status"] in TERMINAL:
                break
            time.sleep(POLL_S)
        if batch["status"] != "completed" or batch["request_counts"]["failed"]:
            raise RuntimeError(f"the batch ended {batch['status']}: {batch['request_counts']}")
        output = client.get(f"/v1/files/{batch['output_file_id']}/content")
        output.raise_for_status()
        seconds = time.perf_counter() - start
    rows = [json.loads(row) for row in output.content.splitlines()]
    if sorted(row["custom_id"] for row in rows) != sorted(f"line-{i}" for i in range(len(cases))):
        raise RuntimeError("the output does not hold every line exactly once")
    num_tokens = sum(row["response"]["body"]["usage"]["completion_tokens"] for row in rows)
    if num_tokens != sum(case.num_out for case in cases):
        raise RuntimeError(f"{num_tokens} completion tokens, not the workload's")
    first_line_s = next(t for t, done in progress if done > 0)
    return BatchRun(
        tok_s=num_tokens / seconds,
        seconds=seconds,
        validating_s=batch["in_progress_at"] - batch["created_at"],
        first_line_s=first_line_s,
        progress=progress,
        num_lines=len(rows),
        num_tokens=num_tokens,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench-http"))
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="medium")
    parser.add_argument("--num-lines", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=1, help="runs each way, best kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runner", choices=["celery", "api"], default="celery")
    args = parser.parse_args()
    began = time.perf_counter()
    torch.set_num_threads(args.threads)
    model_dir = chat_llama(args.cache, args.model_shape)
    workloads = [chat_cases(model_dir, args.num_lines, 1, 1000 + r) for r in range(args.repeats)]
    runner = ModelRunner(RunnerConfig(str(model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
    run_offline(runner, model_dir, chat_cases(model_dir, 4, 2, 99))  # warm-up
    offline_runs, batch_runs = [], []
    with migrated_database() as database_url:
        log_dir = args.cache / "logs"
        stack = bench_stack(model_dir, database_url, log_dir, args.redis_url, args.threads, 4096)
        stack.api_env |= {
            "BATCH_RUNNER": args.runner,
            "FILE_STORAGE_DIR": str((args.cache / "files").resolve()),
            "MAX_FILE_LINES": str(max(50_000, args.num_lines)),
        }
        with running(stack, celery_worker=args.runner == "celery", timeout_s=300):
            for cases in workloads:  # in turns, so a slow phase hits both alike
                offline_runs.append(run_offline(runner, model_dir, cases))
                batch_runs.append(run_batch(stack, cases))
    offline = max(offline_runs, key=lambda run: run.tok_s)
    batch = max(batch_runs, key=lambda run: run.tok_s)
    offline_done = sorted(trace.end - trace.start for trace in offline.traces)
    results: dict[str, Any] = {
        "offline": {"tok_s": offline.tok_s, "seconds": offline_done[-1]},
        "batch": {
            "tok_s": batch.tok_s,
            "seconds": batch.seconds,
            "validating_s": batch.validating_s,
            "first_line_s": batch.first_line_s,
            "lines_per_s": batch.num_lines / batch.seconds,
            "num_tokens": batch.num_tokens,
        },
        "batch_over_offline": batch.tok_s / offline.tok_s,
        "all_runs_tok_s": {
            "offline": [run.tok_s for run in offline_runs],
            "batch": [run.tok_s for run in batch_runs],
        },
        "seconds": time.perf_counter() - began,
    }
    title = (
        f"{args.num_lines}-line batch, {args.model_shape} Llama bf16, CPU {args.threads} threads:"
        f" Batches API ({args.runner} runner) vs offline engine"
    )
    plot(offline_done, batch.progress, title, RESULTS / "batch-cpu.png")
    report(results, args)


def plot(
    offline_done: list[float], progress: list[tuple[float, int]], title: str, path: Path
) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.plot(offline_done, range(1, len(offline_done) + 1), label="offline engine", color="#999999")
    ax.plot([t for t, _ in progress], [n for _, n in progress], label="batch", color="#1f77b4")
    ax.set_xlabel("seconds", fontsize=8)
    ax.set_ylabel("lines done", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=8)
    save_figure(fig, title, path)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    write_results("batch-cpu", args, results)
    offline, batch, ratio = results["offline"], results["batch"], results["batch_over_offline"]
    met = "met" if ratio >= TARGET_RATIO else "missed"
    rows = [
        ("tokens/s", f"{offline['tok_s']:.1f}", f"{batch['tok_s']:.1f}", ""),
        ("batch / offline", "", f"{ratio:.3f}", f"target >= {TARGET_RATIO:.2f}: {met}"),
        ("end to end, s", f"{offline['seconds']:.1f}", f"{batch['seconds']:.1f}",
         "batch: upload -> output downloaded"),
        ("  validating, s", "", f"{batch['validating_s']:.1f}", "created -> in_progress"),
        ("  first line done, s", "", f"{batch['first_line_s']:.1f}", "from the upload"),
        ("lines/s", "", f"{batch['lines_per_s']:.2f}", ""),
    ]  # fmt: skip
    print(f"{'metric':<26}{'offline':>10}{'batch':>12}  note")
    for name, offline_value, batch_value, note in rows:
        print(f"{name:<26}{offline_value:>10}{batch_value:>12}  {note}")
    print(
        f"({args.num_lines} lines, {args.model_shape} model, {args.threads} threads, "
        f"{args.runner} runner, {results['seconds']:.0f} s in all)"
    )


if __name__ == "__main__":
    main()
