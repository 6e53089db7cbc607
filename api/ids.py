"""Ids of jobs and of their requests. A request id is `"{job_id}.{item_index}"`, so a final
result names its row without a lookup."""

from __future__ import annotations

import secrets


def new_job_id() -> str:
    return f"job_{secrets.token_hex(16)}"


def request_id_of(job_id: str, item_index: int) -> str:
    return f"{job_id}.{item_index}"


def parse_request_id(request_id: str) -> tuple[str, int] | None:
    job_id, _, index = request_id.rpartition(".")
    if not job_id.startswith("job_") or not index.isdigit():
        return None
    return job_id, int(index)
