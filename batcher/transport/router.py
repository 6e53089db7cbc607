"""The api's side of cache-aware routing (`routing.py` has the rule and the summary's bounds):
`PrefixRouter.targets` picks the batcher of each submit from a view of the live batchers'
advertised prefixes and loads, `enqueue` adds a routed submit to the submit's pipeline.

The view is read in one round trip and reused for `VIEW_TTL_S` (a submit then costs no more
round trips than without routing); requests this replica routes meanwhile count towards their
batcher's load in it. So a prefix is routable about `VIEW_TTL_S` plus the batchers' 50 ms
advertising period after its blocks are computed.

A routed XADD runs in one script with a check of the batcher's heartbeat: a batcher whose
heartbeat is gone gets nothing more in its routed streams (the submit goes to the shared queue),
so what is left there can be moved away once, for good (`redis.RedisBatcherTransport.reclaim`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from tgq.batcher.messages import Heartbeat, SubmitRequest, encode
from tgq.batcher.prefix_hashes import adapter_salt, prompt_block_hashes
from tgq.batcher.request import Priority
from tgq.batcher.transport.redis_keys import GROUP, RedisKeys
from tgq.batcher.transport.routing import (
    MAX_PROBE_BLOCKS,
    Candidate,
    choose_batcher,
    summary_member,
)

VIEW_TTL_S = 0.05  # how long one read of the batchers' prefixes and loads is reused
LIVE_REFRESH_S = 1.0  # how long a look at the live batchers (a SCAN) is reused

# KEYS: the batcher's heartbeat, its routed stream, the shared stream, the routed set. ARGV: the
# encoded submit (in field "m", as `redis_wire.message_fields`), the batcher id.
_ROUTED_XADD = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('SADD', KEYS[4], ARGV[2])
  return redis.call('XADD', KEYS[2], '*', 'm', ARGV[1])
end
return redis.call('XADD', KEYS[3], '*', 'm', ARGV[1])
"""


@dataclass(slots=True)
class _View:
    beats: list[Heartbeat]  # the live batchers that advertise prefixes
    members: dict[str, set[bytes]]  # batcher id -> its advertised keys
    # batcher id -> `Candidate.load`: what it pulled from the shared queues and has not finished,
    # and what was routed to it and is not finished (pulled or not): live, unlike heartbeats.
    loads: dict[str, int]
    until: float  # monotonic


class PrefixRouter:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: RedisKeys,
        live_batchers: Callable[[], Awaitable[list[Heartbeat]]],
    ) -> None:
        self.client = client
        self.keys = keys
        self._live_batchers = live_batchers
        self._live: list[Heartbeat] = []
        self._live_until = 0.0
        self._view = _View([], {}, {}, 0.0)
        self._refreshing = asyncio.Lock()

    async def targets(self, requests: list[SubmitRequest]) -> list[str | None]:
        """The batcher each request goes to (None: the shared queue), in order; each routed one
        counts towards its batcher's load for the ones after it."""
        view = await self._fresh_view()
        block_sizes = {beat.kv_block_size for beat in view.beats}
        targets: list[str | None] = []
        for request in requests:
            members = _members(request, block_sizes)
            candidates = [
                Candidate(
                    beat.batcher_id,
                    _num_leading(members[beat.kv_block_size], view.members[beat.batcher_id]),
                    view.loads[beat.batcher_id],
                )
                for beat in view.beats
            ]
            target = choose_batcher(candidates)
            if target is not None:
                view.loads[target] += 1
            targets.append(target)
        return targets

    def enqueue(self, pipe: Any, request: SubmitRequest, batcher_id: str) -> None:
        """Adds the routed XADD to `pipe` (to the shared queue if the batcher's heartbeat is gone
        by then)."""
        keys = [
            self.keys.heartbeat(batcher_id),
            self.keys.routed(request.priority, batcher_id),
            self.keys.queue(request.priority),
            self.keys.routed_batchers,
        ]
        # EVAL, not a registered script: redis-py checks a pipeline's scripts with a SCRIPT EXISTS
        # round trip before each execute; Redis caches the compiled body either way.
        pipe.eval(_ROUTED_XADD, len(keys), *keys, encode(request), batcher_id)

    async def _fresh_view(self) -> _View:
        async with self._refreshing:  # one read for the submits that find the view stale
            now = time.monotonic()
            if now >= self._view.until:
                self._view = await self._read_view(now + VIEW_TTL_S)
            return self._view

    async def _read_view(self, until: float) -> _View:
        beats = [beat for beat in await self._live_routable() if beat.kv_block_size > 0]
        if not beats:
            return _View([], {}, {}, until)
        pipe = self.client.pipeline(transaction=False)
        for priority in Priority:
            pipe.xpending(self.keys.queue(priority), GROUP)
        for beat in beats:
            pipe.smembers(self.keys.prefixes(beat.batcher_id))
            for priority in Priority:
                pipe.xlen(self.keys.routed(priority, beat.batcher_id))
        replies = iter(await pipe.execute(raise_on_error=False))
        loads = _pending_by_consumer([next(replies) for _ in Priority])
        members = {}
        for beat in beats:
            members[beat.batcher_id] = set(next(replies))
            routed = sum(next(replies) for _ in Priority)
            loads[beat.batcher_id] = loads.get(beat.batcher_id, 0) + routed
        return _View(beats, members, loads, until)

    async def _live_routable(self) -> list[Heartbeat]:
        now = time.monotonic()
        if now >= self._live_until:
            self._live = await self._live_batchers()
            self._live_until = now + LIVE_REFRESH_S
        return self._live


def _members(request: SubmitRequest, block_sizes: set[int]) -> dict[int, list[bytes]]:
    """The summary members of the request's leading blocks, per block size."""
    salt = adapter_salt(request.adapter)
    return {
        block_size: [
            summary_member(key)
            for key in prompt_block_hashes(
                request.prompt_token_ids, block_size, salt, max_blocks=MAX_PROBE_BLOCKS
            )
        ]
        for block_size in block_sizes
    }


def _pending_by_consumer(summaries: list[Any]) -> dict[str, int]:
    """Entries of the shared queues each batcher has pulled and not finished, from XPENDING
    summaries (a missing group: none)."""
    pending: dict[str, int] = {}
    for summary in summaries:
        if isinstance(summary, Exception):
            continue
        for consumer in summary["consumers"]:
            name = consumer["name"].decode()
            pending[name] = pending.get(name, 0) + int(consumer["pending"])
    return pending


def _num_leading(members: list[bytes], advertised: set[bytes]) -> int:
    """Leading blocks held: the length of the run of advertised members from the first."""
    num = 0
    for member in members:
        if member not in advertised:
            break
        num += 1
    return num
