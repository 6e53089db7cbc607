"""Cache-aware routing: which batcher a request is enqueued for (the decision; its Redis side is
`router.PrefixRouter`, the batcher's side `redis.RedisBatcherTransport`).

Each batcher advertises the prefix-cache keys of its newest cached blocks, cut to
`SUMMARY_KEY_BYTES` bytes (`publish_prefixes`): with each heartbeat its set is replaced by its
newest `SUMMARY_MAX_HASHES` keys (32 KiB), and keys cached since are added every 50 ms; so the set
holds at most that many plus the blocks cached within one heartbeat interval.
The router computes the same keys for a prompt (`prefix_hashes.prompt_block_hashes`, at most
`MAX_PROBE_BLOCKS` leading blocks) and counts, per batcher, how many leading blocks it holds.

The rule (`choose_batcher`): the request goes to the holder of its longest cached prefix (of
several, the least loaded) unless that holder is much busier than the least loaded batcher:

    holder.load > BUSY_FACTOR * least_load + BUSY_MARGIN        (more than 4 above the least)

where a load is the requests a batcher pulled and has not finished plus those routed to it and
not finished. Then, like a request that matches nowhere, it goes to the shared queue, which
every batcher reads after its own. The trade: a hit saves the prefix's prefill, but a request
queued behind a backlog waits for it. A few requests more than the least loaded batcher cost
less than recomputing a long prefix; past that the others' idle capacity wins, and the batcher
that takes the spilled request caches the prefix too (a second holder; ties go to the less
loaded). The factor is 1: with a larger one the imbalance allowed grows with the load itself,
so at saturation a holder could queue many requests behind its batch while its peers have room;
with 1 it stays within the margin whatever the load.

A key cut to 8 bytes may collide: that only misroutes (the batcher then computes the prefix),
it never serves another prompt's KV (the batcher's own keys are whole).
"""

from __future__ import annotations

from dataclasses import dataclass

from tgq.batcher.kv_manager import BlockHash

SUMMARY_MAX_HASHES = 4096  # keys a batcher advertises: its most recently cached blocks
SUMMARY_KEY_BYTES = 8  # of each key
MAX_PROBE_BLOCKS = 256  # leading blocks of a prompt the router looks up
BUSY_FACTOR = 1.0
BUSY_MARGIN = 4  # requests


def summary_member(key: BlockHash) -> bytes:
    """How a block key sits in a batcher's advertised set."""
    return key[:SUMMARY_KEY_BYTES]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A live batcher as the router sees it for one request."""

    batcher_id: str
    num_matched_blocks: int  # leading blocks of the prompt it holds
    load: int  # requests pulled and not finished, and routed to it and not finished


def is_much_busier(load: int, least_load: int) -> bool:
    return load > BUSY_FACTOR * least_load + BUSY_MARGIN


def choose_batcher(candidates: list[Candidate]) -> str | None:
    """The batcher to enqueue the request for, or None: the shared queue (see the module's
    rule)."""
    best = max((c.num_matched_blocks for c in candidates), default=0)
    if best == 0:
        return None
    holder = min((c for c in candidates if c.num_matched_blocks == best), key=lambda c: c.load)
    if is_much_busier(holder.load, min(c.load for c in candidates)):
        return None
    return holder.batcher_id
