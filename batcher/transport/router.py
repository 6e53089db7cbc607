"""The api's side of cache-aware routing (`routing.py` has the rule and the summary's bounds):
`PrefixRouter.targets` looks a batch of submits up against the live batchers' advertised
prefixes and loads in one round trip, `enqueue` adds a routed submit to its pipeline.

A routed XADD runs in one script with a check of the batcher's heartbeat: a batcher whose
heartbeat is gone gets nothing more in its routed streams (the submit goes to the shared queue),
so what is left there can be moved away once, for good (`redis.RedisBatcherTransport.reclaim`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
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
        self._routed_xadd = client.register_script(_ROUTED_XADD)
        self._live: list[Heartbeat] = []
        self._live_until = 0.0

    async def targets(self, requests: list[SubmitRequest]) -> list[str | None]:
        """The batcher each request goes to (None: the shared queue), in order; each routed one
        counts towards its batcher's load for the ones after it."""
        live = [beat for beat in await self._live_routable() if beat.kv_block_size > 0]
        if not live:
            return [None] * len(requests)
        pipe = self.client.pipeline(transaction=False)
        for beat in live:
            for priority in Priority:
                stream = self.keys.routed(priority, beat.batcher_id)
                pipe.xlen(stream)
                pipe.xpending(stream, GROUP)
        num_probes = []
        for request in requests:
            members = _members(request, {beat.kv_block_size for beat in live})
            for beat in live:
                if members[beat.kv_block_size]:
                    pipe.smismember(
                        self.keys.prefixes(beat.batcher_id), members[beat.kv_block_size]
                    )
                num_probes.append(len(members[beat.kv_block_size]))
        replies = iter(await pipe.execute(raise_on_error=False))
        loads = {beat.batcher_id: beat.num_running + beat.num_waiting for beat in live}
        for beat in live:
            for _ in Priority:
                loads[beat.batcher_id] += _num_undelivered(next(replies), next(replies))
        probes = iter(num_probes)
        targets: list[str | None] = []
        for _ in requests:
            matched = [_num_leading(next(replies)) if next(probes) else 0 for _ in live]
            candidates = [
                Candidate(beat.batcher_id, num_matched, loads[beat.batcher_id])
                for beat, num_matched in zip(live, matched, strict=True)
            ]
            target = choose_batcher(candidates)
            if target is not None:
                loads[target] += 1
            targets.append(target)
        return targets

    async def enqueue(self, pipe: Any, request: SubmitRequest, batcher_id: str) -> None:
        """Adds the routed XADD to `pipe` (to the shared queue if the batcher's heartbeat is gone
        by then)."""
        keys = [
            self.keys.heartbeat(batcher_id),
            self.keys.routed(request.priority, batcher_id),
            self.keys.queue(request.priority),
            self.keys.routed_batchers,
        ]
        await self._routed_xadd(keys=keys, args=[encode(request), batcher_id], client=pipe)

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


def _num_undelivered(length: Any, pending: Any) -> int:
    """Entries of a routed stream not pulled yet (acked ones are deleted, so the rest are
    pending); 0 for a stream or group not there."""
    if isinstance(length, Exception) or isinstance(pending, Exception):
        return 0
    return max(int(length) - int(pending["pending"]), 0)


def _num_leading(found: Any) -> int:
    """Leading blocks held: the length of the run of members found from the first key."""
    if isinstance(found, Exception):
        return 0
    num = 0
    for is_member in found:
        if not is_member:
            break
        num += 1
    return num
