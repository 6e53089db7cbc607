"""The prefix cache's keys, as both sides compute them: the batcher's KV manager keys its cached
blocks with them (`kv_manager.block_hash`, chained from a salt), and the api's router computes
them for a prompt it is about to enqueue, to find the batcher that already holds its prefix
(`transport.routing`). One module, imported by both, so the two cannot drift;
`tests/batcher/test_prefix_hashes.py` checks a prompt's keys against the ones the scheduler
caches for it.

The salt a key chain starts from: the LoRA adapter's (`adapter_salt`) around the model's rope
salt (`ModelConfig.prefix_cache_salt`, empty unless a length-dependent rope scaling applies
past the original context). The api does not know the rope salt, so a prompt long enough to
need one is simply not matched (it goes to the shared queue): a lost hit, never a wrong one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from tgq.batcher.kv_manager import BlockHash, block_hash


def adapter_salt(adapter: str | None, salt: bytes = b"") -> BlockHash:
    """The salt of KV computed with `adapter` (None: the base model) over the model's `salt`:
    one prompt's KV differs from adapter to adapter."""
    if adapter is None:
        return salt
    return hashlib.sha256(b"adapter\0" + adapter.encode() + b"\0" + salt).digest()


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes = b"", *, max_blocks: int | None = None
) -> list[BlockHash]:
    """The keys of the prompt's leading full blocks that a prefix hit could serve: every full
    block but one holding the last token (a full hit still computes that token; as
    `KVManager.find_cached_prefix`), at most `max_blocks` of them."""
    num_blocks = max(len(token_ids) - 1, 0) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    keys: list[BlockHash] = []
    parent = salt
    for start in range(0, num_blocks * block_size, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys
