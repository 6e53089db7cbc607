"""Scheduler benchmark: tgq's continuous batching against transformers' static batching.

Medium Llama shape, random bf16 weights, CPU, 2 threads. In one run:

- throughput: 64 requests, prompt lengths uniform in 32..512, output lengths uniform in 16..256
  (EOS ignored), all submitted at once. tgq's offline engine runs them together; transformers runs
  static batches of 16 (left-padded, each batch generating its longest output). Tokens/s counts
  only the requested output tokens, for both;
- a fixed 16 x (128 in, 64 out) run, the shape quoted for llama.cpp's `llama-server -np 16`;
- prefix replay: a 2,048-token shared prefix + a 32-token suffix, TTFT of a second request after
  a first one with the same prefix, and the first's TTFT;
- prefix cache on vs off on prompts that share nothing (0% hits): its bookkeeping's cost;
- KV waste at steady state: slots allocated to running requests but not (yet) holding a token,
  over slots allocated, averaged over the steps where no request waits for admission.

Prints one summary table and writes JSON and a PNG chart to bench/results/.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness import (
    NUM_BLOCKS,
    RESULTS,
    VOCAB,
    TgqOffline,
    Workload,
    bar_panel,
    medium_llama_4k,
    pyplot,
    random_workload,
    save_figure,
    write_results,
)
from tgq.gpu_worker.runner import ModelRunner


class HF:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        self.model.generation_config.eos_token_id = None

    def run(self, workload: Workload, batch_size: int) -> dict[str, float]:
        start = time.perf_counter()
        for i in range(0, len(workload), batch_size):
            self.generate_batch(workload[i : i + batch_size])
        seconds = time.perf_counter() - start
        return {"tok_s": sum(num_out for _, num_out in workload) / seconds}

    def generate_batch(self, batch: Workload) -> None:
        width = max(len(prompt) for prompt, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):  # left padding, as decoder-only generate wants
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(num_out for _, num_out in batch),
                pad_token_id=0,
            )


def prefix_replay(tgq: TgqOffline, prefix_len: int, suffix_len: int) -> dict[str, float]:
    rng = random.Random(7)
    prefix = [rng.randrange(3, VOCAB) for _ in range(prefix_len)]
    first, second = (
        [*prefix, *(rng.randrange(3, VOCAB) for _ in range(suffix_len))] for _ in range(2)
    )
    engine = tgq.engine()
    tgq.ttft(engine, random_workload(1, (64, 64), (1, 1), seed=99)[0][0])  # warm-up
    cold = tgq.ttft(engine, first)
    warm = tgq.ttft(engine, second)
    return {"ttft_first_ms": 1e3 * cold, "ttft_second_ms": 1e3 * warm, "speedup": cold / warm}


def prefix_cache_cost(tgq: TgqOffline, workload: Workload, repeats: int) -> dict[str, float]:
    """Best of `repeats` runs each way, taken in turns; prompts share nothing, so every lookup
    misses and only the hashing and bookkeeping differ."""
    best = {"on": 0.0, "off": 0.0}
    for _ in range(repeats):
        for name, enabled in (("off", False), ("on", True)):
            best[name] = max(best[name], tgq.run(workload, prefix_cache=enabled)["tok_s"])
    return {
        "tok_s_on": best["on"],
        "tok_s_off": best["off"],
        "on_over_off": best["on"] / best["off"],
    }


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.4))
    bars = [
        (
            "64 mixed requests\n(tok/s)",
            ["transformers\nstatic 16", "tgq"],
            [results["throughput"]["transformers"], results["throughput"]["tgq"]],
        ),
        (
            "prefix replay TTFT (ms)",
            ["first", "second"],
            [results["prefix_replay"]["ttft_first_ms"], results["prefix_replay"]["ttft_second_ms"]],
        ),
        (
            "0% hits (tok/s)",
            ["cache off", "cache on"],
            [results["prefix_cache_cost"]["tok_s_off"], results["prefix_cache_cost"]["tok_s_on"]],
        ),
    ]
    for ax, (title, names, values) in zip(axes, bars, strict=True):
        bar_panel(ax, title, names, values, "%.1f")
    save_figure(fig, "tgq scheduler, medium Llama bf16, CPU 2 threads", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--cost-requests", type=int, default=32)
    parser.add_argument("--cost-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true", help="tgq numbers only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = medium_llama_4k(args.cache)
    tgq = TgqOffline(model_dir, num_blocks=NUM_BLOCKS)
    workload = random_workload(args.requests, (32, 512), (16, 256), seed=1)
    tgq.run(random_workload(4, (32, 64), (4, 4), seed=2))  # warm-up
    ours = tgq.run(workload)
    results: dict[str, Any] = {"throughput": {"tgq": ours["tok_s"]}, "kv_waste": ours["kv_waste"]}
    results["llama_cpp_shape_16x128x64_tok_s"] = tgq.run(
        random_workload(16, (128, 128), (64, 64), seed=3)
    )["tok_s"]
    if not args.skip_hf:
        results["throughput"]["transformers"] = HF(model_dir).run(workload, args.hf_batch)["tok_s"]
    results["prefix_replay"] = prefix_replay(tgq, args.prefix_len, args.suffix_len)
    cost_workload = random_workload(args.cost_requests, (32, 512), (16, 64), seed=4)
    results["prefix_cache_cost"] = prefix_cache_cost(tgq, cost_workload, args.cost_repeats)
    report(results, args, tgq.runner)


def report(results: dict[str, Any], args: argparse.Namespace, runner: ModelRunner) -> None:
    write_results("scheduler", args, results, runner)
    throughput = results["throughput"]
    print(f"{'metric':<44}{'value':>12}")
    print(f"{'tgq 64 mixed requests, tok/s':<44}{throughput['tgq']:>12.1f}")
    if "transformers" in throughput:
        print(f"{'transformers static batch 16, tok/s':<44}{throughput['transformers']:>12.1f}")
        print(f"{'tgq / transformers':<44}{throughput['tgq'] / throughput['transformers']:>12.2f}")
        plot(results, RESULTS / "scheduler.png")
    fixed_shape = results["llama_cpp_shape_16x128x64_tok_s"]
    print(f"{'tgq 16 x (128 in, 64 out), tok/s':<44}{fixed_shape:>12.1f}")
    replay = results["prefix_replay"]
    print(f"{'prefix replay TTFT first, ms':<44}{replay['ttft_first_ms']:>12.1f}")
    print(f"{'prefix replay TTFT second, ms':<44}{replay['ttft_second_ms']:>12.1f}")
    print(f"{'prefix replay speedup':<44}{replay['speedup']:>12.1f}")
    cost = results["prefix_cache_cost"]
    print(f"{'0% hits: prefix cache on / off, tok/s':<44}{cost['on_over_off']:>12.3f}")
    print(f"{'KV waste at steady state':<44}{results['kv_waste']:>12.2%}")


if __name__ == "__main__":
    main()
