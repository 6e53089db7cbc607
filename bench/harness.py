"""What the benchmarks share, so that no bench script imports another: where results go,
percentiles, the random workloads, the models they run, tgq's offline engine as the baseline,
and the real stack (`tests/api/stack.py`'s, sized for a benchmark).

Models (random bf16 weights, written once under `--cache`):
- `medium_llama_2k`: the medium Llama shape with its own 2,048 positions (engine, TP);
- `medium_llama_4k`: the same shape with 4,096 positions, room for the scheduler benchmark's
  2,080-token prefix-replay prompts (scheduler, transport);
- `chat_llama`: a shape whose vocabulary is a tokenizer trained on Python's bundled docs, with
  a ChatML-like chat template, 4,096 positions (HTTP, batch).
"""

from __future__ import annotations

import argparse
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from tests.api.stack import Stack
from tgq.api.chat_template import ChatTemplate
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.detokenize import HFTokenDecoder
from tgq.batcher.engine import LLMEngine
from tgq.batcher.offline import OfflineEngine
from tgq.batcher.request import StoppingParams
from tgq.devtools.demo import add_chat_template
from tgq.devtools.random_model import make_config, write_model
from tgq.devtools.tokenizer import train_tokenizer
from tgq.gpu_worker.config import model_eos_token_ids
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig
from tgq.kernels.choice import cpu_key

RESULTS = Path(__file__).parent / "results"
VOCAB = 32000  # the medium shape's
NUM_BLOCKS = 4096  # KV blocks of the benchmarks' runners and batchers
BLOCK_SIZE = 16


def machine(runner: ModelRunner | None = None) -> dict[str, Any]:
    """The CPU the figures come from (model, the flags that decide the kernels, threads, torch)
    and, with `runner`, the kernels picked on it per call size (kernels.choice): figures from
    different machines are never compared by accident."""
    info: dict[str, Any] = cpu_key()
    if runner is not None:
        picks = {}
        if (linears := runner.loaded.model.kernel_choices) is not None:
            picks["linear"] = linears.summary("linear")
        head = runner.loaded.model.greedy_head
        if head is not None and head.choices is not None:
            picks["greedy_head"] = head.choices.summary("greedy_head")
        for op in ("decode_attention", "prefill_attention"):
            if choices := getattr(runner.backend, op.replace("_attention", "_choices"), None):
                picks[op] = choices.summary(op)
        info["kernels"] = picks
    return info


def print_machine(info: dict[str, Any]) -> None:
    print(f"CPU: {info['cpu']} ({' '.join(info['flags'])}), {info['threads']} threads")
    for op, summary in info.get("kernels", {}).items():
        print(f"kernels for {op}: {summary}")


def write_results(
    name: str, args: argparse.Namespace, results: dict[str, Any], runner: ModelRunner | None = None
) -> None:
    """`bench/results/<name>.json`: the run's arguments, the machine (`machine`) and its results;
    the machine is printed too."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    info = machine(runner)
    record = {"args": vars(args), "machine": info, "results": results}
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2, default=str))  # Paths
    print_machine(info)


async def sse_chunks(response: Any, what: str) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an aiohttp streaming response (server-sent events, one `data:` line
    each, `[DONE]` skipped); a non-200 answer or an error chunk raises, naming `what`."""
    if response.status != 200:
        raise RuntimeError(f"{what}: {response.status} {await response.text()}")
    async for line in response.content:  # one SSE line at a time
        if not line.startswith(b"data: {"):
            continue
        chunk: dict[str, Any] = json.loads(line.removeprefix(b"data: "))
        if "error" in chunk:
            raise RuntimeError(f"{what} stream: {chunk['error']}")
        yield chunk


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files (the Agg backend), imported only when a benchmark
    plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_panel(ax: Any, title: str, names: list[str], values: list[float], fmt: str) -> None:
    """One panel of a benchmark's bar chart: baseline grey, tgq blue, values on the bars."""
    drawn = ax.bar(names, values, color=["#999999", "#1f77b4"])
    ax.bar_label(drawn, fmt=fmt, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=8)


def save_figure(fig: Any, title: str, path: Path) -> None:
    """Titled, into `path` (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * fraction))]


# --- workloads ----------------------------------------------------------------------------------

Workload = list[tuple[list[int], int]]  # (prompt, number of output tokens)


def random_workload(
    count: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], seed: int
) -> Workload:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, VOCAB) for _ in range(rng.randint(*prompt_lens))],
            rng.randint(*output_lens),
        )
        for _ in range(count)
    ]


def random_prompts(batch: int, length: int, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """`batch` prompts of `length` tokens below `vocab`, the same for the same arguments."""
    gen = torch.Generator().manual_seed(batch * 1000 + length + seed * 1_000_003)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


# --- models -------------------------------------------------------------------------------------


def medium_llama_2k(cache: Path) -> Path:
    path = cache / "medium-llama-bf16-2k"  # not chat_llama's "medium-llama-bf16": no tokenizer
    if not (path / "model.safetensors").is_file():  # written last: its presence means complete
        config = make_config("LlamaForCausalLM", "medium", dtype="bfloat16")
        write_model(path, config, dtype=torch.bfloat16)
    return path


def medium_llama_4k(cache: Path) -> Path:
    path = cache / "medium-llama-bf16-4k"
    if not (path / "model.safetensors").is_file():
        config = make_config(
            "LlamaForCausalLM", "medium", dtype="bfloat16", max_position_embeddings=4096
        )
        write_model(path, config, dtype=torch.bfloat16)
    return path


def chat_llama(cache: Path, shape: str, architecture: str = "LlamaForCausalLM") -> Path:
    """The shape with a trained tokenizer's vocabulary (the bundled corpus yields ~9k tokens);
    `architecture` another family of that shape (random weights, the same tokenizer)."""
    family = make_config(architecture)["model_type"]
    path = cache / f"{shape}-{family}-bf16"
    if not (path / "model.safetensors").is_file():
        train_tokenizer(path, vocab_size=32000)
        add_chat_template(path)
        vocab_size = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
        config = make_config(
            architecture,
            shape,
            dtype="bfloat16",
            vocab_size=vocab_size,
            max_position_embeddings=4096,
        )
        write_model(path, config, dtype=torch.bfloat16)
    return path


# --- the offline engine on token workloads ------------------------------------------------------


class TgqOffline:
    """tgq's offline engine on one model runner: a workload all at once, or one prompt's TTFT."""

    def __init__(self, model_dir: Path, num_blocks: int) -> None:
        self.runner = ModelRunner(
            RunnerConfig(str(model_dir), num_blocks=num_blocks, block_size=BLOCK_SIZE)
        )

    def engine(self, *, prefix_cache: bool = True) -> LLMEngine:
        return LLMEngine(self.runner, SchedulerConfig(enable_prefix_cache=prefix_cache))

    def run(self, workload: Workload, *, prefix_cache: bool = True) -> dict[str, float]:
        """Tokens/s over the whole workload, and the mean KV waste once none waits."""
        engine = self.engine(prefix_cache=prefix_cache)
        for prompt, num_out in workload:
            engine.add_request(
                prompt, stopping=StoppingParams(max_new_tokens=num_out, ignore_eos=True)
            )
        wastes = []
        start = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
            scheduler = engine.scheduler
            if not scheduler.waiting and scheduler.running:  # every request admitted
                wastes.append(kv_waste(engine))
        seconds = time.perf_counter() - start
        return {
            "tok_s": sum(num_out for _, num_out in workload) / seconds,
            "kv_waste": sum(wastes) / len(wastes) if wastes else float("nan"),
        }

    def ttft(self, engine: LLMEngine, prompt: list[int]) -> float:
        start = time.perf_counter()
        request_id = engine.add_request(
            prompt, stopping=StoppingParams(max_new_tokens=2, ignore_eos=True)
        )
        while not any(out.request_id == request_id and out.new_token_ids for out in engine.step()):
            pass
        seconds = time.perf_counter() - start
        while engine.has_unfinished:
            engine.step()
        return seconds


def kv_waste(engine: LLMEngine) -> float:
    """Allocated slots that hold no token yet, over allocated slots, across running requests."""
    block_size = engine.runner.block_size
    running = engine.scheduler.running
    allocated = sum(len(request.block_ids) for request in running) * block_size
    used = sum(request.num_computed_tokens for request in running)
    return (allocated - used) / allocated if allocated else 0.0


# --- chat workloads and their offline runs ------------------------------------------------------


@dataclass(frozen=True)
class ChatCase:
    content: str  # the user message
    prompt_ids: list[int]  # the rendered chat prompt, tokenized as the api does
    num_out: int


def chat_cases(model_dir: Path, count: int, seed: int, text_seed: int) -> list[ChatCase]:
    """The mixed workload's lengths (seed 1 is the other benches'), as chat messages."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = ChatTemplate.from_model_dir(model_dir)
    rng = random.Random(text_seed)
    vocab_size = tokenizer.get_vocab_size()

    def prompt_ids(content: str) -> list[int]:
        prompt = template.render([{"role": "user", "content": content}])
        ids: list[int] = tokenizer.encode(prompt, add_special_tokens=False).ids
        return ids

    cases = []
    for prompt, num_out in random_workload(count, (32, 512), (16, 256), seed):
        ids = [rng.randrange(3, vocab_size) for _ in range(2 * len(prompt))]
        long_text = tokenizer.decode(ids, skip_special_tokens=True)
        content = longest_prefix(long_text, lambda t: len(prompt_ids(t)), len(prompt))
        cases.append(ChatCase(content, prompt_ids(content), num_out))
    return cases


