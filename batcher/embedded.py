"""A batcher inside another process (the api without Redis, `tgq serve`): the same loop as
`python -m tgq.batcher`, on a thread, over the in-process transport, configured by the same
options (the api's `Settings` extend them). The model loads here, on start (torch is imported
then, by `gpu_worker`, never by the caller's modules)."""

from __future__ import annotations

import logging
import threading

from tgq.batcher.__main__ import build_engine, build_runner, describe, resolve_model
from tgq.batcher.engine import LLMEngine
from tgq.batcher.options import BatcherOptions
from tgq.batcher.serving import Batcher, ServingConfig
from tgq.batcher.transport.memory import MemoryTransport

log = logging.getLogger(__name__)
EMBEDDED_ID = "embedded"  # the batcher's name without `--batcher-id`


class EmbeddedBatcher:
    def __init__(self, options: BatcherOptions) -> None:
        model_dir = resolve_model(options)
        self.transport = MemoryTransport(options.transport_config())
        runner = build_runner(options, model_dir)
        self.engine: LLMEngine = build_engine(options, model_dir, runner)
        self.kv_capacity = (runner.num_blocks - 1) * runner.block_size  # block 0 is reserved
        batcher_id = options.batcher_id or EMBEDDED_ID
        log.info("batcher %s serving %s %s", batcher_id, model_dir, describe(options, runner))
        config = ServingConfig(
            batcher_id,
            idle_block_ms=200,
            drain_timeout_s=options.drain_timeout_s,
        )
        self.batcher = Batcher(self.engine, self.transport, config)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self.batcher.run(self._stop)
        except Exception:
            log.exception("the embedded batcher failed")
            raise

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
