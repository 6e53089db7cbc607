"""The batcher loop over the in-process transport and the fake runner: what it publishes, when it
acks, and how aborts, deadlines, drain and engine errors end requests."""

from __future__ import annotations

import threading
import time

import pytest

from tests.batcher.fake_runner import FakeRunner
from tests.polling import eventually
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine
from tgq.batcher.messages import FinalResult, SubmitRequest, TokenEvent
from tgq.batcher.request import Priority, StoppingParams
from tgq.batcher.serving import Batcher, ServingConfig
from tgq.batcher.transport.base import TransportConfig
from tgq.batcher.transport.memory import MemoryTransport
from tgq.gpu_worker.plan import SamplingParams, StepPlan, StepResult

NUM_BLOCKS = 64
BLOCK_SIZE = 4
CONFIG = TransportConfig(lease_s=0.01, heartbeat_ttl_s=0.01)

pytestmark = pytest.mark.timeout(20)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def make_engine(max_batch_size: int = 8) -> LLMEngine:
    config = SchedulerConfig(max_batch_size=max_batch_size, max_batch_prefill_tokens=64)
    return LLMEngine(FakeRunner(NUM_BLOCKS, BLOCK_SIZE), config)


def make_service(
    transport: MemoryTransport, clock: Clock | None = None, max_batch_size: int = 8
) -> Batcher:
    config = ServingConfig("b0", idle_block_ms=0, drain_timeout_s=5.0)
    return Batcher(make_engine(max_batch_size), transport, config, clock or Clock())


def submit(
    transport: MemoryTransport,
    request_id: str,
    prompt: list[int],
    max_new_tokens: int = 6,
    deadline: float | None = None,
    stop_strings: tuple[str, ...] = (),
    priority: Priority = Priority.INTERACTIVE,
) -> None:
    stopping = StoppingParams(max_new_tokens=max_new_tokens, stop_strings=stop_strings)
    request = SubmitRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(),
        stopping=stopping,
        priority=priority,
        deadline=deadline,
    )
    transport.submit(request)


def run_until_final(service: Batcher, transport: MemoryTransport, request_id: str) -> None:
    for _ in range(100):
        if transport.read_final(request_id) is not None:
            return
        service.run_once()
    raise AssertionError(f"{request_id} never finished")


def final_of(transport: MemoryTransport, request_id: str) -> FinalResult:
    result = transport.read_final(request_id)
    assert result is not None
    return result


def assert_nothing_pending(transport: MemoryTransport) -> None:
    time.sleep(CONFIG.lease_s * 2)
    assert transport.reclaim("other") == 0


def test_outputs_equal_the_offline_engine_and_each_request_is_acked() -> None:
    prompts = [[i + 1, i + 2, (3 * i) % 7 + 1] for i in range(12)]
    expected = make_engine().generate(prompts, stopping=StoppingParams(max_new_tokens=6))
    transport = MemoryTransport(CONFIG)
    service = make_service(transport)
    for i, prompt in enumerate(prompts):
        submit(transport, f"r{i}", prompt)
    for i in range(len(prompts)):
        run_until_final(service, transport, f"r{i}")
    for i, reference in enumerate(expected):
        events = transport.read_tokens(f"r{i}", 0, 0)
        assert [e.seq_index for e in events] == list(range(len(events)))
        assert [t for e in events for t in e.token_ids] == reference.token_ids
        result = final_of(transport, f"r{i}")
        assert result.token_ids == reference.token_ids
        assert (result.finish_reason, result.batcher_id, result.attempt) == ("length", "b0", 1)
        assert (result.num_prompt_tokens, result.num_output_tokens) == (3, 6)
    assert not service.active
    assert_nothing_pending(transport)


def test_a_new_process_reruns_what_the_last_one_with_its_id_held() -> None:
    transport = MemoryTransport(CONFIG)
    submit(transport, "r0", [1, 2])
    transport.pull("b0", 1, 0)  # then that process died
    service = make_service(transport)
    run_until_final(service, transport, "r0")
    assert final_of(transport, "r0").attempt == 2


def test_pulls_no_more_than_it_can_batch() -> None:
    transport = MemoryTransport(CONFIG)
    service = make_service(transport, max_batch_size=2)
    for i in range(5):
        submit(transport, f"r{i}", [1, 2, 3], max_new_tokens=20)
    service.run_once()
    assert sorted(service.active) == ["r0", "r1"]
    assert len(transport.pull("idle-batcher", 10, 0)) == 3


