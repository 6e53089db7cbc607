"""The batcher's side of tensor parallelism: `ShardedRunner` starts `--num-shard` rank
processes (`python -m tgq.gpu_worker.rank`) and drives them as one `StepRunner`. Torch-free: the
ranks hold the model; this process keeps scheduling.

Start-up: every rank loads its slice of the model and reports how many KV blocks fit in its
memory; all of them allocate the minimum. Each step, the plan is encoded once (JSON, see
`gpu_worker.rank_protocol`) and written to every rank's pipe; every rank answers, rank 0 with
the sampled tokens. A rank that exits, whose heartbeat stops for `hang_timeout_s` (stopped or
wedged), or that does not read its plan or answer within `step_timeout_s`, is a
`WorkerLostError`: the batcher hands its requests back to the queue and exits non-zero, and the
remaining ranks are killed (they would block in their next collective). The ranks exit by
themselves when the batcher dies (their pipe closes; on Linux the kernel kills them too).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from tgq.gpu_worker import rank_protocol as protocol
from tgq.gpu_worker.plan import StepPlan, StepResult, to_wire

log = logging.getLogger(__name__)
POLL_S = 0.2  # how often a wait checks that every rank is still alive


class WorkerLostError(RuntimeError):
    """A rank process died, hung or failed: the model can no longer run here."""


@dataclass(frozen=True, slots=True)
class ShardConfig:
    model_id: str
    num_shard: int
    device: str = "cpu"
    dtype: str | None = None
    block_size: int | None = None  # None: the attention backend's default (the ranks say)
    num_blocks: int | None = None  # None: what fits on every rank
    kv_cache_bytes: int | None = None  # per rank
    threads_per_rank: int | None = None  # CPU: torch threads of each rank
    attention_backend: str = "auto"
    custom_kernels: bool = True  # False: torch attention and plain torch ops on every rank
    kv_cache_dtype: str = "auto"  # `--kv-cache-dtype`
    quantize: str | None = None  # `--quantize`: each rank quantizes its slice at load
    speculative_model: str | None = None  # `--speculative-model`: run whole on rank 0
    start_timeout_s: float = 600.0  # loading the model
    step_timeout_s: float = 120.0  # one step (longer than the ranks' collective timeout)
    hang_timeout_s: float = 5.0  # a rank without a heartbeat this long is hung


@dataclass(frozen=True, slots=True)
class ServedWith:
    """What a runner's model runs on: the batcher logs it at start."""

    dtype: str  # "bfloat16"
    attention: str  # the attention backend's registry key
    num_cpu_kernel_modules: int  # modules on the C++ CPU kernels (0: plain torch ops)
    quantize: str | None = None  # "int8": the linears quantized at load
    weight_bytes: int | None = None  # the model's weights as held (one rank's; None: not asked)
    kv_dtype: str | None = None  # the KV cache's element type ("float8_e4m3fn"); None: dtype's

    def __str__(self) -> str:
        quantized = f" with {self.quantize} linears" if self.quantize else ""
        held = "" if self.weight_bytes is None else f", weights {self.weight_bytes / 2**20:.1f} MiB"
        return (
            f"dtype {self.dtype}{quantized}, attention {self.attention},"
            f" {self.num_cpu_kernel_modules} modules on C++ kernels{held}"
        )


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen[bytes]
    to_rank: int  # our end of its input pipe
    from_rank: int  # our end of its output pipe
    beats: int  # our end of its heartbeat pipe
    last_beat: float = 0.0  # monotonic
    # Its beats start once it has imported torch (seconds, under load); a message counts as one.
    # Until then, a silence up to `start_timeout_s` is a rank still starting.
    has_beaten: bool = False


