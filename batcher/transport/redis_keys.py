"""Where the Redis transport keeps what. Every key is under `prefix`, so deployments and tests
can share a server:

{p}:queue:interactive, {p}:queue:bulk   streams of submits; one consumer group "batchers",
                                        each batcher one consumer. Acked entries are deleted
                                        (Postgres is the record, not the stream).
{p}:queue:{priority}:to:{batcher_id}    streams of submits routed to one batcher (`routing.py`),
                                        same group; it reads its own before the shared ones.
                                        Written only while its heartbeat is there (one script
                                        checks and adds), so once it is gone any batcher's
                                        reclaim moves what is left to the shared queue, then
                                        deletes the streams.
{p}:routed                              set of the batcher ids that have routed streams.
{p}:prefixes:{batcher_id}               set of the prefix-cache keys the batcher holds (its
                                        newest cached blocks, each key's first 8 bytes):
                                        new keys added, all replaced with each heartbeat,
                                        expiring with it.
{p}:tokens:{request_id}                 stream of token events with explicit ids `0-(seq+1)`,
                                        then `1-0` once the final result is stored. Redis
                                        rejects an id not above the last, which gives the
                                        contract for free: first event per seq index wins,
                                        nothing lands after the end. A late or reconnecting
                                        reader catches up with XRANGE from `0-(seq+1)`, then
                                        blocks in XREAD. Expires about `token_ttl_s` after the
                                        last event (refreshed every 32 events and at the end).
                                        A stream, not pub/sub, so nothing is lost to a reader
                                        that was not subscribed yet.
{p}:final:{request_id}                  the final result, SET NX (first one wins) with
                                        `final_ttl_s`: long enough for the api to persist it.
{p}:finals                              stream of every stored final result (XADDed by the same
                                        script that SETs it, so never one without the other);
                                        consumer group "persisters": api replicas write them to
                                        Postgres, then XACK + XDEL. A replica that dies holding
                                        entries loses nothing: others claim them after the lease.
{p}:started                             stream of request ids whose first token event was
                                        published (a rerun adds its id again), capped near
                                        100,000 entries; each api replica reads it with its own
                                        cursor to mark items `running`.
{p}:hub:{replica}                       wake-up stream of one api replica's token hub (capped at
                                        ~100 entries; it lives as long as the replica's XREADs).
{p}:known:{request_id}                  set with each submit (`final_ttl_s`): Redis knows this
                                        request. Gone after a FLUSHALL or a restart without
                                        persistence: the reconciler re-enqueues such requests.
{p}:abort:{request_id}                  abort flag, seen by `pull` of a still-queued request.
{p}:aborts                              broadcast stream of aborts (each batcher reads it
                                        with its own cursor), capped near 10,000 entries.
{p}:heartbeat:{batcher_id}              the batcher's last heartbeat, expiring after
                                        `heartbeat_ttl_s`: no key means a dead batcher.
{p}:epoch                               "<unix time>:<random>", set NX by the api's monitor
                                        every tick: missing or changed means Redis lost its
                                        data (restart without persistence, FLUSHALL), and the
                                        replica that set the new one reconciles at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from tgq.batcher.request import Priority

GROUP = "batchers"  # the one consumer group on each queue stream
PERSISTERS = "persisters"  # the consumer group on the finals stream
MAX_ABORT_LOG = 10_000  # the aborts stream keeps about this many of the latest
END_ID = "1-0"  # above every token event id `0-n`: written once, with the final result
AFTER_EVENTS_ID = f"0-{2**64 - 1}"  # XREAD from here wakes only on END_ID


def event_id(seq_index: int) -> str:
    """The token-stream entry id of event `seq_index` (`0-0` is not a valid id)."""
    return f"0-{seq_index + 1}"


@dataclass(frozen=True, slots=True)
class RedisKeys:
    prefix: str

    def queue(self, priority: Priority) -> str:
        return f"{self.prefix}:queue:{priority.name.lower()}"

    def routed(self, priority: Priority, batcher_id: str) -> str:
        return f"{self.queue(priority)}:to:{batcher_id}"

    @property
    def routed_batchers(self) -> str:
        return f"{self.prefix}:routed"

    def prefixes(self, batcher_id: str) -> str:
        return f"{self.prefix}:prefixes:{batcher_id}"

    def tokens(self, request_id: str) -> str:
        return f"{self.prefix}:tokens:{request_id}"

    def final(self, request_id: str) -> str:
        return f"{self.prefix}:final:{request_id}"

    @property
    def finals(self) -> str:
        return f"{self.prefix}:finals"

    @property
    def started(self) -> str:
        return f"{self.prefix}:started"

    def hub_wake(self, replica: str) -> str:
        return f"{self.prefix}:hub:{replica}"

    def known(self, request_id: str) -> str:
        return f"{self.prefix}:known:{request_id}"

    def abort(self, request_id: str) -> str:
        return f"{self.prefix}:abort:{request_id}"

    @property
    def aborts(self) -> str:
        return f"{self.prefix}:aborts"

    def heartbeat(self, batcher_id: str) -> str:
        return f"{self.prefix}:heartbeat:{batcher_id}"

    @property
    def epoch(self) -> str:
        return f"{self.prefix}:epoch"
