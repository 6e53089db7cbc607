"""`python -m tgq.batcher --model-id DIR --redis-url URL --batcher-id ID`: one batcher process.

Every option is also an environment variable (`--max-batch-size` <- `MAX_BATCH_SIZE`).

Loads the model through `gpu_worker` (the only torch import, done here at start-up), connects to
Redis and runs the batcher loop until SIGTERM or SIGINT, then drains and exits 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType

import redis

from tgq.batcher.detokenize import HFTokenDecoder
from tgq.batcher.engine import LLMEngine, StepRunner
from tgq.batcher.faults import inject_fault
from tgq.batcher.flags import parse
from tgq.batcher.gc_freeze import freeze_startup_objects
from tgq.batcher.grammar_compiler import GrammarCompiler
from tgq.batcher.logs import configure_logging
from tgq.batcher.options import BatcherOptions
from tgq.batcher.ranks import ServedWith, ShardConfig, ShardedRunner, WorkerLostError
from tgq.batcher.serving import Batcher, ServingConfig
from tgq.batcher.tracing import TracingUnavailableError, configure_tracing, shutdown_tracing
from tgq.batcher.transport.redis import RedisBatcherTransport
from tgq.batcher.warm_up import warm_up_decode
from tgq.gpu_worker.config import ModelConfig, model_eos_token_ids
from tgq.gpu_worker.hub import ModelNotFoundError, PickleWeightsError, resolve_model_dir
from tgq.gpu_worker.quantization import (
    QuantizedCheckpointError,
    QuantizeError,
    check_quantize,
    check_stored_quantization,
    refuse_quantized_checkpoint,
)

log = logging.getLogger("batcher")
EXIT_RANK_LOST = 3  # a tensor-parallel rank died or hung: the supervisor restarts the batcher


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"  # a batcher process without REDIS_URL


def parse_args(argv: list[str] | None = None) -> BatcherOptions:
    """The options: flags over environment variables over defaults (`batcher.options`)."""
    return parse(BatcherOptions, argv, prog="python -m tgq.batcher", description=__doc__)


def build_runner(options: BatcherOptions, model_dir: str) -> StepRunner:
    """The model in this process (`--num-shard 1`), or sharded over rank processes."""
    kv_cache_bytes = None if options.kv_cache_memory is None else int(options.kv_cache_memory)
    dtype = None if options.dtype == "auto" else options.dtype
    custom_kernels = not options.disable_custom_kernels
    if options.quantize is not None:  # before any rank starts
        check_quantize(options.quantize)
    if options.num_shard > 1:
        sharded = ShardConfig(
            model_dir, options.num_shard, device=options.device, dtype=dtype,
            block_size=options.block_size, num_blocks=options.num_blocks,
            kv_cache_bytes=kv_cache_bytes, threads_per_rank=options.threads_per_rank,
            custom_kernels=custom_kernels, kv_cache_dtype=options.kv_cache_dtype,
            quantize=options.quantize, speculative_model=options.speculative_model,
        )  # fmt: skip
        return ShardedRunner(sharded)
    from tgq.gpu_worker.runner import ModelRunner, RunnerConfig  # torch, at start-up only

    config = RunnerConfig(
        model_dir, device=options.device, dtype=dtype, block_size=options.block_size,
        num_blocks=options.num_blocks, kv_cache_bytes=kv_cache_bytes,
        greedy_head=options.greedy_head, custom_kernels=custom_kernels,
        quantize=options.quantize, kv_cache_dtype=options.kv_cache_dtype,
        speculative_model=options.speculative_model,
        lora_adapters=tuple(options.adapter_dirs.items()),
    )  # fmt: skip
    return ModelRunner(config)


def served_with(runner: StepRunner) -> ServedWith:
    if isinstance(runner, ShardedRunner):
        return runner.served
    from tgq.gpu_worker.loader import weight_bytes
    from tgq.gpu_worker.runner import ModelRunner

    assert isinstance(runner, ModelRunner)
    dtype = str(runner.loaded.dtype).removeprefix("torch.")
    loaded = runner.loaded
    return ServedWith(
        dtype,
        runner.backend.name,
        loaded.num_cpu_kernel_modules,
        loaded.quantize,
        weight_bytes(loaded.model),
        str(runner.kv_dtype).removeprefix("torch."),
    )


def describe(options: BatcherOptions, runner: StepRunner) -> str:
    """The start-up line: what the options made of the model (tests read it)."""
    served = served_with(runner)
    return (
        f"on {options.device} x{options.num_shard}: {served};"
        f" KV {runner.num_blocks} blocks of {runner.block_size} tokens"
        f" in {served.kv_dtype or served.dtype};"
        f" batches of {options.max_batch_size} requests, {options.max_batch_prefill_tokens} tokens"
    )


def build_engine(options: BatcherOptions, model_dir: str, runner: StepRunner) -> LLMEngine:
    tokenizer = Path(model_dir) / "tokenizer.json"
    eos_token_ids = model_eos_token_ids(model_dir)
    model = ModelConfig.from_dir(model_dir)
    if not tokenizer.exists():
        return LLMEngine(runner, options.scheduler_config(), None, eos_token_ids, model=model)
    decoder = HFTokenDecoder.from_file(str(tokenizer))
    grammars = GrammarCompiler(
        tokenizer.read_text(), eos_token_ids, max_cache=options.max_grammar_cache
    )
    return LLMEngine(
        runner, options.scheduler_config(), decoder, eos_token_ids, grammars, model=model
    )


def resolve_model(options: BatcherOptions) -> str:
    """A hub id becomes its snapshot directory once, here: the ranks, the tokenizer and the
    generation config then all read the same files."""
    return str(resolve_model_dir(options.model_path, revision=options.revision))


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    configure_logging(json_output=options.json_output)
    if options.otlp_endpoint:
        try:
            configure_tracing(options.otlp_endpoint, options.otlp_service_name, scope="batcher")
        except TracingUnavailableError as error:
            sys.exit(f"batcher: {error}")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: draining", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    transport = RedisBatcherTransport.from_url(
        options.redis_url or DEFAULT_REDIS_URL, options.redis_prefix, options.transport_config()
    )
    try:
        model_dir = resolve_model(options)
        scheme = refuse_quantized_checkpoint(model_dir)  # before any weight is read, on any rank
        check_stored_quantization(scheme, options.quantize, options.num_shard)
    except (ModelNotFoundError, PickleWeightsError, QuantizedCheckpointError) as error:
        sys.exit(f"batcher: {error}")
    try:
        runner = build_runner(options, model_dir)
    except QuantizeError as error:
        sys.exit(f"batcher: {error}")
    warm_up_decode(runner, options.num_warm_up_rows)  # before the fault counts steps
    engine = build_engine(options, model_dir, inject_fault(runner, options.inject_fault))
    batcher_id = options.batcher_id or socket.gethostname()
    heartbeat_interval_s = options.heartbeat_ttl_s / 4
    serving_config = ServingConfig(
        batcher_id,
        idle_block_ms=min(500, round(heartbeat_interval_s * 1000)),  # an idle batcher still beats
        heartbeat_interval_s=heartbeat_interval_s,
        reclaim_interval_s=options.lease_s / 2,
        drain_timeout_s=options.drain_timeout_s,
        weight_bytes=served_with(runner).weight_bytes or 0,
    )
    transient_errors = (redis.ConnectionError, redis.TimeoutError)
    batcher = Batcher(engine, transport, serving_config, transient_errors=transient_errors)
    freeze_startup_objects()
    log.info("batcher %s serving %s %s", batcher_id, model_dir, describe(options, runner))
    try:
        batcher.run(stop)
    except WorkerLostError as error:  # its requests are back in the queue: rerun elsewhere
        log.error("batcher %s lost a rank: %s; exiting", batcher_id, error)
        if isinstance(runner, ShardedRunner):
            runner.kill()
        shutdown_tracing()
        sys.exit(EXIT_RANK_LOST)
    if isinstance(runner, ShardedRunner):
        runner.close()
    log.info("batcher %s drained", batcher_id)
    shutdown_tracing()


if __name__ == "__main__":
    main()
