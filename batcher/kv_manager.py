"""KV block bookkeeping: a block allocator with a prefix cache. Block ids only, never tensors.

Prefix cache: chained block hashes (as vLLM v1), not a radix tree. Full block `k` of a sequence is
keyed by `sha256(key of block k-1 || its block_size token ids)`, so a key names the whole prefix up
to the end of that block and a lookup is one dict probe per block. sha256 rather than Python's
`hash`: a collision would silently serve another prompt's KV, so it must not be craftable. Only
blocks whose KV has been computed are cached (`cache_blocks`, after the step ran), so a hit never
reads KV that a concurrent step has yet to write.

Regions (every usable block id is in exactly one; block 0 is reserved, in none):

    ids 1 .. num_blocks-1
    ┌──────────────┬────────────────────────────┬────────────────────────────────┐
    │ free         │ in use                     │ cached-evictable               │
    │ ref 0        │ ref >= 1, held by requests │ ref 0, hash kept, LRU order    │
    │ no hash      │ (hash if full & computed)  │ (oldest released evicted first)│
    └──────────────┴────────────────────────────┴────────────────────────────────┘
    allocate: free first, then evict the LRU cached-evictable block (its hash entry is dropped)
    hit:      cached-evictable ──▶ in use (ref 1); in use ──▶ in use (ref + 1)
    release:  ref - 1; at 0 ──▶ cached-evictable if it has a hash, else free

A request releases its blocks last-first, so the tail of a sequence (least likely to be shared) is
evicted before its head.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence

BlockHash = bytes
_ROOT_HASH: BlockHash = b""


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_cache: bool = True):
        if num_blocks < 2 or block_size < 1:
            raise ValueError("need at least one usable block (block 0 is reserved) of size >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._ref_counts = [0] * num_blocks
        self._free_block_ids: deque[int] = deque(range(1, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._hash_to_block: dict[BlockHash, int] = {}
        self._block_to_hash: dict[int, BlockHash] = {}
        self._held: dict[str, list[int]] = {}  # request id -> its block table
        self._held_hashes: dict[str, list[BlockHash]] = {}  # keys of its first cached blocks
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._held.get(request_id, ()))

    def find_cached_prefix(self, token_ids: Sequence[int], salt: bytes = _ROOT_HASH) -> list[int]:
        """Cached blocks for the longest full-block prefix of `token_ids`, never including the
        block that holds the last token: a full hit still computes that token (for its logits).
        `salt`: where the keys start (one prefix under two salts is two entries; the model's
        `prefix_cache_salt`). Takes no references; pass the result to `grow_blocks`."""
        if not self.enable_prefix_cache:
            return []
        block_ids: list[int] = []
        parent = salt
        for start in range(0, len(token_ids) - 1 - self.block_size + 1, self.block_size):
            parent = block_hash(parent, token_ids[start : start + self.block_size])
            block_id = self._hash_to_block.get(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission (a request may be looked up many times while it waits)."""
        self.num_prefix_query_tokens += num_query_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    def cached_block_hashes(self, max_count: int) -> list[BlockHash]:
        """The keys of cached blocks (in use or evictable), the `max_count` most recently
        cached, newest first; what a batcher advertises to the api's router
        (`transport.routing`)."""
        return list(itertools.islice(reversed(self._hash_to_block), max_count))

    def grow_blocks(
        self, request_id: str, num_tokens: int, cached_block_ids: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow the request's block table to hold its first `num_tokens` tokens, taking the
        prefix-hit blocks first (only when it holds none yet). Returns the block ids added, or
        None (and changes nothing) when there are not enough blocks."""
        held = self._held.get(request_id, [])
        if cached_block_ids and held:
            raise ValueError(f"request {request_id!r}: prefix hits are taken at admission only")
        num_new = max(self.num_blocks_for(num_tokens) - len(held) - len(cached_block_ids), 0)
        num_hits_evictable = sum(1 for b in cached_block_ids if b in self._evictable)
        if num_new > self.num_free_blocks - num_hits_evictable:
            return None
        for block_id in cached_block_ids:
            self._evictable.pop(block_id, None)
            self._ref_counts[block_id] += 1
        new_block_ids = [*cached_block_ids, *(self._take_block() for _ in range(num_new))]
        self._held[request_id] = [*held, *new_block_ids]
        if request_id not in self._held_hashes:
            self._held_hashes[request_id] = [self._block_to_hash[b] for b in cached_block_ids]
        return new_block_ids

    def cache_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed: int, salt: bytes = _ROOT_HASH
    ) -> None:
        """Register the request's full blocks whose KV is computed (first `num_computed` tokens),
        keyed from `salt` (as in `find_cached_prefix`). A block whose content is already cached
        under another id stays uncached."""
        if not self.enable_prefix_cache:
            return
        held, hashes = self._held[request_id], self._held_hashes[request_id]
        for index in range(len(hashes), num_computed // self.block_size):
            start = index * self.block_size
            parent = hashes[-1] if hashes else salt
            key = block_hash(parent, token_ids[start : start + self.block_size])
            hashes.append(key)
            if key not in self._hash_to_block and held[index] not in self._block_to_hash:
                self._hash_to_block[key] = held[index]
                self._block_to_hash[held[index]] = key

    def free(self, request_id: str) -> None:
        """Drop the request's references; its cached blocks stay findable until evicted."""
        for block_id in reversed(self._held.pop(request_id, [])):
            self._release_block(block_id)
        self._held_hashes.pop(request_id, None)

    def trim(self, request_id: str, num_tokens: int) -> list[int]:
        """Give back the request's blocks past its first `num_tokens` tokens (a speculative
        step's rejected drafts); returns its block table. Cached blocks hold computed tokens
        only, so the blocks given back are never cached ones."""
        held = self._held[request_id]
        num_kept = self.num_blocks_for(num_tokens)
        if num_kept < len(self._held_hashes[request_id]):
            raise ValueError(f"request {request_id!r}: trimming would drop cached blocks")
        for block_id in reversed(held[num_kept:]):
            self._release_block(block_id)
        del held[num_kept:]
        return list(held)

    def _release_block(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] > 0:
            return
        if block_id in self._block_to_hash:
            self._evictable[block_id] = None
        else:
            self._free_block_ids.append(block_id)

    def _take_block(self) -> int:
        if self._free_block_ids:
            block_id = self._free_block_ids.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            del self._hash_to_block[self._block_to_hash.pop(block_id)]
        self._ref_counts[block_id] = 1
        return block_id

    def check_integrity(self) -> None:
        """Raise AssertionError when the accounting is off (see the region diagram)."""
        holders: Counter[int] = Counter()
        for request_id, block_ids in self._held.items():
            expect_integrity(
                len(set(block_ids)) == len(block_ids), f"{request_id!r} holds a block twice"
            )
            holders.update(block_ids)
        free, evictable = set(self._free_block_ids), set(self._evictable)
        expect_integrity(len(free) == len(self._free_block_ids), "a block is free twice")
        expect_integrity(0 not in free | evictable | set(holders), "block 0 is handed out")
        expect_integrity(self._ref_counts[0] == 0, "block 0 has references")
        for block_id in range(1, self.num_blocks):
            ref_count = self._ref_counts[block_id]
            expect_integrity(
                ref_count == holders[block_id], f"block {block_id}: ref count != holders"
            )
            regions = (ref_count > 0) + (block_id in free) + (block_id in evictable)
            expect_integrity(regions == 1, f"block {block_id} is in {regions} regions")
            expect_integrity(
                (block_id in evictable) <= (block_id in self._block_to_hash),
                f"evictable block {block_id} has no hash",
            )
            expect_integrity(
                block_id not in free or block_id not in self._block_to_hash, "free but cached"
            )
        in_use = sum(1 for count in self._ref_counts if count > 0)
        expect_integrity(
            len(free) + in_use + len(evictable) == self.num_usable_blocks, "blocks leak"
        )
        expect_integrity(
            all(self._hash_to_block[h] == b for b, h in self._block_to_hash.items())
            and len(self._hash_to_block) == len(self._block_to_hash),
            "hash maps disagree",
        )


def expect_integrity(condition: bool, message: str) -> None:
    """An assert that `python -O` keeps."""
    if not condition:
        raise AssertionError(f"KV integrity: {message}")
