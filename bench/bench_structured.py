"""Structured output benchmark: what a JSON schema costs a request, on a real vocabulary.

The medium Llama shape with the real Llama-3 tokenizer's 128,256-token vocabulary (mask work
grows with the vocabulary), random bf16 weights, CPU, 2 threads; the grammar engine is
llguidance (`batcher.grammar_compiler`). In one run, each comparison against its baseline taken
in turns (free, JSON, free, JSON, ...):

1. throughput: the mixed workload (64 requests, prompts 32..512, outputs 16..256, all at once),
   unconstrained vs every request under `WORKLOAD_SCHEMA` (compiled beforehand). EOS is not
   ignored: a request ends at its length, at EOS, or when its JSON is complete; tokens/s counts
   the tokens each run produced (both counts are printed). Greedy, and sampled (temperature
   0.8), where both ways compute every row's logits: what the grammar itself costs;
2. batch-1 decode: one request's per-step time p50, free vs under `LONG_TEXT_SCHEMA` (a 400-
   character string), greedy and sampled (temperature 0.8): the two requests run in two engines
   on one model (two KV caches), stepped in turns, so a slow moment of the machine hits both;
   the ratio is the median of the runs' (their spread is printed);
   plus a cProfile of one more run each way, batch 1 (greedy) and mixed: where a step's time goes;
3. compile: the 20 real-world `SCHEMAS`, cold (a fresh compiler: `compile()` to `take()`, the
   first mask included) and cached (`cached()`), and the one-off llguidance tokenizer build;
4. burst: 16 requests decoding, then 16 arrive at once, each with a schema never compiled (a
   fresh compiler): their TTFT, and the running requests' inter-token latency p99 while the
   burst is served (arrival to the burst's last first token), against a run without the burst
   and one whose burst carries no schema (what prefill alone costs them).

The weights are random: a constrained answer has the schema's shape and nonsense content (long
digit runs in numbers, repeated words in strings). A real model's answers spend their steps in
other grammar states, and what a mask costs depends on the state.

Prints one summary table and writes JSON and a PNG chart to bench/results/. `--quick`: fewer
requests and repetitions.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import itertools
import platform
import pstats
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FunctionType
from typing import Any, TypeVar, cast

import torch

from bench.harness import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    RESULTS,
    Workload,
    percentile,
    pyplot,
    random_prompts,
    random_workload,
    save_figure,
    write_results,
)
from bench.structured_schemas import BOOLEAN, LONG_TEXT_SCHEMA, SCHEMAS, WORKLOAD_SCHEMA
from tests.batcher.tokenizer_zoo import load
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.detokenize import HFTokenDecoder
from tgq.batcher.engine import GREEDY, LLMEngine
from tgq.batcher.grammar import GrammarSpec
from tgq.batcher.grammar_compiler import Constraint, GrammarCompiler
from tgq.batcher.request import StoppingParams
from tgq.devtools.random_model import make_config, write_model
from tgq.gpu_worker import sampling
from tgq.gpu_worker.config import model_eos_token_ids
from tgq.gpu_worker.models.decoder import DecoderForCausalLM
from tgq.gpu_worker.plan import SamplingParams
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

TRIVIAL = GrammarSpec.json_schema(BOOLEAN)  # a fresh compiler's first: builds its tokenizer


# --- the model and the engines ------------------------------------------------------------------

LLAMA3_BOS = 128000  # <|begin_of_text|>
LLAMA3_EOS = [128001, 128009]  # <|end_of_text|>, <|eot_id|>
T = TypeVar("T")


def llama3_medium(cache: Path) -> Path:
    """The medium shape with the real Llama-3 tokenizer beside it (fetched once, see
    `tests.batcher.tokenizer_zoo`): its vocabulary size and its BOS and EOS ids."""
    path = cache / "medium-llama3-bf16"
    if not (path / "model.safetensors").is_file():  # written last: its presence means complete
        tokenizer = load("llama3")
        path.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(path / "tokenizer.json"))
        config = make_config(
            "LlamaForCausalLM",
            "medium",
            dtype="bfloat16",
            vocab_size=tokenizer.get_vocab_size(),
            bos_token_id=LLAMA3_BOS,
            eos_token_id=LLAMA3_EOS,
        )
        write_model(path, config, dtype=torch.bfloat16)
    return path


@dataclass(frozen=True)
class Bench:
    """What every measurement shares: one model runner, the tokenizer, the EOS ids; and a twin
    runner on the same weights (its own KV cache) for runs stepped in turns with the first."""

    runner: ModelRunner
    twin: ModelRunner
    tokenizer_json: str
    decoder: HFTokenDecoder
    eos_token_ids: frozenset[int]

    @classmethod
    def load(cls, model_dir: Path) -> Bench:
        config = RunnerConfig(str(model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        tokenizer_path = model_dir / "tokenizer.json"
        runner = ModelRunner(config)
        return cls(
            runner,
            ModelRunner(config, runner.loaded),
            tokenizer_path.read_text(),
            HFTokenDecoder.from_file(str(tokenizer_path)),
            model_eos_token_ids(model_dir),
        )

    def engine(self, grammars: GrammarCompiler, *, twin: bool = False) -> LLMEngine:
        """A fresh engine, as `python -m tgq.batcher` configures one (on the shared runner)."""
        runner = self.twin if twin else self.runner
        return LLMEngine(runner, SchedulerConfig(), self.decoder, self.eos_token_ids, grammars)

    def compiler(self) -> tuple[GrammarCompiler, float]:
        """A fresh compiler (empty cache) with its tokenizer built, and that build's seconds."""
        started = time.perf_counter()
        compiler = GrammarCompiler(self.tokenizer_json, self.eos_token_ids)
        compiler.take(TRIVIAL, compiler.compile(TRIVIAL))
        return compiler, time.perf_counter() - started - compiler.stats.compile_seconds[0]


