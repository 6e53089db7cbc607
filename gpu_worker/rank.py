"""`python -m tgq.gpu_worker.rank`: one tensor-parallel rank, started by the batcher (not by hand).

It joins the group of the torch.distributed contract (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; LOCAL_RANK picks the GPU), loads its slice of the model, reports how many KV
blocks fit in its memory, allocates what the batcher decides (the minimum over the ranks), then
executes every step plan it receives (`gpu_worker.rank_protocol`). It exits when the batcher
closes its pipe, and with the batcher: the kernel kills it when its parent dies (Linux).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import signal
import sys
import threading
from typing import Any

import torch

from tgq.gpu_worker import rank_protocol as protocol
from tgq.gpu_worker.kv_cache import num_blocks_for_budget
from tgq.gpu_worker.loader import LoadedModel, load_model, weight_bytes
from tgq.gpu_worker.parallel import TensorParallel
from tgq.gpu_worker.plan import plan_from_wire
from tgq.gpu_worker.runner import (
    ModelRunner,
    RunnerConfig,
    kv_budget,
    kv_cache_dtype,
    pick_attention,
)

log = logging.getLogger("gpu_worker.rank")
PR_SET_PDEATHSIG = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tgq.gpu_worker.rank", description=__doc__)
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (a GPU per LOCAL_RANK)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--block-size", type=int, default=None, help="default: the attention backend's"
    )
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-bytes", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e4m3 or fp8_e5m2")
    parser.add_argument("--quantize", default=None, help="int8 or fp8: this rank's slice at load")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument(
        "--speculative-model", default=None, help="a draft model's dir: rank 0 runs it whole"
    )
    parser.add_argument("--attention-backend", default="auto", help="a kernels registry key")
    parser.add_argument(
        "--disable-custom-kernels",
        action="store_true",
        help="torch attention and plain torch ops (RunnerConfig.custom_kernels=False)",
    )
    parser.add_argument("--fd-in", type=int, required=True, help="the batcher's plans")
    parser.add_argument("--fd-out", type=int, required=True, help="this rank's answers")
    parser.add_argument("--fd-beat", type=int, required=True, help="this rank's heartbeats")
    return parser.parse_args(argv)


def die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the batcher dies, even mid-collective (Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the batcher died before the request took effect
            os._exit(1)


def beat(fd: int, stop: threading.Event) -> None:
    """A byte every `HEARTBEAT_S` while the process runs (torch ops release the GIL, so a long
    step still beats; a stopped or wedged process does not). A full pipe drops the byte."""
    os.set_blocking(fd, False)
    while not stop.wait(protocol.HEARTBEAT_S):
        try:
            os.write(fd, b".")
        except BlockingIOError:
            pass
        except OSError:  # the batcher is gone
            return


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(process)d %(message)s")
    args = parse_args(argv)
    die_with_parent()
    threading.Thread(target=beat, args=(args.fd_beat, threading.Event()), daemon=True).start()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        torch.cuda.set_device(device)
    tp = TensorParallel.from_env(device)
    custom_kernels = not args.disable_custom_kernels
    loaded = load_model(
        args.model_id, device=device, dtype=args.dtype, cpu_kernels=custom_kernels, tp=tp,
        quantize=args.quantize,
    )  # fmt: skip
    config = RunnerConfig(
        args.model_id, dtype=args.dtype, device=str(device), block_size=args.block_size,
        num_blocks=args.num_blocks, kv_cache_bytes=args.kv_cache_bytes,
        attention_backend=args.attention_backend, custom_kernels=custom_kernels,
        kv_cache_dtype=args.kv_cache_dtype, speculative_model=args.speculative_model,
    )  # fmt: skip
    backend, block_size = pick_attention(config, device)
    kv_dtype = kv_cache_dtype(config, loaded.dtype, backend)
    capacity = args.num_blocks or num_blocks_for_budget(
        loaded.local_config, block_size, kv_dtype, kv_budget(config, device)
    )
    ready = {
        "type": "ready", "num_blocks": capacity, "block_size": block_size,
        # What the batcher logs it serves with.
        "dtype": str(loaded.dtype).removeprefix("torch."), "attention": backend.name,
        "num_cpu_kernel_modules": loaded.num_cpu_kernel_modules,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "quantize": loaded.quantize, "weight_bytes": weight_bytes(loaded.model),
    }  # fmt: skip
    protocol.write(args.fd_out, protocol.encode(ready))
    try:
        serve(args, config, loaded, tp)
    except protocol.PipeClosedError:
        log.info("rank %d: the batcher closed its pipe; exiting", tp.rank)


def serve(
    args: argparse.Namespace, config: RunnerConfig, loaded: LoadedModel, tp: TensorParallel
) -> None:
    allocate = protocol.read(args.fd_in)
    assert allocate is not None and allocate["type"] == "allocate", allocate
    runner = ModelRunner(dataclasses.replace(config, num_blocks=allocate["num_blocks"]), loaded)
    protocol.write(args.fd_out, protocol.encode({"type": "allocated"}))
    while True:
        message = protocol.read(args.fd_in)
        assert message is not None and message["type"] == "step", message
        reply: dict[str, Any]
        try:
            result = runner.execute(plan_from_wire(message["plan"]))
        except Exception as error:  # the batcher decides (a bad plan fails on every rank)
            log.exception("rank %d: step failed", tp.rank)
            reply = {"type": "error", "message": f"rank {tp.rank}: {error!r}"}
        else:
            reply = (
                {"type": "result", "result": protocol.result_to_wire(result)}
                if tp.is_first
                else {"type": "done"}
            )
        protocol.write(args.fd_out, protocol.encode(reply))


if __name__ == "__main__":
    main()