def longest_prefix(long_text: str, num_tokens: Callable[[str], int], limit: int) -> str:
    """The longest prefix of at most `limit` tokens, by binary search over characters (token
    counts grow with the prefix, nearly monotonically)."""
    low, high = 1, len(long_text)
    while low < high:
        middle = (low + high + 1) // 2
        if num_tokens(long_text[:middle]) <= limit:
            low = middle
        else:
            high = middle - 1
    return long_text[:low]


@dataclass
class Trace:
    """One request's timeline (perf_counter seconds)."""

    start: float
    content_times: list[float] = field(default_factory=list)
    end: float = 0.0
    num_tokens: int = 0
    first_step: float = 0.0  # when the engine step that made the first token finished
    job_id: str = ""  # HTTP: the chat's job, whose item 0 is its engine request


@dataclass
class Run:
    tok_s: float
    traces: list[Trace]
    cpu_s: dict[str, float]  # CPU seconds per process during the run
    num_token_steps: int  # engine steps that produced at least one token


def run_offline(runner: ModelRunner, model_dir: Path, cases: list[ChatCase]) -> Run:
    """The offline engine, configured as `python -m tgq.batcher` is (tokenizer and EOS ids too)."""
    decoder = HFTokenDecoder.from_file(str(model_dir / "tokenizer.json"))
    engine = LLMEngine(runner, SchedulerConfig(), decoder, model_eos_token_ids(model_dir))
    cpu = time.process_time()
    start = time.perf_counter()
    traces = {
        engine.add_request(
            case.prompt_ids, stopping=StoppingParams(max_new_tokens=case.num_out, ignore_eos=True)
        ): Trace(start)
        for case in cases
    }
    num_token_steps = 0
    while engine.has_unfinished:
        outputs = engine.step()
        now = time.perf_counter()
        num_token_steps += any(output.new_token_ids for output in outputs)
        for output in outputs:
            trace = traces[output.request_id]
            if output.new_token_ids and not trace.num_tokens:
                trace.first_step = now
            trace.num_tokens += len(output.new_token_ids)
            if output.new_text:
                trace.content_times.append(now)
            if output.is_finished:
                trace.end = now
    cpu_s = {"engine": time.process_time() - cpu, "wall": time.perf_counter() - start}
    tok_s = tokens_per_second(start, list(traces.values()), cases)
    return Run(tok_s, list(traces.values()), cpu_s, num_token_steps)


