"""The per-key rule (`api/key_policy.py`) in Redis: one Lua script admits or refuses a request
atomically for every api replica at once, on the Redis server's clock.

A key's state, under `<prefix>:key:<id>:`, each key expiring once idle for a window and a lease:
`requests` (sorted set: lease -> admitted at, ms), `charges` (sorted set: lease -> charged at),
`tokens` (hash: lease -> tokens charged), `total` (the sum of `tokens`), `leases` (sorted set:
lease -> lapses at).
"""

from __future__ import annotations

from typing import cast

from redis import asyncio as aioredis

from tgq.api.key_policy import LEASE_S, WINDOW_S, Grant, KeyLimits, Reason, refusal

# KEYS: requests, charges, tokens, total, leases. ARGV: lease, tokens, rpm, tpm, max_concurrent
# (0: no limit), window ms, lease ms. Returns {admitted 0/1, reason, retry ms, requests in the
# window, ms until none, tokens charged in the window, ms until none}.
ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, tokens = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, conc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local window, lease_ms = tonumber(ARGV[6]), tonumber(ARGV[7])
local since = now - window
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', since)
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', since)) do
  redis.call('DECRBY', KEYS[4], tonumber(redis.call('HGET', KEYS[3], old) or '0'))
  redis.call('HDEL', KEYS[3], old)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', since)
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
local num_requests = redis.call('ZCARD', KEYS[1])
local total = tonumber(redis.call('GET', KEYS[4]) or '0')
local reason, retry = '', 0
if conc > 0 and redis.call('ZCARD', KEYS[5]) >= conc then
  reason, retry = 'concurrent', 1000
elseif rpm > 0 and num_requests >= rpm then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  reason, retry = 'requests', tonumber(oldest[2]) + window - now
elseif tpm > 0 and total + tokens > tpm then
  local excess = total + tokens - tpm
  reason, retry = 'tokens', window
  for _, entry in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    excess = excess - tonumber(redis.call('HGET', KEYS[3], entry) or '0')
    if excess <= 0 then
      retry = tonumber(redis.call('ZSCORE', KEYS[2], entry)) + window - now
      break
    end
  end
end
if reason == '' then
  redis.call('ZADD', KEYS[1], now, lease)
  redis.call('ZADD', KEYS[2], now, lease)
  redis.call('HSET', KEYS[3], lease, tokens)
  total = redis.call('INCRBY', KEYS[4], tokens)
  redis.call('ZADD', KEYS[5], now + lease_ms, lease)
  num_requests = num_requests + 1
end
for i = 1, 5 do redis.call('PEXPIRE', KEYS[i], window + lease_ms) end
local function until_empty(key)
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if newest[2] == nil then return 0 end
  return tonumber(newest[2]) + window - now
end
return {reason == '' and 1 or 0, reason, retry, num_requests, until_empty(KEYS[1]), total,
        until_empty(KEYS[2])}
"""

# KEYS: tokens, total, leases. ARGV: lease, tokens used.
RELEASE = """
redis.call('ZREM', KEYS[3], ARGV[1])
local charged = redis.call('HGET', KEYS[1], ARGV[1])
if charged then
  local used = math.min(tonumber(ARGV[2]), tonumber(charged))
  redis.call('HSET', KEYS[1], ARGV[1], used)
  redis.call('DECRBY', KEYS[2], tonumber(charged) - used)
end
"""

# KEYS: leases. ARGV: lease ms, then the leases to renew (those the key still holds).
RENEW = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2)
"""


class RedisKeyLimiter:
    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        *,
        window_s: float = WINDOW_S,
        lease_s: float = LEASE_S,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.window_ms = round(window_s * 1000)
        self.lease_ms = round(lease_s * 1000)
        self._acquire = client.register_script(ACQUIRE)
        self._release = client.register_script(RELEASE)
        self._renew = client.register_script(RENEW)
        self._held: dict[str, int] = {}  # lease -> key id: this replica's requests in flight

    def _keys(self, key_id: int, *names: str) -> list[str]:
        return [f"{self.prefix}:key:{key_id}:{name}" for name in names]

    async def acquire(
        self, key_id: int, limits: KeyLimits, *, lease_id: str, num_tokens: int
    ) -> Grant:
        keys = self._keys(key_id, "requests", "charges", "tokens", "total", "leases")
        given = (limits.rpm, limits.tpm, limits.max_concurrent)
        args: list[str | int] = [lease_id, num_tokens, *(value or 0 for value in given)]
        reply = await self._acquire(keys, [*args, self.window_ms, self.lease_ms])
        is_admitted, reason, retry_ms, num_requests, reset_requests, total, reset_tokens = reply
        grant = Grant(
            limits,
            remaining_requests=(limits.rpm or 0) - int(num_requests),
            reset_requests_ms=int(reset_requests),
            remaining_tokens=(limits.tpm or 0) - int(total),
            reset_tokens_ms=int(reset_tokens),
        )
        if not is_admitted:
            why = cast(Reason, reason.decode() if isinstance(reason, bytes) else reason)
            raise refusal(limits, why, int(retry_ms), grant)
        self._held[lease_id] = key_id
        return grant

    async def release(self, key_id: int, lease_id: str, *, num_tokens_used: int) -> None:
        self._held.pop(lease_id, None)
        keys = self._keys(key_id, "tokens", "total", "leases")
        await self._release(keys, [lease_id, num_tokens_used])

    async def renew(self) -> None:
        by_key: dict[int, list[str]] = {}
        for lease_id, key_id in list(self._held.items()):
            by_key.setdefault(key_id, []).append(lease_id)
        for key_id, lease_ids in by_key.items():
            await self._renew(self._keys(key_id, "leases"), [self.lease_ms, *lease_ids])
