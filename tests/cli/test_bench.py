"""`tgq bench`: the metrics on synthetic timings, the arrivals, the datasets and the stream
parsing on their own (canned SSE bodies through httpx's mock transport); then the command against
a real tgq (Postgres, Redis, a batcher process, the api process) on each backend."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.stack import Stack, running_stack
from tgq.cli import CommandError
from tgq.cli.bench.backends import sse_data
from tgq.cli.bench.datasets import Prompt, Words, build_prompts, load_tokenizer
from tgq.cli.bench.load import poisson_arrivals, send
from tgq.cli.bench.records import RequestRecord, RequestTimer, StreamEvent
from tgq.cli.bench.report import parse_slos, stats_ms, summarize, throughput_over_time
from tgq.cli.main import build_parser, main

pytestmark = pytest.mark.timeout(180)
TOKEN = StreamEvent(is_token=True)


def timed(
    sent_at: float,
    token_times: list[float],
    end: float,
    num_output_tokens: int | None = None,
    num_prompt_tokens: int | None = None,
) -> RequestRecord:
    """A record from tokens at `token_times`, then a final event with the server's counts."""
    timer = RequestTimer(0, sent_at, run_started_at=0.0, prompt_tokens=10)
    for at in token_times:
        timer.add(at, TOKEN)
    counts = StreamEvent(
        is_final=True, num_output_tokens=num_output_tokens, num_prompt_tokens=num_prompt_tokens
    )
    timer.add(end, counts)
    return timer.finish(end, 200)


# --- metrics ----------------------------------------------------------------------------------


def test_percentiles_interpolate_as_numpy_and_are_in_ms() -> None:
    stats = stats_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)
    assert stats_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_ttft_itl_e2e_and_tpot_from_chunk_times() -> None:
    record = timed(10.0, [10.2, 10.25, 10.35], end=10.4)
    assert record.is_ok
    assert record.ttft_s == pytest.approx(0.2)
    assert record.itl_s == pytest.approx([0.05, 0.1])
    assert record.e2e_s == pytest.approx(0.4)
    assert (record.output_tokens, record.output_tokens_from) == (3, "chunks")
    assert record.tpot_s == pytest.approx((0.4 - 0.2) / 2)


def test_the_servers_token_count_wins_over_the_chunks() -> None:
    record = timed(0.0, [0.1, 0.2], end=0.3, num_output_tokens=5, num_prompt_tokens=42)
    assert (record.output_tokens, record.output_tokens_from, record.prompt_tokens) == (
        5,
        "server",
        42,
    )
    assert record.tpot_s == pytest.approx((0.3 - 0.1) / 4)


def test_one_output_token_has_no_tpot_but_meets_a_tpot_slo() -> None:
    single = timed(0.0, [0.1], end=0.1)
    assert single.tpot_s is None
    summary = summarize([single], duration_s=1.0, slos={"tpot": 0.001})
    assert summary["tpot_ms"]["p50"] is None
    assert summary["num_good"] == 1


def test_goodput_counts_completed_requests_within_every_slo() -> None:
    fast = timed(0.0, [0.1, 0.12], end=0.12)
    slow_first = timed(0.0, [0.6, 0.62], end=0.62)
    slow_decode = timed(0.0, [0.1, 0.5], end=0.5)  # TPOT 400 ms
    failed = RequestTimer(3, 0.0, 0.0, 10).finish(0.01, 429, '{"error":"overloaded"}')
    slos = parse_slos("ttft=500ms,tpot=50ms")
    summary = summarize([fast, slow_first, slow_decode, failed], duration_s=2.0, slos=slos)
    assert summary["num_good"] == 1
    assert summary["goodput"] == pytest.approx(0.5)
    assert summary["num_completed"] == 3
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_throughput"] == pytest.approx(3.0)  # 6 tokens in 2 s
    assert summary["total_token_throughput"] == pytest.approx(18.0)  # + 3 prompts of 10


def test_failures_are_counted_by_status_or_error_text() -> None:
    refused = [RequestTimer(i, 0.0, 0.0, 1).finish(0.01, 429, "slow down") for i in range(2)]
    timed_out = RequestTimer(2, 0.0, 0.0, 1).finish(5.0, None, "timed out after 5 s")
    cut = RequestTimer(3, 0.0, 0.0, 1)
    cut.add(0.1, TOKEN)
    summary = summarize([*refused, timed_out, cut.finish(0.2, 200)], 1.0, {})
    assert summary["failures"] == {
        "429": 2,
        "timed out after 5 s": 1,
        "the stream ended before its final event": 1,
    }
    assert summary["num_completed"] == 0
    assert summary["ttft_ms"]["mean"] is None


