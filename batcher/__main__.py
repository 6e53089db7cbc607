"""`python -m tgq.batcher --model-id DIR --redis-url URL --batcher-id ID`: one batcher process.

Loads the model through `gpu_worker` (the only torch import, done here at start-up), connects to
Redis and runs the batcher loop until SIGTERM or SIGINT, then drains and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType

import redis

from tgq.batcher.config import SchedulerConfig
from tgq.batcher.detokenize import HFTokenDecoder
from tgq.batcher.engine import LLMEngine, StepRunner
from tgq.batcher.faults import inject_fault
from tgq.batcher.heap import freeze_startup_heap
from tgq.batcher.logs import configure_logging
from tgq.batcher.ranks import ShardConfig, ShardedRunner, WorkerLostError
from tgq.batcher.service import BatcherService, ServiceConfig
from tgq.batcher.tracing import TracingUnavailableError, configure_tracing, shutdown_tracing
from tgq.batcher.transport.base import TransportConfig
from tgq.batcher.transport.redis import RedisTransport
from tgq.gpu_worker.config import model_eos_token_ids
from tgq.gpu_worker.hub import ModelNotFoundError, PickleWeightsError, resolve_model_dir

log = logging.getLogger("batcher")
EXIT_RANK_LOST = 3  # a tensor-parallel rank died or hung: the supervisor restarts the batcher


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tgq.batcher", description=__doc__)
    parser.add_argument(
        "--model-id", required=True, help="local model directory or hub id (safetensors only)"
    )
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--prefix", default="tgq", help="Redis key prefix")
    parser.add_argument("--batcher-id", default=socket.gethostname())
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--num-shard",
        type=int,
        default=1,
        help="tensor-parallel ranks (TGI's flag): >1 starts that many gpu_worker.rank processes",
    )
    parser.add_argument("--threads-per-rank", type=int, default=None, help="CPU torch threads")
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--no-greedy-head",
        dest="greedy_head",
        action="store_false",
        help="compute full logits for greedy rows too (saves the int8 copy of the lm_head)",
    )
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--max-batch-prefill-tokens", type=int, default=4096)
    parser.add_argument("--heartbeat-ttl-s", type=float, default=10.0)
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--max-attempts", type=int, default=3)
    parser.add_argument("--drain-timeout-s", type=float, default=30.0)
    parser.add_argument("--json-output", action="store_true", help="log JSON lines (TGI's flag)")
    parser.add_argument("--otlp-endpoint", help="export traces to this OTLP/HTTP collector")
    parser.add_argument("--otlp-service-name", default="tgq", help="service name of the traces")
    parser.add_argument(
        "--inject-fault",
        default=None,
        metavar="engine_step:N",
        help="fault injection for reliability tests: the Nth engine step raises",
    )
    return parser.parse_args(argv)


def build_runner(args: argparse.Namespace) -> StepRunner:
    """The model in this process (`--num-shard 1`), or sharded over rank processes."""
    if args.num_shard > 1:
        config = ShardConfig(
            args.model_id, args.num_shard, device=args.device, block_size=args.block_size,
            num_blocks=args.num_blocks, threads_per_rank=args.threads_per_rank,
        )  # fmt: skip
        return ShardedRunner(config)
    from tgq.gpu_worker.runner import ModelRunner, RunnerConfig  # torch, at start-up only

    return ModelRunner(
        RunnerConfig(
            args.model_id,
            device=args.device,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            greedy_head=args.greedy_head,
        )
    )


def build_engine(args: argparse.Namespace, runner: StepRunner) -> LLMEngine:
    tokenizer = Path(args.model_id) / "tokenizer.json"
    decoder = HFTokenDecoder.from_file(str(tokenizer)) if tokenizer.exists() else None
    config = SchedulerConfig(
        max_batch_size=args.max_batch_size,
        max_batch_prefill_tokens=args.max_batch_prefill_tokens,
    )
    return LLMEngine(runner, config, decoder, model_eos_token_ids(args.model_id))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(json_output=args.json_output)
    if args.otlp_endpoint:
        try:
            configure_tracing(args.otlp_endpoint, args.otlp_service_name, scope="batcher")
        except TracingUnavailableError as error:
            sys.exit(f"batcher: {error}")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: draining", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    transport_config = TransportConfig(
        max_attempts=args.max_attempts, lease_s=args.lease_s, heartbeat_ttl_s=args.heartbeat_ttl_s
    )
    transport = RedisTransport.from_url(args.redis_url, args.prefix, transport_config)
    # A hub id becomes its snapshot directory once, here: the ranks, the tokenizer and the
    # generation config then all read the same files.
    try:
        args.model_id = str(resolve_model_dir(args.model_id, revision=args.revision))
    except (ModelNotFoundError, PickleWeightsError) as error:
        sys.exit(f"batcher: {error}")
    runner = build_runner(args)
    engine = build_engine(args, inject_fault(runner, args.inject_fault))
    heartbeat_interval_s = args.heartbeat_ttl_s / 4
    service_config = ServiceConfig(
        args.batcher_id,
        idle_block_ms=min(500, round(heartbeat_interval_s * 1000)),  # an idle batcher still beats
        heartbeat_interval_s=heartbeat_interval_s,
        reclaim_interval_s=args.lease_s / 2,
        drain_timeout_s=args.drain_timeout_s,
    )
    transient_errors = (redis.ConnectionError, redis.TimeoutError)
    service = BatcherService(engine, transport, service_config, transient_errors=transient_errors)
    freeze_startup_heap()
    log.info("batcher %s serving %s", args.batcher_id, args.model_id)
    try:
        service.run(stop)
    except WorkerLostError as error:  # its requests are back in the queue: rerun elsewhere
        log.error("batcher %s lost a rank: %s; exiting", args.batcher_id, error)
        if isinstance(runner, ShardedRunner):
            runner.kill()
        shutdown_tracing()
        sys.exit(EXIT_RANK_LOST)
    if isinstance(runner, ShardedRunner):
        runner.close()
    log.info("batcher %s drained", args.batcher_id)
    shutdown_tracing()


if __name__ == "__main__":
    main()