def tokens_per_second(start: float, traces: list[Trace], cases: list[ChatCase]) -> float:
    for i, (trace, case) in enumerate(zip(traces, cases, strict=True)):
        if trace.num_tokens != case.num_out:
            raise RuntimeError(f"request {i}: {trace.num_tokens} tokens, expected {case.num_out}")
    return sum(t.num_tokens for t in traces) / (max(t.end for t in traces) - start)


# --- the stack ----------------------------------------------------------------------------------


def bench_stack(
    model_dir: Path, database_url: str, log_dir: Path, redis_url: str, threads: int, max_queued: int
) -> Stack:
    """The tests' stack sized for a benchmark: a batcher with `NUM_BLOCKS` and `threads` torch
    threads, otherwise its defaults (not the tests' small batches and quick timeouts); an api
    of one thread that admits 512 requests at once and queues `max_queued`."""
    api_env = {
        "MODEL_ID": "tgq-bench",
        "MAX_CONCURRENT_REQUESTS": "512",
        "MAX_QUEUED_REQUESTS": str(max_queued),
    }
    return Stack(
        model_dir,
        database_url,
        log_dir,
        prefix=f"bench-{uuid.uuid4().hex[:8]}",
        redis_url=redis_url,
        settings={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        batcher_sizing=("--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE)),
        batcher_env={"OMP_NUM_THREADS": str(threads)},
        api_env=api_env,
    )


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


Engines = dict[str, "HFEngine | TgqEngine"]


def best_interleaved(
    engines: Engines, sample: Callable[[Any, int], float], repeats: int
) -> dict[str, float]:
    """Each engine's fastest of `repeats` samples, taken in turns (transformers, tgq, transformers,
    ...) so that a slow phase of this noisy machine hits both alike. Interference only ever adds
    time, so the minimum is the most repeatable estimate."""
    best = {name: float("inf") for name in engines}
    for repeat in range(repeats):
        for name, engine in engines.items():
            best[name] = min(best[name], sample(engine, repeat))
    return best


def best_decode_step(
    engines: Engines, batch: list[list[int]], n1: int, n2: int, repeats: int
) -> dict[str, float]:
    """Each engine's seconds per decode step: (fastest run of n2 new tokens - fastest run of n1)
    / (n2 - n1), so the prompt's processing cancels out; the runs taken in turns, as in
    `best_interleaved`. The minimum of each length, not of each pair's difference: a pair whose
    shorter run a slow moment hit has a difference too small, and the minimum of differences
    picks exactly that pair (it once gave batch 64 at 45x transformers)."""
    best = {name: {n1: float("inf"), n2: float("inf")} for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            for n in (n2, n1):
                best[name][n] = min(best[name][n], timed(partial(engine.generate, batch, n)))
    return {name: (runs[n2] - runs[n1]) / (n2 - n1) for name, runs in best.items()}


class HFEngine:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        self.model.generation_config.eos_token_id = None

    def generate(self, batch: list[list[int]], num_new: int) -> None:
        ids = torch.tensor(batch)
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=num_new,
                pad_token_id=0,
            )

    def prefill(self, batch: list[list[int]]) -> None:
        with torch.inference_mode():
            self.model(torch.tensor(batch), logits_to_keep=1)


class TgqEngine:
    def __init__(
        self,
        model_dir: Path,
        backend: str,
        quantize: str | None = None,
        *,
        kv_cache_dtype: str = "auto",
        num_blocks: int = 2200,
        greedy_head: bool = True,
    ) -> None:
        self.runner = ModelRunner(
            RunnerConfig(
                str(model_dir),
                num_blocks=num_blocks,
                block_size=16,
                attention_backend=backend,
                quantize=quantize,
                kv_cache_dtype=kv_cache_dtype,
                greedy_head=greedy_head,
            )
        )
        self.engine = OfflineEngine(self.runner)

    def generate(self, batch: list[list[int]], num_new: int) -> None:
        self.engine.generate(batch, max_new_tokens=num_new)

    def prefill(self, batch: list[list[int]]) -> None:
        self.engine.generate(batch, max_new_tokens=1)
