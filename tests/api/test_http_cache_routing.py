"""Cache-aware routing through the api process (two batcher processes, Postgres, Redis):
interactive completions and a job's prompts that share a long prefix are enqueued for a batcher
that holds it (the api's routed queues are used) and find it in its prefix cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from tokenizers import Tokenizer

from tests.api.stack import BLOCK_SIZE, REDIS_URL, Stack, migrated_database, running
from tests.api.test_http_jobs import wait_for
from tests.polling import eventually
from tgq.batcher.transport.blocking import BlockingApiTransport
from tgq.batcher.transport.redis_keys import RedisKeys

pytestmark = pytest.mark.timeout(300)

PREFIX = "The quick brown fox jumps over the lazy dog, then naps under the old oak tree. " * 12
NUM_PREFIX_BLOCKS = 16  # at least, checked with the model's tokenizer


@pytest.fixture(scope="module")
def stack(text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with (
        migrated_database() as url,
        running(Stack(text_model_dir, url, tmp_path_factory.mktemp("logs"))) as stack,
    ):
        stack.start_batcher("b1")
        with BlockingApiTransport.from_url(REDIS_URL, stack.prefix) as transport:
            eventually(lambda: len(transport.live_batchers()) == 2, 60, "two batchers live")
        yield stack


def complete(client: httpx.Client, suffix: str) -> int:
    """A completion of PREFIX + suffix; its cached prompt tokens."""
    body = {"prompt": PREFIX + suffix, "max_tokens": 4, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    cached: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def test_interactive_requests_and_a_job_find_their_prefix_cached(
    stack: Stack, text_model_dir: Path
) -> None:
    tokenizer = Tokenizer.from_file(str(text_model_dir / "tokenizer.json"))
    assert len(tokenizer.encode(PREFIX).ids) >= (NUM_PREFIX_BLOCKS + 1) * BLOCK_SIZE
    client, keys = httpx.Client(base_url=stack.url, timeout=60), RedisKeys(stack.prefix)
    redis_client = redis.Redis.from_url(REDIS_URL)
    complete(client, " one")

    def advertised() -> bool:
        sizes = [redis_client.scard(keys.prefixes(b)) for b in ("b0", "b1")]
        return max(sizes) >= NUM_PREFIX_BLOCKS

    eventually(advertised, 10, "the prefix advertised")
    # The first of these may meet the api's view of the batchers from before the prefix was
    # advertised (it is reused for 50 ms); the ones after it have a view from after.
    complete(client, " two")
    assert all(complete(client, f" {s}") >= NUM_PREFIX_BLOCKS * BLOCK_SIZE for s in "abc")
    body = {"prompt": [PREFIX + f" {s}" for s in "xyz"], "parameters": {"max_new_tokens": 4}}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    accepted = response.json()
    assert wait_for(client, accepted["id"])["status"] == "succeeded"
    with BlockingApiTransport.from_url(REDIS_URL, stack.prefix) as transport:
        finals = [transport.read_final(request_id) for request_id in accepted["request_ids"]]
    assert all(
        f is not None and f.num_cached_tokens >= NUM_PREFIX_BLOCKS * BLOCK_SIZE for f in finals
    )
    assert redis_client.smembers(keys.routed_batchers)  # the api enqueued on routed queues
    redis_client.close()
    client.close()
