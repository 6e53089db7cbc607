"""Serving benchmark: `tgq bench` against tgq itself, the whole stack on this machine.

Starts `tgq serve` with Postgres and Redis (api, a batcher process, a Celery worker with beat),
serving the demo model, then runs `tgq bench` three times against it:

- `closed-16`: 200 chat requests, 16 in flight, prompts of 128 tokens, 64 out (EOS ignored);
- `poisson-8`: the same requests arriving as a Poisson process at 8 requests/s;
- `prefix-16`: 200 requests in 4 groups sharing a 256-token prefix, 16 in flight.

Each run writes its JSON and plots under `docs/bench/<run>/`; one summary table at the end.
The database `tgq_bench` is created afresh on the local Postgres (`--admin-url`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from tests.api.stack import admin, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "bench"
COMMON = ["--backend", "openai-chat", "--num-prompts", "200", "--ignore-eos", "--warmup", "8"]
RUNS = {
    "closed-16": ["--concurrency", "16", "--input-len", "128", "--output-len", "64"],
    "poisson-8": ["--request-rate", "8", "--input-len", "128", "--output-len", "64"],
    "prefix-16": [
        *("--dataset", "shared-prefix", "--prefix-len", "256", "--num-groups", "4"),
        *("--concurrency", "16", "--input-len", "32", "--output-len", "64"),
    ],
}
SLO = "ttft=500ms,tpot=50ms"


def fresh_database(admin_url: str, name: str) -> str:
    admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', admin_url)
    admin(f'CREATE DATABASE "{name}"', admin_url)
    return admin_url.rsplit("/", 1)[0] + f"/{name}"


def start_service(
    database_url: str, redis_url: str, port: int, log: Path
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "REDIS_PREFIX": f"bench-{uuid.uuid4().hex[:8]}",
        "PORT": str(port),
        "AUTO_MIGRATE": "true",
    }
    command = [sys.executable, "-m", "tgq.cli", "serve"]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )


def run_bench(url: str, name: str, tokenizer: Path) -> dict[str, object]:
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "tgq.cli", "--url", url, "bench", *COMMON, *RUNS[name],
        "--tokenizer", str(tokenizer), "--slo", SLO,
        "--output-json", str(out / "run.json"), "--plot-dir", str(out),
    ]  # fmt: skip
    subprocess.run(command, cwd=ROOT, check=True)
    summary: dict[str, object] = json.loads((out / "run.json").read_text())["summary"]
    (out / "run.json").unlink()  # per-request records: too long to commit; the plots stay
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--admin-url", default="postgresql+asyncpg://root@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--port", type=int, default=3900)
    parser.add_argument("--runs", nargs="*", default=list(RUNS))
    args = parser.parse_args()
    from tgq.devtools.demo import demo_model  # trains it the first time

    model_dir = demo_model()
    database_url = fresh_database(args.admin_url, "tgq_bench")
    url = f"http://127.0.0.1:{args.port}"
    OUT.mkdir(parents=True, exist_ok=True)
    service = start_service(database_url, args.redis_url, args.port, OUT / "serve.log")
    try:
        # The first start trains the demo model (minutes), so the wait is long.
        wait_healthy(url, service, OUT / "serve.log", 900)
        summaries = {name: run_bench(url, name, model_dir) for name in args.runs}
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(60)
    (OUT / "serve.log").unlink(missing_ok=True)
    print(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
