"""What both sides of the Redis transport agree on besides the key names (`redis_keys.py`): how
a message sits in a stream entry or a value, entry ids, durations, how long a blocking read may
wait, and the consumer groups. The batcher side (`redis.py`, synchronous) and the api side
(`aio.py`, asyncio) each do their I/O; every rule they share is here, once.

Consumer groups are never created ahead: a read, claim or pending query that finds its group
missing (a new Redis, or one restarted empty or flushed) creates it from the stream's first
entry and runs once more. So whatever was written after Redis lost its data (requests the
reconciler enqueued again, final results a batcher stored) is delivered at once, and no side
keeps a flag that could go stale.
"""

from __future__ import annotations

from typing import Any, TypeVar

import redis
from redis.typing import EncodableT

from tgq.batcher.messages import (
    AbortRequest,
    FinalResult,
    Heartbeat,
    Message,
    MessageError,
    SubmitRequest,
    TokenEvent,
    decode,
    encode,
)

_M = TypeVar("_M", SubmitRequest, AbortRequest, TokenEvent, FinalResult, Heartbeat)

# XGROUP CREATE from each stream's first entry (MKSTREAM: a stream not written yet); a group that
# is already there is kept as it is. One script, so that both clients run the same rule; the
# loop begins the scripts that must create the groups first (ARGV[1]: the group).
CREATE_GROUPS_LOOP = """
for _, stream in ipairs(KEYS) do
  local reply = redis.pcall('XGROUP', 'CREATE', stream, ARGV[1], '0', 'MKSTREAM')
  if type(reply) == 'table' and reply.err and not string.find(reply.err, '^BUSYGROUP') then
    return reply
  end
end
"""
CREATE_GROUPS = CREATE_GROUPS_LOOP + "return #KEYS\n"


def is_missing_group(error: redis.ResponseError) -> bool:
    """The command's consumer group (or its whole stream) is not there: create it, run again."""
    return "NOGROUP" in str(error)


def message_fields(message: Message) -> dict[EncodableT, EncodableT]:
    """The fields of a stream entry that carries `message`."""
    return {"m": encode(message)}


def entry_message(fields: dict[bytes, bytes], kind: type[_M]) -> _M:
    """The message of a stream entry; `KeyError` or `MessageError` when it holds none."""
    return decode_as(fields[b"m"], kind)


def decode_as(data: bytes, kind: type[_M]) -> _M:
    message = decode(data)
    if not isinstance(message, kind):
        raise MessageError(f"expected a {kind.__name__}, got a {type(message).__name__}")
    return message


def entry_id_str(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def ms(seconds: float) -> int:
    """A duration as Redis takes it: whole milliseconds, at least 1 (0 would mean "forever")."""
    return max(1, round(seconds * 1000))


def block_cap_ms(socket_timeout_s: float | None) -> int:
    """The longest a blocking read may wait: half a second under the client's socket timeout,
    or the read fails with a TimeoutError instead of returning empty. Blocking reads return
    early then; their callers loop."""
    return 2**31 - 1 if socket_timeout_s is None else max(1, round(socket_timeout_s * 1000) - 500)


def stream_entries(found: Any) -> list[Any]:
    """The entries of an XREAD or XREADGROUP reply on one stream ([] when it timed out)."""
    return list(found[0][1]) if found else []