@dataclass(frozen=True)
class Sizes:
    requests: int  # the mixed workload's
    repeats: int  # its runs each way
    batch1_tokens: int
    batch1_repeats: int
    compile_repeats: int  # fresh compilers, each compiling the 20 schemas
    running_tokens: int  # burst: the running requests' output lengths
    burst_repeats: int


SAMPLED = SamplingParams(temperature=0.8, seed=0)  # the sampled runs' (every row's logits)
FULL = Sizes(64, 2, 128, 7, 3, 160, 2)
QUICK = Sizes(12, 2, 48, 3, 1, 96, 1)


def interleaved(
    run: Callable[[GrammarSpec | None], T], spec: GrammarSpec, repeats: int
) -> dict[str, list[T]]:
    """`repeats` runs each way, taken in turns (free, JSON, free, ...) so that a slow phase of
    this noisy machine hits both alike."""
    runs: dict[str, list[T]] = {"free": [], "json": []}
    for _ in range(repeats):
        runs["free"].append(run(None))
        runs["json"].append(run(spec))
    return runs


def milliseconds(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"p50_ms": 1e3 * percentile(ordered, 0.5), "p99_ms": 1e3 * percentile(ordered, 0.99)}


# --- 1. throughput ------------------------------------------------------------------------------


def run_mixed(
    bench: Bench,
    compiler: GrammarCompiler,
    workload: Workload,
    spec: GrammarSpec | None,
    sampling: SamplingParams = GREEDY,
) -> dict[str, float]:
    """The workload at once, every request under `spec` (or none): tokens/s over the tokens it
    produced, and the engine's time computing grammar masks per step."""
    engine, stats = bench.engine(compiler), compiler.stats
    before = dataclasses.replace(stats)
    start = time.perf_counter()
    for prompt, num_out in workload:
        stopping = StoppingParams(max_new_tokens=num_out)
        engine.add_request(prompt, sampling, stopping, grammar=spec)
    num_tokens = num_steps = num_complete = 0
    while engine.has_unfinished:
        outputs = engine.step()
        num_steps += 1
        num_tokens += sum(len(output.new_token_ids) for output in outputs)
        num_complete += sum(output.finish_detail == "grammar complete" for output in outputs)
    seconds = time.perf_counter() - start
    return {
        "tok_s": num_tokens / seconds,
        "tokens": num_tokens,
        "seconds": seconds,
        "steps": num_steps,
        "json_complete": num_complete,  # requests ended by their grammar, not their length
        "mask_ms_per_step": 1e3 * (stats.mask_seconds - before.mask_seconds) / num_steps,
        "argmax_checks": stats.num_argmax_checks - before.num_argmax_checks,
        "argmax_misses": stats.num_argmax_misses - before.num_argmax_misses,
    }


