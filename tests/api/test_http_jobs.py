"""Durable jobs through real HTTP (api process, Postgres, Redis, batcher process): accept → poll
→ results; list and filter; cancel while running (blocks freed); events that resume with
`Last-Event-ID`, also from another api process; one execution per `Idempotency-Key`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api.stack import REDIS_URL, Stack
from tgq.batcher.transport.blocking import BlockingApiTransport

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.url, timeout=60)


@pytest.fixture
def transport(stack: Stack) -> Iterator[BlockingApiTransport]:
    """The api's side of the stack's Redis, as a test watching it from outside."""
    with BlockingApiTransport.from_url(REDIS_URL, stack.prefix) as transport:
        yield transport


def wait_for(client: httpx.Client, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} did not finish")


def parse_events(raw: str) -> list[dict[str, Any]]:
    events = []
    for block in raw.strip("\n").split("\n\n"):
        fields: dict[str, Any] = {}
        for line in block.split("\n"):
            if line.startswith(":"):
                continue
            name, _, value = line.partition(": ")
            fields[name] = value
        if fields:
            fields["data"] = json.loads(fields["data"])
            events.append(fields)
    return events


def test_post_poll_results(client: httpx.Client) -> None:
    body = {
        "prompt": ["one", "two", "three"],
        "parameters": {"max_new_tokens": 5, "ignore_eos": True},
    }
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["status"] == "queued" and job["progress"] == {"total": 3, "done": 0, "failed": 0}
    assert job["request_ids"] == [f"{job['id']}.{i}" for i in range(3)]
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    done = wait_for(client, job["id"])
    assert done["status"] == "succeeded"
    assert done["progress"] == {"total": 3, "done": 3, "failed": 0}
    assert [r["index"] for r in done["results"]] == [0, 1, 2]
    assert all(r["completion_tokens"] == 5 and r["status"] == "succeeded" for r in done["results"])
    assert done["usage"]["completion_tokens"] == 15
    assert done["timings"]["total_s"] >= done["timings"]["run_s"] >= 0


def test_list_and_filter(client: httpx.Client) -> None:
    ids = [
        client.post(
            "/v1/jobs", json={"prompt": f"p{i}", "parameters": {"max_new_tokens": 2}}
        ).json()["id"]
        for i in range(3)
    ]
    for job_id in ids:
        wait_for(client, job_id)
    page = client.get("/v1/jobs", params={"limit": 2, "status": "succeeded"}).json()
    assert page["object"] == "list" and len(page["data"]) == 2 and page["has_more"]
    assert [j["id"] for j in page["data"]] == ids[::-1][:2]  # newest first
    rest = client.get("/v1/jobs", params={"limit": 2, "after": page["last_id"]}).json()
    assert rest["data"][0]["id"] == ids[0]
    assert client.get("/v1/jobs", params={"status": "cancelled"}).json()["data"] == []
    bad = client.get("/v1/jobs", params={"status": "nope"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "status"


def test_cancel_a_running_job_frees_its_blocks(
    client: httpx.Client, transport: BlockingApiTransport
) -> None:
    free_before = max(b.num_free_blocks for b in transport.live_batchers())
    params = {"max_new_tokens": 900, "ignore_eos": True}
    job = client.post(
        "/v1/jobs", json={"prompt": ["long a", "long b"], "parameters": params}
    ).json()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # running: its tokens are flowing
        if transport.read_tokens(job["request_ids"][0], 0, 0.5):
            break
    deadline = time.monotonic() + 10
    while client.get(f"/v1/jobs/{job['id']}").json()["status"] != "running":
        assert time.monotonic() < deadline, "a job whose tokens flow is not shown running"
        time.sleep(0.05)
    running = client.get(f"/v1/jobs/{job['id']}").json()
    assert running["started_at"] is not None and running["progress"]["done"] == 0
    cancelled = client.delete(f"/v1/jobs/{job['id']}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        beats = transport.live_batchers()
        if all(b.num_running == 0 for b in beats):
            break
        time.sleep(0.1)
    assert all(b.num_running == 0 for b in transport.live_batchers())
    assert max(b.num_free_blocks for b in transport.live_batchers()) >= free_before - 2
    final = wait_for(client, job["id"])
    assert final["status"] == "cancelled"
    again = client.delete(f"/v1/jobs/{job['id']}")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    assert client.delete("/v1/jobs/job_nope").status_code == 404


def test_events_resume_with_last_event_id(client: httpx.Client, stack: Stack) -> None:
    body = {"prompt": ["first", "second"], "parameters": {"max_new_tokens": 6, "ignore_eos": True}}
    job = client.post("/v1/jobs", json=body).json()
    everything = parse_events(client.get(f"/v1/jobs/{job['id']}/events").text)
    kinds = [e["event"] for e in everything]
    assert kinds == ["token"] * 6 + ["result"] + ["token"] * 6 + ["result", "done"]
    assert [e["id"] for e in everything[:7]] == [f"0.{s}" for s in range(6)] + ["0.r"]
    assert everything[-1]["data"]["status"] == "succeeded"
    text = "".join(e["data"]["text"] for e in everything[:6])
    assert everything[6]["data"]["text"] == text
    for cut in (3, 7, 9):  # mid-item, right after a result, inside the second item
        headers = {"Last-Event-ID": everything[cut - 1]["id"]}
        rest = parse_events(client.get(f"/v1/jobs/{job['id']}/events", headers=headers).text)
        assert [(e["event"], e["id"]) for e in rest] == [
            (e["event"], e["id"]) for e in everything[cut:]
        ]
    bad = client.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": "x"})
    assert bad.status_code == 422


def test_events_continue_on_another_api_process(client: httpx.Client, stack: Stack) -> None:
    body = {"prompt": "resume elsewhere", "parameters": {"max_new_tokens": 40, "ignore_eos": True}}
    job = client.post("/v1/jobs", json=body).json()
    seen = []
    with client.stream("GET", f"/v1/jobs/{job['id']}/events") as response:
        for line in response.iter_lines():
            if line.startswith("id: "):
                seen.append(line[4:])
                if len(seen) == 5:
                    break  # the client goes away: the job goes on
    second = Stack(
        stack.model_dir, stack.database_url, stack.log_dir, prefix=stack.prefix, name="api2"
    )
    second.start_api()
    try:
        headers = {"Last-Event-ID": seen[-1]}
        url = f"{second.url}/v1/jobs/{job['id']}/events"
        rest = parse_events(httpx.get(url, headers=headers, timeout=60).text)
    finally:
        if second.api is not None:
            second.api.terminate()
            second.api.wait(30)
    assert rest[0]["id"] == "0.5"
    assert [e["event"] for e in rest][-2:] == ["result", "done"]
    assert len([e for e in rest if e["event"] == "token"]) == 40 - 5
    assert rest[-1]["data"]["status"] == "succeeded"


def test_idempotency_key_gives_one_job_and_one_execution(client: httpx.Client) -> None:
    body = {"prompt": "once", "parameters": {"max_new_tokens": 3, "ignore_eos": True}}
    headers = {"Idempotency-Key": f"key-{time.time_ns()}"}
    first = client.post("/v1/jobs", json=body, headers=headers)
    second = client.post("/v1/jobs", json=body, headers=headers)
    assert (first.status_code, second.status_code) == (202, 200)
    assert first.json()["id"] == second.json()["id"]
    other = client.post("/v1/jobs", json={**body, "prompt": "different"}, headers=headers)
    assert other.status_code == 422
    assert "different request body" in other.json()["error"]["message"]
    done = wait_for(client, first.json()["id"])
    assert done["progress"]["done"] == 1 and len(done["results"]) == 1
    assert done["results"][0]["completion_tokens"] == 3


def test_job_validation(client: httpx.Client) -> None:
    cases = [
        ({"prompt": []}, "`prompt` cannot be an empty list"),
        ({"prompt": ""}, "`inputs` cannot be empty"),
        (
            {"prompt": "x", "parameters": {"best_of": 2, "do_sample": True}},
            "not supported for jobs",
        ),
        ({"prompt": "x", "priority": "urgent"}, "priority"),
        ({"prompt": "x", "parameters": {"max_new_tokens": 5000}}, "must be <= 1024"),
    ]
    for body, message in cases:
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 422, (body, response.text)
        assert message in response.json()["error"]["message"], (body, response.text)
    assert client.get("/v1/jobs/job_missing").status_code == 404