class ShardedRunner:
    def __init__(self, config: ShardConfig) -> None:
        if config.num_shard < 2:
            raise ValueError("a sharded runner needs --num-shard >= 2")
        self.config = config
        self._ranks: list[_Rank] = []
        self.plan_encode_s = 0.0  # time spent encoding and sending plans (the TP overhead)
        self.num_steps = 0
        try:
            self._start()
            capacities = [
                self._expect(rank, "ready", config.start_timeout_s) for rank in self._ranks
            ]
            self._num_blocks = config.num_blocks or min(m["num_blocks"] for m in capacities)
            block_sizes = {m["block_size"] for m in capacities}
            if len(block_sizes) != 1:
                raise WorkerLostError(f"the ranks chose different KV block sizes: {block_sizes}")
            self._block_size: int = block_sizes.pop()
            first = capacities[0]
            self.served = ServedWith(
                first["dtype"],
                first["attention"],
                first["num_cpu_kernel_modules"],
                first["quantize"],
                first["weight_bytes"],
                kv_dtype=first["kv_dtype"],
            )
            log.info("ranks' KV capacities %s: allocating %d blocks each",
                     [m["num_blocks"] for m in capacities], self._num_blocks)  # fmt: skip
            self._send_all(protocol.encode({"type": "allocate", "num_blocks": self._num_blocks}))
            for rank in self._ranks:
                self._expect(rank, "allocated", config.start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        self._send_all(protocol.encode({"type": "step", "plan": to_wire(plan)}))
        self.plan_encode_s += time.perf_counter() - started
        self.num_steps += 1
        replies = [self._answer(rank) for rank in self._ranks]
        errors = [reply["message"] for reply in replies if reply["type"] == "error"]
        if errors:
            raise ValueError("; ".join(errors))  # a bad plan: every rank refused it alike
        return protocol.result_from_wire(replies[0]["result"])

    def close(self, timeout_s: float = 10.0) -> None:
        """Closes the pipes (the ranks exit), then kills what is left after `timeout_s`."""
        for rank in self._ranks:
            for fd in (rank.to_rank, rank.from_rank, rank.beats):
                with contextlib.suppress(OSError):
                    os.close(fd)
        deadline = time.monotonic() + timeout_s
        for rank in self._ranks:
            try:
                rank.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rank.process.kill()
                rank.process.wait()
        self._ranks = []

    def kill(self) -> None:
        """After a lost rank: the others would block in their next collective."""
        for rank in self._ranks:
            if rank.process.poll() is None:
                rank.process.kill()
        self.close(timeout_s=5.0)

    # --- processes and pipes -------------------------------------------------------------------

    def _start(self) -> None:
        config = self.config
        port = _free_port()
        for index in range(config.num_shard):
            plan_read, plan_write = os.pipe()
            answer_read, answer_write = os.pipe()
            beat_read, beat_write = os.pipe()
            command = [
                sys.executable, "-m", "tgq.gpu_worker.rank", "--model-id", config.model_id,
                "--device", config.device,
                "--fd-in", str(plan_read), "--fd-out", str(answer_write),
                "--fd-beat", str(beat_write), "--attention-backend", config.attention_backend,
            ]  # fmt: skip
            for flag, value in (
                ("--dtype", config.dtype),
                ("--block-size", config.block_size),
                ("--num-blocks", config.num_blocks),
                ("--kv-cache-bytes", config.kv_cache_bytes),
                ("--threads", config.threads_per_rank),
                ("--kv-cache-dtype", config.kv_cache_dtype),
                ("--quantize", config.quantize),
                ("--speculative-model", config.speculative_model),
            ):
                if value is not None:
                    command += [flag, str(value)]
            if not config.custom_kernels:
                command.append("--disable-custom-kernels")
            env = {
                **os.environ,
                "RANK": str(index),
                "LOCAL_RANK": str(index),
                "WORLD_SIZE": str(config.num_shard),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            if config.threads_per_rank is not None:
                env["OMP_NUM_THREADS"] = str(config.threads_per_rank)
            child_fds = (plan_read, answer_write, beat_write)
            process = subprocess.Popen(command, env=env, pass_fds=child_fds)
            for fd in child_fds:
                os.close(fd)
            os.set_blocking(beat_read, False)
            os.set_blocking(plan_write, False)  # `_send` never blocks on a rank
            rank = _Rank(index, process, plan_write, answer_read, beat_read, time.monotonic())
            self._ranks.append(rank)

    def _send_all(self, frame: bytes) -> None:
        for rank in self._ranks:
            self._send(rank, frame)

    def _send(self, rank: _Rank, frame: bytes) -> None:
        """Writes the frame into the rank's pipe (non-blocking), checking every `POLL_S` that
        every rank is alive: a rank that stopped reading (SIGSTOP, wedged) cannot block the
        batcher on a frame larger than the pipe."""
        view = memoryview(frame)
        deadline = time.monotonic() + self.config.step_timeout_s
        while view:
            if time.monotonic() >= deadline:
                timeout_s = self.config.step_timeout_s
                raise WorkerLostError(
                    f"rank {rank.rank} did not read its plan within {timeout_s} s"
                )
            try:
                if select.select([], [rank.to_rank], [], POLL_S)[1]:
                    view = view[os.write(rank.to_rank, view) :]
                    continue
            except BlockingIOError:
                pass
            except OSError as error:  # its end closed: it died
                raise WorkerLostError(f"rank {rank.rank} is gone ({error})") from error
            self._check_alive()

    def _expect(self, rank: _Rank, kind: str, timeout_s: float) -> dict[str, Any]:
        message = self._answer(rank, timeout_s)
        if message["type"] != kind:
            raise WorkerLostError(f"rank {rank.rank} answered {message!r}, not {kind!r}")
        return message

    def _answer(self, rank: _Rank, timeout_s: float | None = None) -> dict[str, Any]:
        """The rank's next message, checking every `POLL_S` that no rank died meanwhile."""
        timeout_s = timeout_s or self.config.step_timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                message = protocol.read(rank.from_rank, POLL_S)
            except protocol.PipeClosedError as error:
                raise WorkerLostError(self._describe_loss(rank)) from error
            if message is not None:
                rank.last_beat, rank.has_beaten = time.monotonic(), True  # as good as a beat
                return message
            self._check_alive()
        raise WorkerLostError(f"rank {rank.rank} did not answer within {timeout_s} s (hung)")

    def _check_alive(self) -> None:
        now = time.monotonic()
        for rank in self._ranks:
            code = rank.process.poll()
            if code is not None:
                raise WorkerLostError(f"rank {rank.rank} exited with code {code}")
            try:
                if os.read(rank.beats, 4096):
                    rank.last_beat, rank.has_beaten = now, True
            except BlockingIOError:
                pass
            silent_s = now - rank.last_beat
            limit_s = self.config.hang_timeout_s if rank.has_beaten else self.config.start_timeout_s
            if silent_s > limit_s:
                raise WorkerLostError(f"rank {rank.rank} hung: no heartbeat for {silent_s:.1f} s")

    def _describe_loss(self, rank: _Rank) -> str:
        try:
            code = rank.process.wait(1.0)
        except subprocess.TimeoutExpired:
            return f"rank {rank.rank} closed its pipe"
        return f"rank {rank.rank} exited with code {code}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
