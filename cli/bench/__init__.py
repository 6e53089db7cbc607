"""`tgq bench`: a load generator for any OpenAI-compatible or TGI endpoint, tgq's or a peer's.

It sends a dataset of prompts (random lengths, shared-prefix groups, or a JSONL file) as
streaming requests, either at a fixed concurrency (C clients, each sending its next request when
the last one ended) or as Poisson arrivals at a rate (at most C in flight when C is given too,
as vLLM's `--max-concurrency`). Every SSE event is stamped with `time.perf_counter()`; one httpx
connection pool, sized to the concurrency, carries all requests. `cli.bench.report` turns the
stamps into metrics, the printed table, the JSON and the plots.

Every flag falls back to an environment variable: `--num-prompts` <- `BENCH_NUM_PROMPTS`
(`--url` and `--api-key` are tgq's own, `TGQ_URL` and `TGQ_API_KEY`).

The package, one noun per module: `datasets` (prompts), `backends` (request bodies, SSE
parsing), `load` (arrivals, sending), `records` (one request's timings), `report` (summary,
table, JSON, plots), `flags`, and `command` (the `bench` handler).
"""

from tgq.cli.bench.command import bench
from tgq.cli.bench.flags import add_arguments

__all__ = ["add_arguments", "bench"]
