"""The benchmarks' shared harness: no bench script imports another, and the bench stack (the
tests' `Stack` with a benchmark's sizing and settings) comes up and serves a chat, here with
the tests' tiny model."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx

from bench.harness import bench_stack
from tests.api.stack import REDIS_URL, migrated_database, running

BENCH = Path(__file__).resolve().parents[2] / "bench"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }


def test_no_bench_script_imports_another() -> None:
    scripts = sorted(BENCH.glob("*.py"))
    assert len(scripts) > 5
    between = {
        path.name: sorted(m for m in imported_modules(path) if m.startswith("bench.bench_"))
        for path in scripts
    }
    assert {name: found for name, found in between.items() if found} == {}


def test_the_bench_stack_serves_a_chat(text_model_dir: Path, tmp_path: Path) -> None:
    with migrated_database() as url:
        stack = bench_stack(text_model_dir, url, tmp_path, REDIS_URL, threads=2, max_queued=64)
        env = stack.service_env()
        assert env["MAX_QUEUED_REQUESTS"] == "64" and env["MODEL_ID"] == "tgq-bench"
        assert (
            "DRAIN_TIMEOUT_S" not in env and "MAX_TOTAL_TOKENS" not in env
        )  # not the tests' quick ones
        with running(stack):
            body = {
                "model": "tgq-bench",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4,
                "ignore_eos": True,
            }
            response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4
            (batcher,) = stack.batchers
            assert stack.api is not None
            assert environ(batcher.pid)["OMP_NUM_THREADS"] == "2"  # `threads`
            assert environ(stack.api.pid)["OMP_NUM_THREADS"] == "1"


def environ(pid: int) -> dict[str, str]:
    """A process's environment as it started (Linux /proc)."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)
