"""Tensor-parallel benchmark on CPU: the medium Llama (random bf16 weights) at TP=2 (two
`gpu_worker.rank` processes, gloo, one torch thread each) against TP=1 (the model in this
process, two threads), same machine, same run.

- plan distribution: per step, the time `ShardedRunner` takes to encode the plan (JSON) and
  write it to every rank's pipe, for the steps of the decode runs; and the round trip of an
  empty plan (encode, send, both ranks decode it and answer), i.e. the whole per-step overhead
  of driving the ranks without any model work;
- decode tokens/s at batch 1 and 16 (greedy, EOS ignored, 64 new tokens after 16-token
  prompts): on 2 cores TP=2 is expected to be slower (the all-reduces and the per-rank thread
  split cost more than halving the weights saves); the numbers are for the record.

Runs TP=1 and TP=2 in turns (`--repeats`), keeps each one's best; prints one summary and
writes JSON and a PNG to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness import RESULTS, medium_llama_2k, pyplot, random_prompts
from tgq.batcher.engine import LLMEngine, StepRunner
from tgq.batcher.ranks import ShardConfig, ShardedRunner
from tgq.batcher.request import StoppingParams
from tgq.gpu_worker.plan import StepPlan
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

NUM_BLOCKS = 1024
NEW_TOKENS = 64


def decode_tok_s(runner: StepRunner, batch: int) -> float:
    engine = LLMEngine(runner)
    stopping = StoppingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(random_prompts(batch, 16), stopping=stopping)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def empty_round_trip_us(runner: ShardedRunner, count: int = 2000) -> float:
    runner.execute(StepPlan())
    start = time.perf_counter()
    for _ in range(count):
        runner.execute(StepPlan())
    return 1e6 * (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model_dir = medium_llama_2k(args.cache)
    single = ModelRunner(RunnerConfig(str(model_dir), num_blocks=NUM_BLOCKS))
    sharded = ShardedRunner(
        ShardConfig(str(model_dir), 2, num_blocks=NUM_BLOCKS, threads_per_rank=1)
    )
    results: dict[str, Any] = {}
    try:
        decode_tok_s(single, 1), decode_tok_s(sharded, 1)  # warm-up
        for batch in (1, 16):
            runs: dict[str, list[float]] = {"tp1": [], "tp2": []}
            for _ in range(args.repeats):
                runs["tp1"].append(decode_tok_s(single, batch))
                runs["tp2"].append(decode_tok_s(sharded, batch))
            results[f"batch_{batch}"] = {name: max(values) for name, values in runs.items()}
        results["plan_send_us"] = 1e6 * sharded.plan_encode_s / sharded.num_steps
        results["empty_round_trip_us"] = empty_round_trip_us(sharded)
    finally:
        sharded.close()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tp-cpu.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "tp-cpu.png")
    print(f"{'metric':<40}{'TP=1':>10}{'TP=2':>10}{'TP2/TP1':>10}")
    for batch in (1, 16):
        tp1, tp2 = results[f"batch_{batch}"]["tp1"], results[f"batch_{batch}"]["tp2"]
        print(f"{f'decode tokens/s, batch {batch}':<40}{tp1:>10.1f}{tp2:>10.1f}{tp2 / tp1:>10.2f}")
    print(f"{'plan encode + send per step, us':<40}{'':>10}{results['plan_send_us']:>10.1f}")
    print(f"{'empty-plan round trip, us':<40}{'':>10}{results['empty_round_trip_us']:>10.1f}")
    print("(medium Llama bf16, CPU: TP=1 2 threads; TP=2 two ranks x 1 thread, gloo)")


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    labels = ["batch 1", "batch 16"]
    for offset, name, color in ((-0.2, "tp1", "#999999"), (0.2, "tp2", "#1f77b4")):
        values = [results[f"batch_{b}"][name] for b in (1, 16)]
        ax.bar([i + offset for i in range(2)], values, 0.4, label=name.upper(), color=color)
    ax.set_xticks(range(2), labels, fontsize=8)
    ax.set_ylabel("decode tokens/s", fontsize=8)
    ax.legend(fontsize=8)
    ax.set_title("medium Llama bf16, CPU 2 cores: TP=2 (gloo) vs TP=1", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
