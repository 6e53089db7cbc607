"""A key restricted to some LoRA adapters (`adapters` of its policy) over HTTP, embedded: the
adapters it may use answer, any other model (an adapter, the base) is a 403 naming the allowed
ones on TGI and OpenAI routes and in jobs, and its usage is counted under the adapter's name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.stack import Stack
from tests.gpu_worker.lora_adapters import write_adapter
from tests.polling import eventually

pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)

FORBIDDEN = "This API key may not use {!r}; it may use: 'support-bot'"


def test_a_key_uses_only_its_adapters(text_model_dir: Path, tmp_path: Path) -> None:
    adapters = {
        name: write_adapter(text_model_dir, tmp_path / name, rank=4, alpha=8, seed=seed)
        for seed, name in enumerate(("support-bot", "legal-bot"))
    }
    env = {
        "AUTO_MIGRATE": "true", "REQUIRE_API_KEYS": "true", "API_KEY": "admin",
        "LORA_ADAPTERS": ",".join(f"{name}={path}" for name, path in adapters.items()),
    }  # fmt: skip
    url = f"sqlite+aiosqlite:///{tmp_path / 'tgq.db'}"
    stack = Stack(text_model_dir, url, tmp_path, redis_url=None, api_env=env)
    try:
        stack.start_api()
        policy = {"name": "support", "adapters": ["support-bot"]}
        admin = {"Authorization": "Bearer admin"}
        key = httpx.post(f"{stack.url}/admin/keys", json=policy, headers=admin).json()["key"]
        headers = {"Authorization": f"Bearer {key}"}

        def generate(adapter_id: str | None) -> httpx.Response:
            params: dict[str, Any] = {"max_new_tokens": 4, "ignore_eos": True}
            body = {"inputs": "Hello", "parameters": {**params, "adapter_id": adapter_id}}
            return httpx.post(f"{stack.url}/generate", json=body, headers=headers, timeout=60)

        assert generate("support-bot").status_code == 200
        for model, answer in (("legal-bot", generate("legal-bot")), ("tgq-test", generate(None))):
            assert answer.status_code == 403
            assert answer.json()["error"] == FORBIDDEN.format(model)
        body = {"model": "legal-bot", "prompt": "Hello", "max_tokens": 2}
        refused = httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers)
        assert refused.status_code == 403
        assert refused.json()["error"]["message"] == FORBIDDEN.format("legal-bot")
        job = {"prompt": "Hi", "parameters": {"adapter_id": "legal-bot", "max_new_tokens": 2}}
        assert httpx.post(f"{stack.url}/v1/jobs", json=job, headers=headers).status_code == 403

        def usage() -> list[dict[str, Any]] | None:
            rows: list[dict[str, Any]] = httpx.get(f"{stack.url}/v1/usage", headers=headers).json()[
                "data"
            ]
            return rows or None

        rows = eventually(usage, 30, "the answered request in /v1/usage")
        assert rows is not None
        assert [(row["model"], row["requests"], row["completion_tokens"]) for row in rows] == [
            ("support-bot", 1, 4)
        ]
    finally:
        stack.stop()