def throughput(bench: Bench, compiler: GrammarCompiler, sizes: Sizes) -> dict[str, Any]:
    """Greedy (the goal's case) and sampled (both ways compute every row's logits: what the
    grammar itself costs), best run of each way; and a profile of the greedy runs."""
    workload = random_workload(sizes.requests, (32, 512), (16, 256), seed=1)
    spec = GrammarSpec.json_schema(WORKLOAD_SCHEMA)
    run_mixed(bench, compiler, random_workload(4, (32, 64), (4, 4), seed=2), spec)  # compiles it
    out: dict[str, Any] = {"requested_tokens": sum(num_out for _, num_out in workload)}
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        run = functools.partial(run_mixed, bench, compiler, workload, sampling=params)
        runs = interleaved(run, spec, sizes.repeats)
        best = {way: max(runs[way], key=lambda run: run["tok_s"]) for way in runs}
        out[name] = best | {"json_over_free": best["json"]["tok_s"] / best["free"]["tok_s"]}
    out["profile_ms_per_step"] = {  # one more greedy run each way, under cProfile
        "free": profile(lambda: run_mixed(bench, compiler, workload, None)),
        "json": profile(lambda: run_mixed(bench, compiler, workload, spec)),
    }
    return out


# --- 2. batch-1 decode --------------------------------------------------------------------------

# Where a step's time goes (cProfile, cumulative: callees included).
PROFILED: dict[str, Callable[..., Any]] = {
    "engine step": LLMEngine.step,
    "model forward": DecoderForCausalLM.forward,
    "lm head, argmax only": DecoderForCausalLM.greedy_tokens,
    "lm head, fp32 logits": DecoderForCausalLM.compute_logits,
    "sampler": sampling.Sampler.__call__,
    "  its apply_token_masks": sampling.apply_token_masks,
    "grammar masks (llguidance)": GrammarCompiler.masks,
    "grammar argmax checks": Constraint.allows,
    "grammar consume": Constraint.consume,
}


def decode_steps(
    bench: Bench,
    compiler: GrammarCompiler,
    prompt: list[int],
    num_new: int,
    spec: GrammarSpec | None,
    sampling: SamplingParams = GREEDY,
) -> list[float]:
    """Seconds of each step of one request alone, but its first (the prompt's)."""
    engine = bench.engine(compiler)
    stopping = StoppingParams(max_new_tokens=num_new, ignore_eos=True)
    engine.add_request(prompt, sampling, stopping, grammar=spec)
    seconds = []
    while engine.has_unfinished:
        started = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - started)
    return seconds[1:]


def paired_decode_steps(
    bench: Bench,
    compiler: GrammarCompiler,
    prompt: list[int],
    num_new: int,
    spec: GrammarSpec,
    sampling: SamplingParams = GREEDY,
) -> dict[str, list[float]]:
    """Seconds of each step of one request alone, free on the bench's runner and under `spec`
    on its twin, stepped in turns (which goes first alternates): the steps both ran, but the
    first (the prompt's)."""
    stopping = StoppingParams(max_new_tokens=num_new, ignore_eos=True)
    engines = {"free": bench.engine(compiler), "json": bench.engine(compiler, twin=True)}
    engines["free"].add_request(prompt, sampling, stopping)
    engines["json"].add_request(prompt, sampling, stopping, grammar=spec)
    seconds: dict[str, list[float]] = {way: [] for way in engines}
    order = list(engines)
    while all(engine.has_unfinished for engine in engines.values()):
        for way in order:
            started = time.perf_counter()
            engines[way].step()
            seconds[way].append(time.perf_counter() - started)
        order.reverse()
    for engine in engines.values():
        for _ in engine.stream():
            pass
    return {way: steps[1:] for way, steps in seconds.items()}