def test_pulls_nothing_while_its_own_requests_wait_for_admission() -> None:
    """A pool of 10 blocks of 4 tokens holds one 30-token request at a time: the rest stays in
    the queue, where an idle batcher takes it."""
    transport = MemoryTransport(CONFIG)
    config = SchedulerConfig(max_batch_size=8, max_batch_prefill_tokens=64)
    engine = LLMEngine(FakeRunner(11, BLOCK_SIZE), config)
    service = Batcher(engine, transport, ServingConfig("b0", idle_block_ms=0, max_pull=2))
    for i in range(5):
        submit(transport, f"r{i}", list(range(1, 25)), max_new_tokens=6)
    service.run_once()
    assert sorted(service.active) == ["r0", "r1"]  # max_pull
    assert [r.request_id for r in engine.scheduler.waiting] == ["r1"]
    service.run_once()
    assert sorted(service.active) == ["r0", "r1"]  # r1 still waits: no pull
    assert len(transport.pull("idle-batcher", 10, 0)) == 3


def test_a_full_batch_of_bulk_work_still_takes_an_interactive_request() -> None:
    """Bulk work fills the batch and more waits in the queue; an interactive request arriving
    then is pulled at once and preempts a bulk one (it does not wait for a bulk one to end)."""
    transport = MemoryTransport(CONFIG)
    service = make_service(transport, max_batch_size=2)
    for i in range(4):
        submit(transport, f"bulk-{i}", [1, 2, 3], max_new_tokens=30, priority=Priority.BULK)
    service.run_once()
    assert sorted(service.active) == ["bulk-0", "bulk-1"]
    submit(transport, "chat", [4, 5, 6], max_new_tokens=2)
    service.run_once()
    assert "chat" in service.active
    assert "chat" in [r.request_id for r in service.engine.scheduler.running]
    run_until_final(service, transport, "chat")
    assert transport.read_final("bulk-0") is None  # bulk work is still going
    assert len(transport.pull("idle-batcher", 10, 0)) == 2  # the queued bulk stayed queued


def test_abort_mid_generation_frees_the_blocks_within_one_step() -> None:
    transport = MemoryTransport(CONFIG)
    service = make_service(transport)
    kv = service.engine.scheduler.kv
    num_free = kv.num_free_blocks
    submit(transport, "r0", list(range(1, 10)), max_new_tokens=40)
    for _ in range(3):
        service.run_once()
    assert kv.num_free_blocks < num_free
    transport.abort("r0")
    service.run_once()
    assert kv.num_free_blocks == num_free
    result = final_of(transport, "r0")
    assert (result.finish_reason, result.finish_detail) == ("abort", "aborted")
    assert len(result.token_ids) == len(transport.read_tokens("r0", 0, 0)) == 3
    kv.check_integrity()
    assert_nothing_pending(transport)


def test_an_abort_before_the_pull_never_reaches_the_engine() -> None:
    transport = MemoryTransport(CONFIG)
    service = make_service(transport)
    submit(transport, "r0", [1, 2])
    transport.abort("r0")
    service.run_once()
    result = final_of(transport, "r0")
    assert (result.finish_reason, result.finish_detail) == ("abort", "aborted before it started")
    assert not service.engine.has_unfinished
    assert_nothing_pending(transport)


def test_deadlines_fire_for_waiting_and_running_requests() -> None:
    clock = Clock()
    transport = MemoryTransport(CONFIG)
    service = make_service(transport, clock)
    submit(transport, "late", [1, 2], deadline=clock.now - 1)
    submit(transport, "running", [1, 2], max_new_tokens=40, deadline=clock.now + 10)
    for _ in range(3):
        service.run_once()
    clock.now += 11
    service.run_once()
    late, running = final_of(transport, "late"), final_of(transport, "running")
    assert (late.finish_reason, late.finish_detail) == (
        "deadline",
        "deadline passed before it started",
    )
    assert running.finish_reason == "deadline"
    assert running.finish_detail == "deadline passed after 3 tokens"
    assert (
        service.engine.scheduler.kv.num_free_blocks == service.engine.scheduler.kv.num_usable_blocks
    )
    assert_nothing_pending(transport)


def test_a_request_the_engine_rejects_gets_a_final_result() -> None:
    transport = MemoryTransport(CONFIG)
    service = make_service(transport)
    submit(transport, "stops", [1, 2], stop_strings=("\n",))
    submit(transport, "huge", [1] * 300)
    service.run_once()
    service.run_once()
    stops, huge = final_of(transport, "stops"), final_of(transport, "huge")
    assert stops.finish_reason == huge.finish_reason == "rejected"
    assert stops.finish_detail == "stop strings need an engine with a tokenizer (decoder)"
    assert huge.finish_detail
    assert_nothing_pending(transport)


class BrokenRunner(FakeRunner):
    def execute(self, plan: StepPlan) -> StepResult:
        raise RuntimeError("device lost")


