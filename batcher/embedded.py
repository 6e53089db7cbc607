"""A batcher inside another process (the api without Redis, `tgq serve`): the same loop as
`python -m tgq.batcher`, on a thread, over the in-process transport, configured by the same
options (the api's `Settings` extend them). The model loads here, on start (torch is imported
then, by `gpu_worker`, never by the caller's modules)."""

from __future__ import annotations

import logging
import queue
import threading

from tgq.batcher.__main__ import (
    build_engine,
    build_runner,
    describe,
    resolve_model,
    served_with,
)
from tgq.batcher.engine import LLMEngine
from tgq.batcher.options import BatcherOptions
from tgq.batcher.serving import Batcher, ServingConfig
from tgq.batcher.transport.memory import MemoryTransport
from tgq.batcher.warm_up import warm_up_decode

log = logging.getLogger(__name__)
EMBEDDED_ID = "embedded"  # the batcher's name without `--batcher-id`


class EmbeddedBatcher:
    """The model is loaded on the batcher's own thread, the one that then runs the engine: torch
    work done on a second thread (the loader) leaves a second OpenMP team behind, and with more
    OpenMP threads than cores libgomp stops spinning between parallel regions, which made every
    decode step ~1.6x slower (measured on 2 cores: 7.4 against 12.2 ms)."""

    def __init__(self, options: BatcherOptions) -> None:
        model_dir = resolve_model(options)
        self.transport = MemoryTransport(options.transport_config())
        self._go = threading.Event()
        self._stop = threading.Event()
        built: queue.Queue[tuple[LLMEngine, int, int] | BaseException] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(
            target=self._run, args=(options, model_dir, built), name="batcher", daemon=True
        )
        self._thread.start()
        outcome = built.get()  # the model loaded, or why not
        if isinstance(outcome, BaseException):
            raise outcome
        self.engine, self.kv_capacity, weight_bytes = outcome
        batcher_id = options.batcher_id or EMBEDDED_ID
        config = ServingConfig(
            batcher_id,
            idle_block_ms=200,
            drain_timeout_s=options.drain_timeout_s,
            weight_bytes=weight_bytes,
        )
        self.batcher = Batcher(self.engine, self.transport, config)

    def start(self) -> None:
        self._go.set()

    def _run(
        self,
        options: BatcherOptions,
        model_dir: str,
        built: queue.Queue[tuple[LLMEngine, int, int] | BaseException],
    ) -> None:
        try:
            runner = build_runner(options, model_dir)
            warm_up_decode(runner, options.num_warm_up_rows)
            engine = build_engine(options, model_dir, runner)
        except BaseException as exc:  # handed to the constructor, which raises it
            built.put(exc)
            return
        batcher_id = options.batcher_id or EMBEDDED_ID
        log.info("batcher %s serving %s %s", batcher_id, model_dir, describe(options, runner))
        kv_capacity = (runner.num_blocks - 1) * runner.block_size  # block 0 is reserved
        built.put((engine, kv_capacity, served_with(runner).weight_bytes or 0))
        self._go.wait()
        if self._stop.is_set():
            return
        try:
            self.batcher.run(self._stop)
        except Exception:
            log.exception("the embedded batcher failed")
            raise

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._go.set()
        self._thread.join(timeout_s)
