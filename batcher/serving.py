"""The batcher loop (`Batcher`): the engine behind a transport.

Each iteration: pull (never blocking while the engine has work, blocking up to `idle_block_ms`
when it has none) → aborts and deadlines → one engine step → publish that step's token events in
one batch → for each finished request publish its final result, then ack. A request is acked only
after its final result is stored, so a batcher that dies at any point loses nothing: the pending
entry is reclaimed and rerun elsewhere.

It pulls at most `max_batch_size` minus what it already holds, so work it could not schedule soon
stays in the queue for idle batchers.

Events and final results go through an outbox: when the transport is down (`transient_errors`,
e.g. Redis restarting), `run` backs off and retries, and the outbox is flushed, in order, before
the engine steps again, so a reader never sees a gap in a request's seq indices.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tgq.batcher import tracing
from tgq.batcher.active import ActiveRequest
from tgq.batcher.engine import LLMEngine, RequestOutput
from tgq.batcher.grammar_compiler import GrammarStats
from tgq.batcher.kv_manager import BlockHash
from tgq.batcher.messages import FinalResult, Heartbeat, SubmitRequest, TokenEvent
from tgq.batcher.ranks import WorkerLostError
from tgq.batcher.request import FinishReason, Priority
from tgq.batcher.speculation import SpeculationStats
from tgq.batcher.transport.base import BatcherTransport, Delivery
from tgq.batcher.transport.routing import SUMMARY_MAX_HASHES

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServingConfig:
    batcher_id: str
    idle_block_ms: int = 500
    heartbeat_interval_s: float = 2.0
    prefix_summary_interval_s: float = 0.05  # newly cached prefixes advertised (`routing.py`)
    reclaim_interval_s: float = 5.0
    drain_timeout_s: float = 30.0
    max_backoff_s: float = 5.0
    # Requests taken per pull; more only once the scheduler has admitted every one it holds.
    max_pull: int = 16
    weight_bytes: int = 0  # the model's weights as held (heartbeats carry it to /info)


class Batcher:
    def __init__(
        self,
        engine: LLMEngine,
        transport: BatcherTransport,
        config: ServingConfig,
        clock: Callable[[], float] = time.time,
        transient_errors: tuple[type[Exception], ...] = (),
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.config = config
        self.clock = clock  # unix time, for deadlines
        self.transient_errors = transient_errors
        self.active: dict[str, ActiveRequest] = {}
        self._outbox_events: list[TokenEvent] = []
        self._outbox_finals: list[tuple[FinalResult, list[Delivery]]] = []  # published, then acked
        self._next_heartbeat = 0.0
        self._next_reclaim = 0.0
        self._next_summary = 0.0
        self._advertised: set[BlockHash] = set()
        tracer = tracing.tracer()
        self.spans = None if tracer is None else tracing.RequestSpans(tracer)
        transport.poll_aborts(config.batcher_id)  # start the abort cursor before any pull
        num_recovered = transport.recover(config.batcher_id)
        if num_recovered:
            log.warning("requeued %d requests left by a previous process", num_recovered)

    @property
    def batcher_id(self) -> str:
        return self.config.batcher_id

    def run(self, stop: threading.Event) -> None:
        """Serve until `stop` is set, then drain: finish in-flight work within the drain timeout
        and hand back whatever is left."""
        while not stop.is_set():
            self._run_once_or_back_off(is_pulling=True, until=stop.is_set)
        drain_end = time.monotonic() + self.config.drain_timeout_s

        def is_drain_over() -> bool:
            return time.monotonic() >= drain_end

        while self._has_work and not is_drain_over():
            self._run_once_or_back_off(is_pulling=False, until=is_drain_over)
        self._hand_back()

    def _hand_back(self) -> None:
        """Every request it holds back to the queue, same attempt (others will run them)."""
        if self.spans is not None:
            self.spans.hand_back()
        try:
            for active in self.active.values():
                submit = active.delivery.request
                self.transport.release(self.batcher_id, active.delivery)
                log.info("request %s handed back", submit.request_id, extra=log_fields(submit))
                for duplicate in active.duplicates:  # one copy back in the queue is enough
                    self.transport.ack(self.batcher_id, duplicate)
        except self.transient_errors as error:  # still pending to us: reclaimed when we are gone
            log.warning("could not hand back in-flight work (%r)", error)
        self.active.clear()

    @property
    def _has_work(self) -> bool:
        return bool(self.active or self._outbox_events or self._outbox_finals)

    def _run_once_or_back_off(self, *, is_pulling: bool, until: Callable[[], bool]) -> None:
        """One iteration, retried with exponential backoff while the transport is down, until it
        succeeds or `until()` (stop requested, drain timeout)."""
        backoff_s = 0.05
        while not until():
            try:
                self.run_once(is_pulling=is_pulling)
                return
            except self.transient_errors as error:
                log.warning("transport unavailable (%r); retrying in %.2fs", error, backoff_s)
                time.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, self.config.max_backoff_s)

    def run_once(self, *, is_pulling: bool = True) -> None:
        self._flush()  # left over from a transport error
        self._maintain()
        if is_pulling:
            self._pull()
        self._apply_aborts_and_deadlines()
        if self.engine.has_unfinished:
            self._step()
        self._flush()

    def _maintain(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval_s
            self.transport.heartbeat(self.heartbeat())
            self._advertise_prefixes(now, is_refresh=True)
        else:
            self._advertise_prefixes(now, is_refresh=False)
        if now >= self._next_reclaim:
            self._next_reclaim = now + self.config.reclaim_interval_s
            num_reclaimed = self.transport.reclaim(self.batcher_id)
            if num_reclaimed:
                log.warning("requeued %d requests of dead batchers", num_reclaimed)

    def _advertise_prefixes(self, now: float, *, is_refresh: bool) -> None:
        """The prefix-cache keys it holds, for the api's router: the ones cached since, every
        `prefix_summary_interval_s`; all of them, replacing the set (evicted keys go), with
        each heartbeat, whose expiry the set shares."""
        if not is_refresh and now < self._next_summary:
            return
        self._next_summary = now + self.config.prefix_summary_interval_s
        keys = self.engine.scheduler.kv.cached_block_hashes(SUMMARY_MAX_HASHES)
        if is_refresh:
            self.transport.publish_prefixes(self.batcher_id, keys, replace=True)
            self._advertised = set(keys)
        elif new_keys := [key for key in keys if key not in self._advertised]:
            self.transport.publish_prefixes(self.batcher_id, new_keys, replace=False)
            self._advertised.update(new_keys)

    def heartbeat(self) -> Heartbeat:
        scheduler, kv = self.engine.scheduler, self.engine.scheduler.kv
        steps = scheduler.step_stats
        grammars = self.engine.grammars.stats if self.engine.grammars else GrammarStats()
        speculation = scheduler.speculation.stats if scheduler.speculation else SpeculationStats()
        return Heartbeat(
            batcher_id=self.batcher_id,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_free_blocks=kv.num_free_blocks,
            max_batch_size=scheduler.config.max_batch_size,
            time=self.clock(),
            num_usable_blocks=kv.num_usable_blocks,
            num_prefix_query_tokens=kv.num_prefix_query_tokens,
            num_prefix_hit_tokens=kv.num_prefix_hit_tokens,
            num_steps=steps.num_steps,
            num_step_tokens=steps.num_tokens,
            max_step_tokens=steps.max_tokens,
            grammar_compiles=list(grammars.compile_buckets),
            grammar_compile_seconds=grammars.compile_seconds_sum,
            num_grammar_failures=grammars.num_failures,
            num_grammar_cache_hits=grammars.num_cache_hits,
            num_grammar_masks=grammars.num_masks,
            grammar_mask_seconds=grammars.mask_seconds,
            num_grammar_argmax_checks=grammars.num_argmax_checks,
            num_grammar_argmax_misses=grammars.num_argmax_misses,
            weight_bytes=self.config.weight_bytes,
            kv_block_size=self.engine.runner.block_size,
            num_spec_proposed=speculation.num_proposed,
            num_spec_accepted=speculation.num_accepted,
            num_spec_verified=speculation.num_verified,
            spec_acceptance=list(speculation.acceptance_counts),
            spec_acceptance_sum=speculation.acceptance_sum,
        )

    def _pull(self) -> None:
        """Takes only what the scheduler can admit soon: at most `max_pull` at a time, never past
        the batch size, and nothing while requests it already holds wait for admission (KV or
        token budget) — except requests that outrank everything it holds: an interactive request
        preempts bulk work here rather than wait behind it in the queue (up to a batch of
        them). What it leaves stays in the queue for idle batchers."""
        scheduler = self.engine.scheduler
        max_batch_size = scheduler.config.max_batch_size
        num_slots = max_batch_size - len(self.active)
        if scheduler.waiting or num_slots <= 0:
            self._pull_outranking(max_batch_size)
            return
        num_wanted = min(num_slots, self.config.max_pull)
        block_ms = 0 if self.engine.has_unfinished else self.config.idle_block_ms
        for delivery in self.transport.pull(self.batcher_id, num_wanted, block_ms):
            self._admit(delivery)

    def _pull_outranking(self, max_batch_size: int) -> None:
        priorities = [a.delivery.request.priority for a in self.active.values()]
        if not priorities:
            return
        lowest = min(priorities)
        num_outranking = sum(priority > lowest for priority in priorities)
        num_wanted = min(max_batch_size - num_outranking, self.config.max_pull)
        if lowest < max(Priority) and num_wanted > 0:
            for delivery in self.transport.pull(self.batcher_id, num_wanted, 0, above=lowest):
                self._admit(delivery)

    def _admit(self, delivery: Delivery) -> None:
        submit = delivery.request
        if (running := self.active.get(submit.request_id)) is not None:
            # Already running here (a redelivery, or the reconciler's copy after Redis lost
            # the first): acked together with the running copy.
            if delivery.entry_id != running.delivery.entry_id:
                running.duplicates.append(delivery)
            return
        log.info(
            "request %s pulled (attempt %d, %d prompt tokens)",
            submit.request_id, submit.attempt, len(submit.prompt_token_ids),
            extra=log_fields(submit),
        )  # fmt: skip
        if self.spans is not None:
            self.spans.start(submit, log_fields(submit))
        if delivery.is_aborted:
            self._finish(
                ActiveRequest(delivery, None), FinishReason.ABORT, "aborted before it started"
            )
            return
        if submit.deadline is not None and submit.deadline <= self.clock():
            self._finish(
                ActiveRequest(delivery, None),
                FinishReason.DEADLINE,
                "deadline passed before it started",
            )
            return
        try:
            self.engine.add_request(
                submit.prompt_token_ids,
                submit.sampling,
                submit.stopping,
                priority=submit.priority,
                request_id=submit.request_id,
                grammar=submit.grammar,
                speculate=submit.speculate,
                adapter=submit.adapter,
            )
        except ValueError as error:  # e.g. stop strings for a batcher without a tokenizer
            self._finish(ActiveRequest(delivery, None), FinishReason.REJECTED, str(error))
            return
        request = self.engine.request(submit.request_id)
        self.active[submit.request_id] = ActiveRequest(delivery, request)

    def _apply_aborts_and_deadlines(self) -> None:
        for request_id in self.transport.poll_aborts(self.batcher_id):
            if (aborted := self.active.get(request_id)) is not None:
                log.info(
                    "request %s: aborting", request_id, extra=log_fields(aborted.delivery.request)
                )
                self.engine.abort(request_id)
        now = self.clock()
        for request_id, active in self.active.items():
            deadline = active.delivery.request.deadline
            if deadline is not None and deadline <= now and not active.deadline_passed:
                active.deadline_passed = True
                log.info(
                    "request %s: deadline passed; aborting",
                    request_id,
                    extra=log_fields(active.delivery.request),
                )
                self.engine.abort(request_id)

    def _step(self) -> None:
        started_ns = time.time_ns()
        try:
            outputs = self.engine.step()
        except WorkerLostError:  # the model is gone, not the requests' fault: they rerun
            self._flush_events_best_effort()
            self._hand_back()
            raise
        except Exception as error:
            self._fail_all(f"engine error: {error!r}")
            raise
        if self.spans is not None:
            self.spans.observe_step(started_ns, outputs, self.engine.scheduler.requests)
        events = [
            self.active[output.request_id].add_output(output)
            for output in outputs
            if output.request_id in self.active
        ]
        self._outbox_events += [e for e in events if e is not None]
        for output in outputs:
            active = self.active.get(output.request_id)
            if active is not None and output.is_finished:
                self._finish_output(active, output)

    def _flush_events_best_effort(self) -> None:
        try:
            self._flush()
        except self.transient_errors as error:
            log.warning("could not publish before handing back (%r)", error)

    def _flush(self) -> None:
        if self._outbox_events:
            self.transport.publish_tokens(self._outbox_events)
            self._outbox_events = []
        while self._outbox_finals:
            result, deliveries = self._outbox_finals[0]
            if not self.transport.publish_final(result):
                log.info("request %s already had a final result; dropped ours", result.request_id)
            for delivery in deliveries:
                self.transport.ack(self.batcher_id, delivery)
            self._outbox_finals.pop(0)

    def _finish_output(self, active: ActiveRequest, output: RequestOutput) -> None:
        if active.deadline_passed:
            num_tokens = len(active.token_ids)
            self._finish(
                active, FinishReason.DEADLINE, f"deadline passed after {num_tokens} tokens"
            )
        else:
            self._finish(active, output.finish_reason or FinishReason.ABORT, output.finish_detail)

    def _finish(self, active: ActiveRequest, reason: FinishReason, detail: str | None) -> None:
        submit = active.delivery.request
        result = active.final_result(reason, detail, self.batcher_id)
        self._outbox_finals.append((result, [active.delivery, *active.duplicates]))
        self.active.pop(submit.request_id, None)
        _log_finish(submit, result)
        if self.spans is not None:
            self.spans.finish(result)

    def _fail_all(self, detail: str) -> None:
        for active in list(self.active.values()):
            self._finish(active, FinishReason.FAILED, detail)
        self._flush()


def log_fields(submit: SubmitRequest) -> dict[str, str]:
    """What a log line about the request carries: the engine's id (`job_….N`, the item), and
    the api's request id (`x-request-id`) when the api sent one."""
    fields = {"item_id": submit.request_id}
    if submit.http_request_id:
        fields["request_id"] = submit.http_request_id
    return fields


def _log_finish(submit: SubmitRequest, result: FinalResult) -> None:
    reason, detail = result.finish_reason, result.finish_detail
    level = {FinishReason.FAILED: logging.ERROR, FinishReason.REJECTED: logging.WARNING}.get(
        reason, logging.INFO
    )
    log.log(
        level,
        "request %s finished: %s%s (%d prompt, %d generated tokens)",
        submit.request_id, reason, f", {detail}" if detail else "",
        result.num_prompt_tokens, result.num_output_tokens,
        extra={
            **log_fields(submit), "finish_reason": reason,
            "prompt_tokens": result.num_prompt_tokens,
            "generated_tokens": result.num_output_tokens,
        },
    )  # fmt: skip