def test_an_engine_error_fails_every_request_it_holds() -> None:
    transport = MemoryTransport(CONFIG)
    engine = LLMEngine(BrokenRunner(NUM_BLOCKS, BLOCK_SIZE), SchedulerConfig())
    service = Batcher(engine, transport, ServingConfig("b0", idle_block_ms=0))
    submit(transport, "r0", [1, 2])
    submit(transport, "r1", [3, 4])
    with pytest.raises(RuntimeError, match="device lost"):
        service.run_once()
    for request_id in ("r0", "r1"):
        result = final_of(transport, request_id)
        assert result.finish_reason == "failed"
        assert result.finish_detail == "engine error: RuntimeError('device lost')"
    assert_nothing_pending(transport)


def test_drain_finishes_in_flight_work_and_stops_pulling() -> None:
    transport = MemoryTransport(CONFIG)
    service = make_service(transport)
    submit(transport, "r0", [1, 2], max_new_tokens=10)
    service.run_once()
    submit(transport, "queued", [3, 4])
    stop = threading.Event()
    stop.set()
    service.run(stop)
    assert final_of(transport, "r0").finish_reason == "length"
    assert transport.read_final("queued") is None
    assert [d.request.request_id for d in transport.pull("b1", 5, 0)] == ["queued"]


def test_drain_hands_back_what_it_cannot_finish_in_time() -> None:
    transport = MemoryTransport(CONFIG)
    config = ServingConfig("b0", idle_block_ms=0, drain_timeout_s=0.0)
    service = Batcher(make_engine(), transport, config)
    submit(transport, "r0", [1, 2], max_new_tokens=30)
    service.run_once()
    stop = threading.Event()
    stop.set()
    service.run(stop)
    assert transport.read_final("r0") is None
    (again,) = transport.pull("b1", 5, 0)
    assert (again.request.request_id, again.request.attempt) == ("r0", 1)


class OutageError(Exception):
    pass


class FlakyTransport(MemoryTransport):
    """Publishing fails while `is_down`; `num_refused` counts the failed calls."""

    is_down = False
    num_refused = 0

    def publish_tokens(self, events: list[TokenEvent]) -> None:
        if self.is_down:
            self.num_refused += 1
            raise OutageError("transport down")
        super().publish_tokens(events)


def test_events_wait_in_the_outbox_through_an_outage() -> None:
    expected = make_engine().generate([[5, 6, 7]], stopping=StoppingParams(max_new_tokens=8))
    transport = FlakyTransport(CONFIG)
    service = make_service(transport)
    submit(transport, "r0", [5, 6, 7], max_new_tokens=8)
    service.run_once()
    service.run_once()
    transport.is_down = True
    for _ in range(3):
        with pytest.raises(OutageError):
            service.run_once()
    transport.is_down = False
    run_until_final(service, transport, "r0")
    events = transport.read_tokens("r0", 0, 0)
    assert [e.seq_index for e in events] == list(range(8))
    assert [t for e in events for t in e.token_ids] == expected[0].token_ids


def test_run_backs_off_and_carries_on_after_an_outage() -> None:
    transport = FlakyTransport(CONFIG)
    transport.is_down = True
    config = ServingConfig("b0", idle_block_ms=10, max_backoff_s=0.05)
    service = Batcher(make_engine(), transport, config, transient_errors=(OutageError,))
    submit(transport, "r0", [5, 6, 7], max_new_tokens=8)
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,))
    thread.start()
    eventually(lambda: transport.num_refused >= 3, 5, "three tries during the outage")
    assert transport.read_final("r0") is None
    transport.is_down = False
    result = transport.read_final("r0", 5)
    stop.set()
    thread.join(5)
    assert result is not None
    assert result.finish_reason == "length"
    assert not thread.is_alive()


def test_a_stop_during_an_outage_still_ends_within_the_drain_timeout() -> None:
    transport = FlakyTransport(CONFIG)
    config = ServingConfig("b0", idle_block_ms=10, drain_timeout_s=0.2, max_backoff_s=0.05)
    service = Batcher(make_engine(), transport, config, transient_errors=(OutageError,))
    submit(transport, "r0", [5, 6, 7], max_new_tokens=8)
    transport.is_down = True
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,))
    thread.start()
    eventually(lambda: transport.num_refused >= 1, 5, "a try during the outage")
    stop.set()
    thread.join(3)
    assert not thread.is_alive()
    (again,) = transport.pull("b1", 5, 0)  # handed back
    assert again.request.request_id == "r0"


def test_a_second_copy_of_a_running_request_is_acked_with_it() -> None:
    """The reconciler may enqueue a request again while a batcher still runs it (Redis lost the
    first entry): it runs once, and both entries are acked."""
    transport = MemoryTransport(CONFIG)
    service = make_service(transport)
    submit(transport, "r0", [1, 2, 3], max_new_tokens=8)
    service.run_once()
    submit(transport, "r0", [1, 2, 3], max_new_tokens=8)
    run_until_final(service, transport, "r0")
    service.run_once()
    assert final_of(transport, "r0").num_output_tokens == 8
    assert transport.queue_depth() == 0
    assert_nothing_pending(transport)