def test_itl_stats_pool_the_gaps_of_all_requests() -> None:
    records = [timed(0.0, [0.1, 0.11, 0.13], end=0.13), timed(0.0, [0.1, 0.14], end=0.14)]
    itl = summarize(records, 1.0, {})["itl_ms"]
    assert itl["mean"] == pytest.approx((10 + 20 + 40) / 3)
    assert itl["p50"] == pytest.approx(20)


def test_throughput_over_time_spreads_tokens_over_their_chunks() -> None:
    record = timed(0.0, [0.5, 1.5], end=1.5, num_output_tokens=6)  # two chunks of 3 tokens
    assert throughput_over_time([record]) == [3.0, 3.0]


def test_slos_parse_with_units_and_vllm_syntax() -> None:
    assert parse_slos("ttft=500ms,tpot=50ms,e2e=2s") == {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0}
    assert parse_slos("ttft:500 e2el:3000") == pytest.approx({"ttft": 0.5, "e2e": 3.0})
    for bad in ("ttft", "itl=5ms", "ttft=fast"):
        with pytest.raises(ValueError, match="expected"):
            parse_slos(bad)


# --- arrivals and datasets --------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_with_the_mean_rate() -> None:
    arrivals = poisson_arrivals(20_000, 50.0, random.Random(3))
    assert arrivals == poisson_arrivals(20_000, 50.0, random.Random(3))
    assert arrivals[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.05)  # exponential: sd = mean
    assert poisson_arrivals(3, float("inf"), random.Random(0)) == [0.0, 0.0, 0.0]


def dataset_args(**overrides: Any) -> argparse.Namespace:
    settings = {"dataset": "random", "input_len": 40, "output_len": 8, "range_ratio": 0.0}
    return argparse.Namespace(**(settings | {"prefix_len": 0, "num_groups": 1} | overrides))


@pytest.fixture(scope="module")
def words(text_model_dir: Path) -> Words:
    return Words(load_tokenizer(text_model_dir))


def test_random_prompts_have_exact_token_lengths(words: Words, text_model_dir: Path) -> None:
    tokenizer = load_tokenizer(text_model_dir / "tokenizer.json")
    args = dataset_args(range_ratio=0.5)
    prompts = build_prompts(words, args, 50, random.Random(0))
    for prompt in prompts:
        assert 20 <= prompt.num_tokens <= 60
        assert len(tokenizer.encode(prompt.text, add_special_tokens=False).ids) == prompt.num_tokens
        assert 4 <= prompt.output_len <= 12
    assert len({p.num_tokens for p in prompts}) > 10
    assert len({p.text for p in prompts}) == 50
    fixed = build_prompts(words, dataset_args(), 20, random.Random(0))
    assert {p.num_tokens for p in fixed} == {40}


def test_shared_prefix_groups_really_share_their_prefix(words: Words) -> None:
    args = dataset_args(dataset="shared-prefix", prefix_len=32, num_groups=3, input_len=8)
    prompts = build_prompts(words, args, 12, random.Random(1))
    assert {p.num_tokens for p in prompts} == {40}
    tokenizer = words.tokenizer
    assert tokenizer is not None
    ids = [tokenizer.encode(p.text, add_special_tokens=False).ids for p in prompts]
    for group in range(3):
        members = ids[group::3]
        assert len({tuple(m[:32]) for m in members}) == 1  # one prefix per group
        assert len({tuple(m[32:]) for m in members}) == len(members)  # unique suffixes
    assert len({tuple(m[:32]) for m in ids}) == 3


def test_without_a_tokenizer_lengths_are_words() -> None:
    prompts = build_prompts(Words(None), dataset_args(input_len=25), 5, random.Random(0))
    assert [len(p.text.split()) for p in prompts] == [25] * 5
    assert Words(None).unit == "words"


