"""What the batcher and its rank processes say to each other (torch-free: the batcher imports
it). One pipe each way per rank; each message is a 4-byte little-endian length and a JSON
object with a `type`. Nothing is pickled.

    rank -> batcher   {"type": "ready", "num_blocks": N,       loaded; N = KV blocks that fit,
                       "block_size": B}                        B = its backend's block size
    batcher -> rank   {"type": "allocate", "num_blocks": M}    M = the minimum over the ranks
    rank -> batcher   {"type": "allocated"}
    batcher -> rank   {"type": "step", "plan": {...}}          the same plan to every rank
    rank -> batcher   {"type": "result", "result": {"sampled": [...],  rank 0 (others: "done")
                                                  "prompt_logprobs": [...]}}
    rank -> batcher   {"type": "error", "message": "..."}      the step failed on that rank

A third pipe carries a rank's heartbeat: a byte every `HEARTBEAT_S`, from a thread of its own.
A rank exits when its pipe from the batcher closes (the batcher stopped or died).
"""

from __future__ import annotations

import json
import os
import select
import struct
from typing import Any

from tgq.gpu_worker.plan import PromptLogprobs, SampledToken, StepResult, TokenLogprob

_LENGTH = struct.Struct("<I")
MAX_MESSAGE_BYTES = 1 << 30
HEARTBEAT_S = 0.5


class PipeClosedError(EOFError):
    """The other end closed its pipe (it exited)."""


def encode(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return _LENGTH.pack(len(data)) + data


def write(fd: int, frame: bytes) -> None:
    view = memoryview(frame)
    while view:
        view = view[os.write(fd, view) :]


def read(fd: int, timeout_s: float | None = None) -> dict[str, Any] | None:
    """The next message; None if none started within `timeout_s` (None: wait for it)."""
    if timeout_s is not None and not select.select([fd], [], [], timeout_s)[0]:
        return None
    (length,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size))
    if length > MAX_MESSAGE_BYTES:
        raise ValueError(f"a rank message of {length} bytes")
    message: dict[str, Any] = json.loads(_read_exactly(fd, length))
    return message


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = os.read(fd, remaining)
        if not chunk:
            raise PipeClosedError("the pipe closed")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def result_to_wire(result: StepResult) -> dict[str, list[list[Any]]]:
    def pairs(tops: list[TokenLogprob]) -> list[list[Any]]:
        return [[t.token_id, t.logprob] for t in tops]

    return {
        "sampled": [
            [s.request_id, s.token_id, s.logprob, pairs(s.top_logprobs)] for s in result.sampled
        ],
        "prompt_logprobs": [
            [p.request_id, p.start, p.logprobs, [pairs(tops) for tops in p.top_logprobs], p.ranks]
            for p in result.prompt_logprobs
        ],
    }


def result_from_wire(wire: dict[str, list[list[Any]]]) -> StepResult:
    def tokens(pairs: list[list[Any]]) -> list[TokenLogprob]:
        return [TokenLogprob(t, lp) for t, lp in pairs]

    return StepResult(
        [
            SampledToken(request_id, token_id, logprob, tokens(top))
            for request_id, token_id, logprob, top in wire["sampled"]
        ],
        [
            PromptLogprobs(
                request_id, start, list(logprobs), [tokens(t) for t in tops], list(ranks)
            )
            for request_id, start, logprobs, tops, ranks in wire["prompt_logprobs"]
        ],
    )
