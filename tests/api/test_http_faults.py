"""Dependencies failing under a running api: the database disappears → submissions get 503 and
nothing is enqueued; reads get 503, not 500."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import redis

from tests.api.stack import REDIS_URL, Stack, create_database, drop_database
from tgq.api.db.migrate import upgrade
from tgq.batcher.request import Priority
from tgq.batcher.transport.redis_keys import RedisKeys

pytestmark = pytest.mark.timeout(120)


def test_database_gone_means_503_and_nothing_enqueued(text_model_dir: Path, tmp_path: Path) -> None:
    url = create_database()
    upgrade(url)
    stack = Stack(text_model_dir, url, tmp_path)  # no batcher: whatever is enqueued stays queued
    try:
        stack.start_api(healthy=False)
        client = httpx.Client(base_url=stack.url, timeout=30)
        accepted = client.post("/v1/jobs", json={"prompt": "before", "parameters": {}})
        assert accepted.status_code == 202
        drop_database(url)
        body = {"prompt": ["a", "b"], "parameters": {"max_new_tokens": 4}}
        refused = client.post("/v1/jobs", json=body)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "unavailable"
        assert "nothing was queued" in refused.json()["error"]["message"]
        interactive = client.post("/generate", json={"inputs": "x", "parameters": {}})
        assert interactive.status_code == 503
        assert interactive.json()["error_type"] == "unavailable"
        listed = client.get("/v1/jobs")
        assert listed.status_code == 503 and listed.json()["error"]["code"] == "unavailable"
        queued = redis.Redis.from_url(REDIS_URL)
        keys = RedisKeys(stack.prefix)
        depth = sum(queued.xlen(keys.queue(p)) for p in Priority)
        assert depth == 1  # only the job accepted before the database went away
    finally:
        stack.stop()
        drop_database(url)