def test_jsonl_prompts_repeat_and_keep_their_output_len(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one two"}\n\n{"prompt": "three", "output_len": 3}\n')
    args = dataset_args(dataset="jsonl", dataset_path=path)
    prompts = build_prompts(Words(None), args, 3, random.Random(0))
    assert prompts == [Prompt("one two", 2, 8), Prompt("three", 1, 3), Prompt("one two", 2, 8)]
    path.write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    with pytest.raises(CommandError, match='prompt 2 has no string "prompt"'):
        build_prompts(Words(None), args, 1, random.Random(0))


# --- streams ----------------------------------------------------------------------------------


def sse(*events: Any) -> bytes:
    """A stream as tgq writes it, with a keep-alive comment in the middle."""
    body = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    body.insert(1, ": \n\n")
    return "".join(body).encode()


def chat_chunk(content: str | None = None, **fields: Any) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}], **fields}


CHAT = sse(
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    chat_chunk("Hel"),
    chat_chunk("lo"),
    chat_chunk(" you"),
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
    {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}},
    "[DONE]",
)
COMPLETIONS = sse(
    {"choices": [{"index": 0, "text": "a"}]},
    {"choices": [{"index": 0, "text": " b"}]},
    {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
    "[DONE]",
)


def tgi_event(index: int, text: str, **last: Any) -> dict[str, Any]:
    token = {"id": index, "text": text, "logprob": -0.5, "special": False}
    return {"index": index, "token": token, "generated_text": None, "details": None, **last}


TGI = sse(
    tgi_event(1, "x"),
    tgi_event(2, "y"),
    tgi_event(
        3,
        "z",
        generated_text="xyz",
        details={"finish_reason": "length", "generated_tokens": 3, "input_length": 5},
    ),
)


def bench_args(backend: str, **overrides: Any) -> argparse.Namespace:
    settings = {"backend": backend, "model": None, "ignore_eos": False, "timeout_s": 5.0}
    return argparse.Namespace(**(settings | overrides))


def post(
    backend: str, status: int, body: bytes, **overrides: Any
) -> tuple[RequestRecord, dict[str, Any]]:
    """The record of one request `send` makes to a server that answers `status` and `body`,
    and the body the server got."""
    seen: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(status, content=body)

    async def run() -> RequestRecord:
        transport = httpx.MockTransport(answer)
        async with httpx.AsyncClient(transport=transport, base_url="http://tgq") as client:
            return await send(client, bench_args(backend, **overrides), Prompt("hi", 1, 4), 0, 0.0)

    record = asyncio.run(run())
    return record, seen[0]


@pytest.mark.parametrize(
    ("backend", "body", "num_chunks", "num_output", "num_prompt"),
    [
        ("openai-chat", CHAT, 3, 4, 7),  # the role chunk and the finish chunk carry no content
        ("openai-completions", COMPLETIONS, 2, 2, 3),
        ("tgi", TGI, 3, 3, 5),
    ],
)
def test_streams_of_each_backend_are_timed_per_content_chunk(
    backend: str, body: bytes, num_chunks: int, num_output: int, num_prompt: int
) -> None:
    record, _ = post(backend, 200, body)
    assert record.is_ok, record.error
    assert (record.status, record.output_tokens_from) == (200, "server")
    assert (record.output_tokens, record.prompt_tokens) == (num_output, num_prompt)
    assert len(record.itl_s) == num_chunks - 1
    assert record.ttft_s is not None and record.e2e_s is not None
    assert 0 < record.ttft_s <= record.e2e_s


def test_request_bodies_ask_for_usage_and_ignore_eos_only_when_told() -> None:
    _, chat = post("openai-chat", 200, CHAT, model="m")
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["stream_options"] == {"include_usage": True}
    assert (chat["model"], chat["max_tokens"], "ignore_eos" in chat) == ("m", 4, False)
    _, tgi = post("tgi", 200, TGI, ignore_eos=True)
    assert tgi == {
        "inputs": "hi",
        "parameters": {
            "max_new_tokens": 4,
            "do_sample": False,
            "details": True,
            "ignore_eos": True,
        },
    }


def test_refusals_and_broken_streams_are_failures() -> None:
    overloaded = '{"error":"Model is overloaded","error_type":"overloaded"}'
    refused, _ = post("tgi", 429, overloaded.encode())
    assert (refused.status, refused.error) == (429, overloaded)
    generation_error = {"error": "boom", "error_type": "generation"}
    in_stream, _ = post("tgi", 200, sse(tgi_event(1, "x"), generation_error))
    assert (in_stream.status, in_stream.error) == (200, "boom")
    openai_error, _ = post("openai-completions", 200, sse({"error": {"message": "bad"}}))
    assert openai_error.error == "bad"
    no_done, _ = post("openai-completions", 200, COMPLETIONS.removesuffix(b"data: [DONE]\n\n"))
    assert no_done.error == "the stream ended before its final event"
    garbage, _ = post("tgi", 200, b"data: not json\n\n")
    assert garbage.error is not None and garbage.error.startswith("JSONDecodeError")


def test_sse_events_join_data_lines_and_skip_comments() -> None:
    lines = ["data: a", "", ": keep-alive", "", "data:b", "data: c", "event: x", "", "data: d"]

    async def collect() -> list[str]:
        async def source() -> Any:
            for line in lines:
                yield line

        return [data async for data in sse_data(source())]

    assert asyncio.run(collect()) == ["a", "b\nc", "d"]


# --- the command ------------------------------------------------------------------------------


def test_flags_fall_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_NUM_PROMPTS", "7")
    monkeypatch.setenv("BENCH_IGNORE_EOS", "true")
    monkeypatch.setenv("BENCH_SLO", "ttft=1s")
    args = build_parser().parse_args(["--url", "http://a", "bench", "--concurrency", "2"])
    assert (args.num_prompts, args.ignore_eos, args.url) == (7, True, "http://a")
    assert args.slo == {"ttft": 1.0}
    args = build_parser().parse_args(["bench", "--url", "http://b", "--api-key", "k"])
    assert (args.url, args.api_key, args.concurrency) == ("http://b", "k", None)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "--num-prompts", "1"]) == 2
    assert "give --concurrency C" in capsys.readouterr().err
    assert main(["bench", "--concurrency", "1", "--dataset", "jsonl"]) == 2
    assert "--dataset jsonl needs --dataset-path" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--concurrency", "1", "--slo", "ttft=soon"])
    assert exited.value.code == 2


