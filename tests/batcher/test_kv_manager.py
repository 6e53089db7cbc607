"""KV manager: exact block ids and eviction order, and a seeded 100,000-operation property test."""

from __future__ import annotations

import random

import pytest

from tgq.batcher.kv_manager import KVManager


def _computed(kv: KVManager, request_id: str, token_ids: list[int], num_cached: int = 0) -> None:
    """Allocate for all of `token_ids` (after `num_cached` hit tokens) and mark them computed."""
    cached = kv.find_cached_prefix(token_ids)
    assert len(cached) * kv.block_size == num_cached
    assert kv.grow_blocks(request_id, len(token_ids), cached) is not None
    kv.cache_blocks(request_id, token_ids, len(token_ids))
    kv.check_integrity()


def test_block_ids_eviction_order_and_hits() -> None:
    kv = KVManager(num_blocks=6, block_size=2)
    assert kv.grow_blocks("a", 5) == [1, 2, 3]  # block 0 is reserved
    kv.cache_blocks("a", [1, 2, 3, 4, 5], 5)  # blocks 1 and 2 are full: cached
    kv.free("a")  # released last-first: 3 (uncached) is free, then 2, 1 become evictable
    kv.check_integrity()
    assert kv.num_free_blocks == 5
    # A full hit never includes the block of the last token.
    assert kv.find_cached_prefix([1, 2, 3, 4, 5]) == [1, 2]
    assert kv.find_cached_prefix([1, 2, 3, 4]) == [1]
    assert kv.find_cached_prefix([1, 9, 3, 4, 5]) == []
    # Free blocks go first (4, 5, then 3), then the least recently released cached one (2).
    assert kv.grow_blocks("b", 8) == [4, 5, 3, 2]
    assert kv.find_cached_prefix([1, 2, 3, 4, 5]) == [1]
    kv.check_integrity()
    assert kv.grow_blocks("c", 1) == [1]  # evicts the last cached block
    assert kv.find_cached_prefix([1, 2, 3]) == []
    assert kv.grow_blocks("d", 1) is None
    kv.check_integrity()


def test_hits_are_shared_and_refreshed_in_lru_order() -> None:
    kv = KVManager(num_blocks=8, block_size=2)
    _computed(kv, "a", [1, 2, 3])  # blocks 1, 2; block 1 cached
    _computed(kv, "b", [5, 6, 7])  # blocks 3, 4; block 3 cached
    _computed(kv, "c", [1, 2, 9], num_cached=2)  # shares block 1, gets block 5
    assert kv.block_ids("c") == [1, 5]
    for request_id in ("a", "b", "c"):
        kv.free(request_id)
    kv.check_integrity()
    # Evictable, oldest release first: 3 (b), then 1 (released by c after a). Free: 6, 7, 2, 4, 5.
    assert kv.grow_blocks("d", 12) == [6, 7, 2, 4, 5, 3]
    assert kv.find_cached_prefix([5, 6, 7]) == []
    assert kv.find_cached_prefix([1, 2, 9]) == [1]
    kv.check_integrity()


def test_duplicate_content_stays_uncached() -> None:
    kv = KVManager(num_blocks=6, block_size=2)
    assert kv.grow_blocks("a", 3) == [1, 2]
    assert kv.grow_blocks("b", 3) == [3, 4]  # same tokens, admitted in the same step
    kv.cache_blocks("a", [1, 2, 3], 3)
    kv.cache_blocks("b", [1, 2, 3], 3)
    kv.free("b")  # block 3 duplicates block 1: plain free, not evictable
    kv.check_integrity()
    assert kv.find_cached_prefix([1, 2, 3]) == [1]
    assert kv.grow_blocks("c", 6) == [5, 4, 3]


def test_failed_allocation_changes_nothing_and_counts_hits_it_would_take() -> None:
    kv = KVManager(num_blocks=4, block_size=2)
    _computed(kv, "a", [1, 2, 3, 4, 5])  # blocks 1, 2, 3
    kv.free("a")  # 1, 2 evictable; 3 free
    cached = kv.find_cached_prefix([1, 2, 3, 4, 5, 6, 7])
    assert cached == [1, 2]
    # Two hits plus two new blocks: only one block (3) is left once the hits are taken.
    assert kv.grow_blocks("b", 7, cached) is None
    kv.check_integrity()
    assert kv.grow_blocks("b", 6, cached) == [1, 2, 3]
    assert kv.usage == 1.0
    with pytest.raises(ValueError, match="at admission only"):
        kv.grow_blocks("b", 7, [1])


