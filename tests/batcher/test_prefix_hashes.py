"""The hash contract of cache-aware routing: the keys the api's router computes for a prompt
(`prefix_hashes.prompt_block_hashes`) are the keys the scheduler caches that prompt's blocks
under, for the base model and for a LoRA adapter, and a rerun of the prompt hits exactly them."""

from __future__ import annotations

import pytest

from tests.batcher.fake_runner import FakeRunner
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine
from tgq.batcher.prefix_hashes import adapter_salt, prompt_block_hashes
from tgq.batcher.request import StoppingParams

BLOCK_SIZE = 4


def cached_after(prompt: list[int], adapter: str | None) -> tuple[list[bytes], int]:
    """The keys the engine cached after running `prompt` once, and the cached tokens of a
    second run of it."""
    config = SchedulerConfig(max_batch_prefill_tokens=8, max_batch_size=4)  # chunked prefill
    engine = LLMEngine(FakeRunner(64, BLOCK_SIZE), config)
    engine.adapter_names = frozenset({"a1"})
    stopping = StoppingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate([prompt], stopping=stopping, adapters=[adapter])
    keys = engine.scheduler.kv.cached_block_hashes(64)[::-1]  # oldest first
    second = engine.generate([prompt], stopping=stopping, adapters=[adapter])
    return keys, second[0].num_cached_tokens


@pytest.mark.parametrize("adapter", [None, "a1"])
@pytest.mark.parametrize("num_tokens", [23, 24, 3])
def test_the_routers_keys_are_the_schedulers(adapter: str | None, num_tokens: int) -> None:
    prompt = [(7 * i + 3) % 50 for i in range(num_tokens)]
    keys, num_cached = cached_after(prompt, adapter)
    expected = prompt_block_hashes(prompt, BLOCK_SIZE, adapter_salt(adapter))
    assert len(expected) == (num_tokens - 1) // BLOCK_SIZE  # never the last token's block
    assert keys[: len(expected)] == expected  # the scheduler caches them in block order
    assert num_cached == len(expected) * BLOCK_SIZE


def test_an_adapter_keys_its_blocks_apart_and_max_blocks_cuts() -> None:
    prompt = list(range(40))
    base = prompt_block_hashes(prompt, BLOCK_SIZE)
    assert not set(base) & set(prompt_block_hashes(prompt, BLOCK_SIZE, adapter_salt("a1")))
    assert prompt_block_hashes(prompt, BLOCK_SIZE, max_blocks=3) == base[:3]