# --- against a real tgq -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(text_model_dir, tmp_path_factory.mktemp("bench-logs")) as running:
        yield running


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


@pytest.mark.parametrize(
    ("backend", "dataset"),
    [("openai-chat", "shared-prefix"), ("openai-completions", "random"), ("tgi", "jsonl")],
)
def test_bench_against_a_running_tgq(
    server: Stack,
    text_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    backend: str,
    dataset: str,
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def main():"}\n{"prompt": "import os", "output_len": 6}\n')
    argv = [
        "--url", server.url, "bench", "--backend", backend, "--dataset", dataset,
        "--dataset-path", str(prompts), "--tokenizer", str(text_model_dir),
        "--num-prompts", "6", "--concurrency", "3", "--warmup", "1",
        "--input-len", "24", "--output-len", "8", "--prefix-len", "32", "--num-groups", "2",
        "--ignore-eos", "--slo", "ttft=30s,e2e=60s", "--fail-on-error",
        "--output-json", str(tmp_path / "run.json"), "--plot-dir", str(tmp_path / "plots"),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "6 completed, 0 failed" in printed
    result = json.loads((tmp_path / "run.json").read_text())
    summary, records = result["summary"], result["requests"]
    assert (summary["num_completed"], summary["num_failed"], len(records)) == (6, 0, 6)
    assert summary["num_good"] == 6
    expected = [8, 6] * 3 if dataset == "jsonl" else [8] * 6
    assert [r["output_tokens"] for r in records] == expected
    for record in records:
        assert record["output_tokens_from"] == "server"
        assert record["prompt_tokens"] > 0
        assert 0 < record["ttft_s"] <= record["e2e_s"]
        assert len(record["itl_s"]) >= 1
    assert summary["output_throughput"] > 0
    assert result["config"]["length_unit"] == "tokens"
    assert "api_key" not in result["config"]
    for name in ("latency_cdf.png", "throughput.png"):
        assert png_size(tmp_path / "plots" / name) == (800, 500)


def test_bench_counts_refusals_by_status(server: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--url", f"{server.url}/nowhere", "bench", "--backend", "tgi", "--num-prompts", "3"]
    assert main([*argv, "--request-rate", "50", "--input-len", "4", "--fail-on-error"]) == 1
    printed = capsys.readouterr().out
    assert "0 completed, 3 failed" in printed
    assert "404: 3" in printed