def test_prefix_cache_off_finds_nothing() -> None:
    kv = KVManager(num_blocks=4, block_size=2, enable_prefix_cache=False)
    _computed(kv, "a", [1, 2, 3])
    kv.free("a")
    assert kv.find_cached_prefix([1, 2, 3]) == []
    assert kv.grow_blocks("b", 6) == [3, 2, 1]


def test_integrity_check_catches_a_leak() -> None:
    kv = KVManager(num_blocks=4, block_size=2)
    kv.grow_blocks("a", 2)
    kv._ref_counts[1] += 1
    with pytest.raises(AssertionError, match="ref count"):
        kv.check_integrity()


def test_random_operations_keep_the_invariants() -> None:
    """100,000 seeded operations over a 2-4 token vocabulary, so prefixes collide often."""
    rng = random.Random(1234)
    block_size = 2
    kv = KVManager(num_blocks=24, block_size=block_size)
    tokens: dict[str, list[int]] = {}  # live request -> its token ids, all computed
    content: dict[int, tuple[int, ...]] = {}  # block id -> tokens its owner wrote there
    next_id = 0
    num_hits = num_failures = 0
    for _ in range(100_000):
        op = rng.random()
        vocab = rng.randint(2, 4)
        if op < 0.4 or not tokens:
            request_id, next_id = f"r{next_id}", next_id + 1
            token_ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            cached = kv.find_cached_prefix(token_ids)
            for index, block_id in enumerate(cached):
                start = index * block_size
                assert content[block_id] == tuple(token_ids[start : start + block_size])
            before = kv.num_free_blocks
            new_block_ids = kv.grow_blocks(request_id, len(token_ids), cached)
            if new_block_ids is None:
                assert kv.num_free_blocks == before
                num_failures += 1
                continue
            num_hits += len(cached)
            assert new_block_ids[: len(cached)] == cached
            tokens[request_id] = token_ids
            _write(kv, request_id, token_ids, len(cached) * block_size, content)
        elif op < 0.75:
            request_id = rng.choice(sorted(tokens))
            token_ids = tokens[request_id]
            start = len(token_ids)
            extra = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            if kv.grow_blocks(request_id, start + len(extra)) is None:
                num_failures += 1
                continue
            token_ids.extend(extra)
            _write(kv, request_id, token_ids, start, content)
        else:
            request_id = rng.choice(sorted(tokens))
            kv.free(request_id)
            del tokens[request_id]
        _check(kv, tokens)
    assert num_hits > 5_000 and num_failures > 1_000  # both paths are exercised


def _write(
    kv: KVManager,
    request_id: str,
    token_ids: list[int],
    start: int,
    content: dict[int, tuple[int, ...]],
) -> None:
    """Compute tokens [start, len): the request writes only blocks it does not share."""
    block_ids = kv.block_ids(request_id)
    block_size = kv.block_size
    for index in range(start // block_size, len(block_ids)):
        content[block_ids[index]] = tuple(token_ids[index * block_size : (index + 1) * block_size])
    kv.cache_blocks(request_id, token_ids, len(token_ids))


def _check(kv: KVManager, tokens: dict[str, list[int]]) -> None:
    kv.check_integrity()
    holders: dict[int, list[tuple[int, list[int]]]] = {}  # block id -> (index, tokens) per holder
    for request_id, token_ids in tokens.items():
        block_ids = kv.block_ids(request_id)
        assert 0 not in block_ids
        assert len(set(block_ids)) == len(block_ids)
        assert len(block_ids) == kv.num_blocks_for(len(token_ids))
        for index, block_id in enumerate(block_ids):
            holders.setdefault(block_id, []).append((index, token_ids))
    for block_id, held in holders.items():
        assert kv._ref_counts[block_id] == len(held)
        if len(held) == 1:
            continue
        # Held twice only as the same full prefix block: same index, same tokens up to its end.
        index = held[0][0]
        end = (index + 1) * kv.block_size
        assert all(i == index and len(t) >= end for i, t in held)
        assert len({tuple(t[:end]) for _, t in held}) == 1
