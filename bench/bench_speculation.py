"""Speculative decoding against the same engine without it, same run, on the trained speculation
target (`devtools.train_spec`: ~5.8M parameters, trained here on Python's docs plus tasks whose
outputs copy their input), CPU, 2 threads:

- extraction, batch 1: a passage of 60 words then `Quote:`; the model was trained to quote a
  span of it (10-40 words) and end (EOS, at most 128 tokens) (n-gram);
- records: 200 lines of one bulk batch, each a passage then `Record:`; the model writes a JSON
  object with the same keys every line (suffix), all 200 submitted at once, and 16 at a time;
- free text, batch 1: the first words of a passage, continued by the model (draft: the trained
  draft model, ~8x smaller, guesses);
- the mixed workload: 64 requests of random tokens (prompts 32-512, outputs 16-256) at once, with
  n-gram speculation on at its defaults: it must not cost at high load.

Greedy decoding, so both runs produce the same tokens (checked). Each workload runs `--repeats`
times in turns (without, with, without, ...); the table gives the best tokens/s of each, the
median and range of the pairs' ratios, the acceptance rate and the tokens kept per verifying
forward.
Writes JSON and a bar chart to bench/results/.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from bench.harness import RESULTS, pyplot, save_figure, write_results
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine, RequestResult
from tgq.batcher.request import StoppingParams
from tgq.devtools.corpus import load_corpus
from tgq.devtools.train_spec import QUOTE, RECORD, passage, spec_models
from tgq.gpu_worker.config import model_eos_token_ids
from tgq.gpu_worker.plan import SamplingParams
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

TARGETS = {"extraction": 2.0, "records": 1.5, "records16": 1.5, "draft": 0.0, "mixed64": 0.97}


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: list[int]
    method: str
    at_once: int  # requests submitted together (1: one after another)
    ignore_eos: bool = False
    limits: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    seconds: float
    num_tokens: int
    outputs: list[list[int]]
    stats: dict[str, float]


def run(runner: ModelRunner, eos: frozenset[int], workload: Workload, speculate: int) -> Outcome:
    config = SchedulerConfig(
        speculate=speculate, speculative_method=workload.method, **workload.limits
    )
    engine = LLMEngine(runner, config, eos_token_ids=eos)
    results: list[RequestResult] = []
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), workload.at_once):
        part = slice(first, first + workload.at_once)
        stops = [
            StoppingParams(max_new_tokens=n, ignore_eos=workload.ignore_eos)
            for n in workload.max_new_tokens[part]
        ]
        requests = [
            engine.request(engine.add_request(prompt, SamplingParams(), stopping))
            for prompt, stopping in zip(workload.prompts[part], stops, strict=True)
        ]
        for _ in engine.stream():
            pass
        results += [RequestResult.of(r) for r in requests if r is not None]
    seconds = time.perf_counter() - start
    speculation = engine.scheduler.speculation
    stats = {}
    if speculation is not None:
        s = speculation.stats
        stats = {"acceptance": s.acceptance_rate, "tokens_per_forward": s.tokens_per_forward}
    outputs = [r.token_ids for r in results]
    return Outcome(seconds, sum(map(len, outputs)), outputs, stats)


def workloads(tokenizer: Tokenizer) -> list[Workload]:
    rng = random.Random(1)
    texts = [t for t in load_corpus() if len(t.split()) >= 40]
    rng.shuffle(texts)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text).ids)

    quotes = [encode(" ".join(passage(rng, t)) + QUOTE.rstrip(" ")) for t in texts[:8]]
    records = [encode(" ".join(passage(rng, t)) + RECORD.rstrip(" ")) for t in texts[8:208]]
    free = [encode(" ".join(passage(rng, t, max_words=12))) for t in texts[208:216]]
    mixed_rng = random.Random(64)
    mixed = [
        [
            mixed_rng.randrange(3, tokenizer.get_vocab_size())
            for _ in range(mixed_rng.randint(32, 512))
        ]
        for _ in range(64)
    ]
    mixed_out = [mixed_rng.randint(16, 256) for _ in range(64)]
    return [
        Workload("extraction", quotes, [128] * len(quotes), "ngram", 1),
        Workload("records", records, [96] * len(records), "suffix", len(records)),
        Workload("records16", records, [96] * len(records), "suffix", 16),
        Workload("draft", free, [64] * len(free), "draft", 1, ignore_eos=True),
        Workload("mixed64", mixed, mixed_out, "ngram", 64, ignore_eos=True),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/spec"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speculate", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None, help="workload names to run")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, draft = spec_models(args.cache)
    config = RunnerConfig(str(target), num_blocks=4096, block_size=16, speculative_model=str(draft))
    runner = ModelRunner(config)  # its draft model idle unless a workload asks
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    rows: dict[str, Any] = {}
    eos = model_eos_token_ids(target)
    for workload in workloads(tokenizer):
        if args.only and workload.name not in args.only:
            continue
        base: list[Outcome] = []
        spec: list[Outcome] = []
        for _ in range(args.repeats):
            base.append(run(runner, eos, workload, 0))
            spec.append(run(runner, eos, workload, args.speculate))
        assert all(o.outputs == base[0].outputs for o in base + spec), workload.name
        ratios = sorted(b.seconds / s.seconds for b, s in zip(base, spec, strict=True))
        best_base = max(o.num_tokens / o.seconds for o in base)
        best_spec = max(o.num_tokens / o.seconds for o in spec)
        rows[workload.name] = {
            "method": workload.method,
            "baseline_tok_s": best_base,
            "speculative_tok_s": best_spec,
            "speedup": ratios[len(ratios) // 2],  # the median pair's
            "speedup_range": [ratios[0], ratios[-1]],
            "num_tokens": base[0].num_tokens,
            **spec[-1].stats,
            "target": TARGETS[workload.name],
        }
        print_row(workload.name, rows[workload.name])
    print_table(rows)
    write_results("speculation", args, rows, runner)
    plot(rows, RESULTS / "speculation-cpu.png")


def print_row(name: str, row: dict[str, Any]) -> None:
    low, high = row["speedup_range"]
    print(
        f"{name}: {row['baseline_tok_s']:.1f} -> {row['speculative_tok_s']:.1f} tok/s,"
        f" {row['speedup']:.2f}x ({low:.2f}-{high:.2f}), acceptance"
        f" {row.get('acceptance', 0):.2f}, {row.get('tokens_per_forward', 1):.2f} tokens/forward",
        flush=True,
    )


def print_table(rows: dict[str, Any]) -> None:
    print(
        "| workload | method | tokens | without (tok/s) | with (tok/s) | speedup (range) |"
        " acceptance | tokens/forward | goal |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        low, high = r["speedup_range"]
        print(
            f"| {name} | {r['method']} | {r['num_tokens']} | {r['baseline_tok_s']:.1f} |"
            f" {r['speculative_tok_s']:.1f} | {r['speedup']:.2f}x ({low:.2f}-{high:.2f}) |"
            f" {r.get('acceptance', 0):.2f} | {r.get('tokens_per_forward', 1):.2f} |"
            f" {'>= ' + str(r['target']) + 'x' if r['target'] else 'report'} |"
        )


def plot(rows: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    names = list(rows)
    speedups = [rows[n]["speedup"] for n in names]
    errors = [
        [s - rows[n]["speedup_range"][0] for n, s in zip(names, speedups, strict=True)],
        [rows[n]["speedup_range"][1] - s for n, s in zip(names, speedups, strict=True)],
    ]
    bars = ax.bar(names, speedups, yerr=errors, color="#1f77b4", capsize=3)
    ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    goals = [(n, rows[n]["target"]) for n in names if rows[n]["target"]]
    ax.scatter([n for n, _ in goals], [g for _, g in goals], marker="_", s=400, color="red",
               label="goal")  # fmt: skip
    ax.axhline(1.0, color="#999999", linewidth=0.8)
    ax.set_ylabel("tokens/s with / without", fontsize=8)
    ax.legend(fontsize=8)
    save_figure(fig, "Speculative decoding, trained target (CPU, 2 threads)", path)


if __name__ == "__main__":
    main()
