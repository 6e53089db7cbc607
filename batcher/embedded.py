"""A batcher inside another process (the api without Redis, `tgq serve`): the same loop as
`python -m tgq.batcher`, on a thread, over the in-process transport. The model loads here, on start
(torch is imported then, by `gpu_worker`, never by the caller's modules)."""

from __future__ import annotations

import logging
import threading

from tgq.batcher.__main__ import build_engine, build_runner, parse_args
from tgq.batcher.service import BatcherService, ServiceConfig
from tgq.batcher.transport.memory import MemoryTransport

log = logging.getLogger(__name__)


class EmbeddedBatcher:
    def __init__(self, model_dir: str, transport: MemoryTransport, *options: str) -> None:
        args = parse_args(["--model-id", model_dir, "--batcher-id", "embedded", *options])
        self.transport = transport
        self.service = BatcherService(
            build_engine(args, build_runner(args)),
            transport,
            ServiceConfig(args.batcher_id, idle_block_ms=200, drain_timeout_s=args.drain_timeout_s),
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self.service.run(self._stop)
        except Exception:
            log.exception("the embedded batcher failed")
            raise

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