LOGITS_STEPS = "steps with an fp32 logits pass, %"


def profile(run: Callable[[], object]) -> dict[str, float]:
    """Milliseconds per engine step inside each of `PROFILED`, over one run, and the share of
    steps that computed logits."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    table = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    cumulative = {key: (calls, seconds) for key, (_, calls, _, seconds, _) in table.items()}

    def entry(fn: Callable[..., Any]) -> tuple[int, float]:
        code = cast(FunctionType, fn).__code__
        return cumulative.get((code.co_filename, code.co_firstlineno, code.co_name), (0, 0.0))

    num_steps = entry(LLMEngine.step)[0]
    ms_per_step = {name: 1e3 * entry(fn)[1] / num_steps for name, fn in PROFILED.items()}
    num_logits = entry(DecoderForCausalLM.compute_logits)[0]
    return ms_per_step | {LOGITS_STEPS: 100 * num_logits / num_steps}


def batch1(bench: Bench, compiler: GrammarCompiler, sizes: Sizes) -> dict[str, Any]:
    """Greedy (the goal's case) and sampled (both ways compute the logits): per run, each way's
    step p50 and their ratio; the median run's figures and the ratios' spread. A profile of the
    greedy runs, and how often a greedy row's free argmax was checked first (and missed)."""
    prompt = random_prompts(1, 16)[0]
    spec = GrammarSpec.json_schema(LONG_TEXT_SCHEMA)
    paired_decode_steps(bench, compiler, prompt, 8, spec)  # compiles it, warms both up
    out: dict[str, Any] = {}
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        stats = dataclasses.replace(compiler.stats)
        runs = [
            paired_decode_steps(bench, compiler, prompt, sizes.batch1_tokens, spec, params)
            for _ in range(sizes.batch1_repeats)
        ]
        p50 = [{way: percentile(sorted(steps), 0.5) for way, steps in run.items()} for run in runs]
        p50.sort(key=lambda run: run["json"] / run["free"])
        ratios = [run["json"] / run["free"] for run in p50]
        middle = p50[len(p50) // 2]
        out[name] = {
            "free_step_p50_ms": 1e3 * middle["free"],
            "json_step_p50_ms": 1e3 * middle["json"],
            "json_over_free": ratios[len(ratios) // 2],
            "json_over_free_runs": ratios,
            "decode_steps": len(runs[0]["json"]),
            "argmax_checks": compiler.stats.num_argmax_checks - stats.num_argmax_checks,
            "argmax_misses": compiler.stats.num_argmax_misses - stats.num_argmax_misses,
        }
    out["profile_ms_per_step"] = {
        "free": profile(lambda: decode_steps(bench, compiler, prompt, sizes.batch1_tokens, None)),
        "json": profile(lambda: decode_steps(bench, compiler, prompt, sizes.batch1_tokens, spec)),
    }
    return out


# --- 3. compile ---------------------------------------------------------------------------------


def compile_times(bench: Bench, sizes: Sizes) -> dict[str, Any]:
    """Each schema cold in a fresh compiler (`compile()` to `take()`), then from its cache."""
    specs = {name: GrammarSpec.json_schema(schema) for name, schema in SCHEMAS.items()}
    cold: dict[str, list[float]] = {name: [] for name in specs}
    cached, builds = [], []
    for _ in range(sizes.compile_repeats):
        compiler, build = bench.compiler()
        builds.append(build)
        for name, spec in specs.items():
            started = time.perf_counter()
            compiler.take(spec, compiler.compile(spec))
            cold[name].append(time.perf_counter() - started)
        for spec in specs.values():
            started = time.perf_counter()
            is_hit = compiler.cached(spec) is not None
            cached.append(time.perf_counter() - started)
            assert is_hit, spec
        compiler.close()
    return {
        "cold": milliseconds([seconds for samples in cold.values() for seconds in samples]),
        "cached": milliseconds(cached),
        "tokenizer_build_s": min(builds),
        "cold_ms_by_schema": {name: 1e3 * min(samples) for name, samples in cold.items()},
    }


# --- 4. a burst of new schemas ------------------------------------------------------------------

ARRIVE_AFTER = 16  # the running requests' tokens when the burst arrives
BURST_STOPPING = StoppingParams(max_new_tokens=4, ignore_eos=True)


Burst = list[tuple[list[int], GrammarSpec | None]]  # (prompt, schema) of each request


def serve_burst(
    bench: Bench, running: list[list[int]], running_tokens: int, burst: Burst
) -> dict[str, Any]:
    """The `running` prompts decoding; once each has `ARRIVE_AFTER` tokens, `burst` arrives at
    once. The burst's TTFTs, and the running requests' inter-token gaps that end between the
    arrival and the burst's last first token (without a burst: after the arrival's moment)."""
    compiler, _ = bench.compiler()  # a fresh one: the burst's schemas are new to it
    engine = bench.engine(compiler)
    stopping = StoppingParams(max_new_tokens=running_tokens, ignore_eos=True)
    token_times: dict[str, list[float]] = {
        engine.add_request(prompt, stopping=stopping): [] for prompt in running
    }
    arrivals: dict[str, float] = {}
    first_tokens: dict[str, float] = {}
    arrived_at = 0.0
    while engine.has_unfinished:
        if not arrived_at and min(map(len, token_times.values())) >= ARRIVE_AFTER:
            arrived_at = time.perf_counter()
            for prompt, spec in burst:
                arrivals[engine.add_request(prompt, stopping=BURST_STOPPING, grammar=spec)] = (
                    time.perf_counter()
                )
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if not output.new_token_ids:
                continue
            if output.request_id in token_times:
                token_times[output.request_id].append(now)
            else:
                first_tokens.setdefault(output.request_id, now)
    compiler.close()
    window_end = max(first_tokens.values(), default=float("inf"))
    return {
        "ttft_s": [first_tokens[request_id] - arrived for request_id, arrived in arrivals.items()],
        "gaps_s": [
            later - earlier
            for times in token_times.values()
            for earlier, later in itertools.pairwise(times)
            if arrived_at < later <= window_end
        ],
        "window_s": window_end - arrived_at if burst else 0.0,
        "running_ended_in_window": sum(times[-1] < window_end for times in token_times.values())
        if burst
        else 0,
        "compile_s": compiler.stats.compile_seconds[1:],  # but the tokenizer's warm-up
    }


def burst(bench: Bench, sizes: Sizes) -> dict[str, Any]:
    prompts = [prompt for prompt, _ in random_workload(16, (64, 256), (1, 1), seed=6)]
    specs = [GrammarSpec.json_schema(schema) for schema in list(SCHEMAS.values())[:16]]
    running = random_prompts(16, 128, seed=5)
    variants: dict[str, Burst] = {
        "no_burst": [],
        "burst_free": [(prompt, None) for prompt in prompts],
        "burst_json": list(zip(prompts, specs, strict=True)),
    }
    pooled: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    for _ in range(sizes.burst_repeats):
        for name, requests in variants.items():
            served = serve_burst(bench, running, sizes.running_tokens, requests)
            for key, values in served.items():
                pooled[name].setdefault(key, []).extend(
                    values if isinstance(values, list) else [values]
                )
    return {
        name: {
            "ttft": milliseconds(runs["ttft_s"]),
            "itl": milliseconds(runs["gaps_s"]),
            "window_s": max(runs["window_s"]),
            "running_ended_in_window": max(runs["running_ended_in_window"]),
            "compile": milliseconds(runs["compile_s"]),
        }
        for name, runs in pooled.items()
    }


# --- the report ---------------------------------------------------------------------------------


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown"


def step_parts(profile_ms: dict[str, float]) -> dict[str, float]:
    """A profiled step in parts that add up to it."""
    parts = {
        "model forward": profile_ms["model forward"],
        "lm head": profile_ms["lm head, argmax only"] + profile_ms["lm head, fp32 logits"],
        "sampler": profile_ms["sampler"],
        "grammar masks": profile_ms["grammar masks (llguidance)"],
        "grammar argmax checks": profile_ms["grammar argmax checks"],
        "grammar consume": profile_ms["grammar consume"],
    }
    return parts | {"other": profile_ms["engine step"] - sum(parts.values())}


def stacked(ax: Any, profiles: dict[str, dict[str, float]], title: str) -> None:
    """The profiled step's parts, stacked, free beside JSON."""
    bottoms = [0.0, 0.0]
    for part in step_parts(profiles["free"]):
        heights = [step_parts(profiles[way])[part] for way in ("free", "json")]
        ax.bar(["free", "json"], heights, bottom=bottoms, label=part)
        bottoms = [bottom + height for bottom, height in zip(bottoms, heights, strict=True)]
    ax.set_ylim(0, 1.6 * max(bottoms))  # room for the legend above the bars
    ax.legend(fontsize=6, ncol=2, loc="upper center")
    ax.set_title(f"{title}, ms (cProfile)", fontsize=9)


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 5, figsize=(19, 3.8))
    colors = ["#999999", "#1f77b4"]
    mixed = results["throughput"]
    runs = {
        f"{way}\n{name}": mixed[name][way]["tok_s"]
        for name in ("greedy", "sampled")
        for way in ("free", "json")
    }
    drawn = axes[0].bar(list(runs), list(runs.values()), color=colors * 2)
    axes[0].bar_label(drawn, fmt="%.1f", fontsize=8)
    axes[0].set_title(f"{results['requests']} mixed requests, tok/s", fontsize=9)
    stacked(axes[1], results["batch1"]["profile_ms_per_step"], "batch-1 greedy step")
    stacked(axes[2], mixed["profile_ms_per_step"], f"{results['requests']} mixed requests' step")
    compiled = results["compile"]
    drawn = axes[3].bar(
        ["cold p50", "cold p99", "cached p50"],
        [compiled["cold"]["p50_ms"], compiled["cold"]["p99_ms"], compiled["cached"]["p50_ms"]],
        color=colors[1],
    )
    axes[3].bar_label(drawn, fmt="%.3g", fontsize=8)
    axes[3].set_yscale("log")
    axes[3].set_title("compile, 20 schemas, ms", fontsize=9)
    burst_results = results["burst"]
    bars = {
        "ITL p99\nno burst": burst_results["no_burst"]["itl"]["p99_ms"],
        "ITL p99\nfree": burst_results["burst_free"]["itl"]["p99_ms"],
        "ITL p99\njson": burst_results["burst_json"]["itl"]["p99_ms"],
        "TTFT p50\nfree": burst_results["burst_free"]["ttft"]["p50_ms"],
        "TTFT p50\njson": burst_results["burst_json"]["ttft"]["p50_ms"],
        "TTFT p99\njson": burst_results["burst_json"]["ttft"]["p99_ms"],
    }
    variant_colors = ["#999999", "#ff7f0e", "#1f77b4", "#ff7f0e", "#1f77b4", "#1f77b4"]
    drawn = axes[4].bar(list(bars), list(bars.values()), color=variant_colors)
    axes[4].bar_label(drawn, fmt="%.0f", fontsize=8)
    axes[4].set_title("burst of 16 (free / new schemas) while 16 decode, ms", fontsize=9)
    for ax in axes:
        ax.tick_params(labelsize=7)
    title = f"structured output (llguidance), medium Llama, Llama-3 vocab, bf16, {results['cpu']}"
    save_figure(fig, title, path)


def row(label: str, *cells: float | str, digits: int = 1) -> None:
    """One line of the summary table: a label, then right-aligned cells."""
    print(
        f"{label:<46}"
        + "".join(f"{c:>12.{digits}f}" if isinstance(c, float) else f"{c:>12}" for c in cells)
    )


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    write_results("structured", args, results)
    plot(results, RESULTS / "structured-cpu.png")
    mixed, single = results["throughput"], results["batch1"]
    cpu = f"cpu: {results['cpu']}, {args.threads} torch threads"
    print(f"{cpu}; vocabulary {results['vocab_size']}")
    row("metric", "free", "json", "json/free", "goal")
    for name, goal in (("greedy", ">= 0.90"), ("sampled", "")):
        free, json = mixed[name]["free"], mixed[name]["json"]
        ratio = f"{mixed[name]['json_over_free']:.3f}"
        row(
            f"{results['requests']} mixed requests, {name}, tok/s",
            free["tok_s"],
            json["tok_s"],
            ratio,
            goal,
        )
        requested = f"({mixed['requested_tokens']})"
        row("  tokens produced (requested)", free["tokens"], json["tokens"], requested)
        row(
            "  engine steps; ended by their grammar",
            free["steps"],
            json["steps"],
            json["json_complete"],
        )
        checks = json["argmax_checks"]
        if checks:
            row("  argmax checked first; missed", "", checks, json["argmax_misses"])
    for name, goal in (("greedy", "<= 1.05"), ("sampled", "")):
        steps = single[name]
        ratio = f"{steps['json_over_free']:.3f}"
        label = f"batch-1 decode step p50, {name}, ms (median run)"
        row(label, steps["free_step_p50_ms"], steps["json_step_p50_ms"], ratio, goal, digits=2)
        runs = steps["json_over_free_runs"]
        row(
            f"  json/free over {len(runs)} runs, min..max", "", "", f"{runs[0]:.3f}..{runs[-1]:.3f}"
        )
    greedy = single["greedy"]
    row("  greedy json: argmax checked first; missed", "", greedy["argmax_checks"],
        greedy["argmax_misses"])  # fmt: skip
    row("cProfile, ms per engine step", "b1 free", "b1 json", "mixed free", "mixed json")
    profiles = [single["profile_ms_per_step"], mixed["profile_ms_per_step"]]
    for name in [*PROFILED, LOGITS_STEPS]:
        cells = [run[way][name] for run in profiles for way in ("free", "json")]
        row(f"  {name}", *cells, digits=2)
    compiled = results["compile"]
    row("compile, 20 schemas", "p50", "p99")
    for kind in ("cold", "cached"):
        row(f"  {kind}, ms", compiled[kind]["p50_ms"], compiled[kind]["p99_ms"], digits=3)
    row("  tokenizer build (once per model), s", compiled["tokenizer_build_s"], digits=2)
    bursts = results["burst"]
    row("burst of 16 while 16 decode", "p50", "p99")
    for name in ("burst_free", "burst_json"):
        ttft = bursts[name]["ttft"]
        row(f"  {name}: burst TTFT, ms", ttft["p50_ms"], ttft["p99_ms"])
    for name in ("no_burst", "burst_free", "burst_json"):
        itl = bursts[name]["itl"]
        row(f"  {name}: running ITL, ms", itl["p50_ms"], itl["p99_ms"])
    windows = [bursts[name]["window_s"] for name in ("burst_free", "burst_json")]
    row("  burst window (arrival to last TTFT), s", *windows, digits=2)
    compiles = bursts["burst_json"]["compile"]
    row("  burst_json: compiles under load, ms", compiles["p50_ms"], compiles["p99_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer requests and repetitions")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    bench = Bench.load(llama3_medium(args.cache))
    results: dict[str, Any] = {
        "cpu": cpu_model(),
        "vocab_size": bench.runner.loaded.config.vocab_size,
        "requests": sizes.requests,
        "compile": compile_times(bench, sizes),
    }
    compiler, _ = bench.compiler()
    results["batch1"] = batch1(bench, compiler, sizes)
    results["throughput"] = throughput(bench, compiler, sizes)
    compiler.close()
    results["burst"] = burst(bench, sizes)
    report(results, args)


if __name__ == "__main__":
    main()
