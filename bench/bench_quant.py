"""`--quantize int8` and `--quantize fp8` against bf16 on the medium model (hidden 768, 12 layers,
vocab 32000): the decode step at batch 1 and tokens/s at batch 16, tgq each time, same weights,
same run, CPU, 2 threads. The decoder layers' linears are int8 or FP8 E4M3 with one scale per
output row (the lm_head stays bf16, read through its int8 greedy screen either way).

Each figure is `bench_engine`'s difference of a long and a short run, fastest of a few, taken in
turns (bf16, int8, fp8, bf16, ...). Prints one table and writes JSON and a bar chart to
bench/results/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.harness import (
    RESULTS,
    Engines,
    TgqEngine,
    bar_panel,
    best_decode_step,
    medium_llama_2k,
    pyplot,
    random_prompts,
    save_figure,
    write_results,
)

PROMPT_LEN = 16
BATCHES = (1, 16)


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    plt = pyplot()
    metrics = list(results["bf16"])
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.4))
    for ax, metric in zip(axes, metrics, strict=True):
        bar_panel(ax, metric, list(results), [results[n][metric] for n in results], "%.2f")
    save_figure(fig, "tgq --quantize int8 / fp8 vs bf16, medium model, CPU 2 threads", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = medium_llama_2k(args.cache)
    engines: Engines = {
        "bf16": TgqEngine(path, "auto"),
        "int8": TgqEngine(path, "auto", quantize="int8"),
        "fp8": TgqEngine(path, "auto", quantize="fp8"),
    }
    results: dict[str, dict[str, float]] = {name: {} for name in engines}
    for engine in engines.values():
        engine.generate(random_prompts(1, PROMPT_LEN), 4)  # warm-up
    for batch in BATCHES:
        step = best_decode_step(
            engines, random_prompts(batch, PROMPT_LEN), 2, 2 + args.steps, args.repeats
        )
        for name, seconds in step.items():
            results[name][f"decode_b{batch}_step_ms"] = seconds * 1e3
            results[name][f"decode_b{batch}_tok_s"] = batch / seconds
    int8 = engines["int8"]
    assert isinstance(int8, TgqEngine)
    write_results("quant", args, results, int8.runner)
    plot(results, RESULTS / "quant-cpu.png")
    print(f"{'metric':<22}{'bf16':>10}{'int8':>10}{'fp8':>10}{'int8/bf16':>11}{'fp8/bf16':>10}")
    for metric, base in results["bf16"].items():
        int8_value, fp8_value = results["int8"][metric], results["fp8"][metric]
        print(
            f"{metric:<22}{base:>10.2f}{int8_value:>10.2f}{fp8_value:>10.2f}"
            f"{int8_value / base:>11.3f}{fp8_value / base:>10.3f}"
        )


if __name__ == "__main__":
    main()
