"""The newer families against transformers: decode tokens/s at batch 1 and 16, same weights,
same run, CPU, 2 threads.

- a Gemma-2-shaped model at the medium size (hidden 768, 12 layers, 12 heads of 64 over 4 KV
  heads, GeGLU of 2048, vocab 32000, soft caps 50 / 30, a 4096 window on every other layer);
- a Qwen3-MoE-shaped model scaled down to fit 2 cores (hidden 768, 12 layers, 12 heads of 64 over
  4 KV heads, q/k norms, 32 experts of 384 per layer with the top 4 renormalised, vocab 32000:
  the real 30B-A3B has 128 experts of 768 at hidden 2048 and picks 8).

Random bf16 weights; each figure is tokens per second of the decode steps alone (`bench_engine`'s
difference of a long and a short run, fastest of a few, taken in turns with transformers). Prints
one table and writes JSON and a bar chart to bench/results/.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from bench.harness import (
    RESULTS,
    Engines,
    HFEngine,
    TgqEngine,
    bar_panel,
    best_decode_step,
    pyplot,
    random_prompts,
    save_figure,
    write_results,
)
from tgq.devtools.random_model import make_config, write_model

PROMPT_LEN = 16
COMMON: dict[str, Any] = {
    "dtype": "bfloat16",
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma2": make_config(
        "Gemma2ForCausalLM",
        "medium",
        **COMMON,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "qwen3moe": make_config(
        "Qwen3MoeForCausalLM",
        "medium",
        **COMMON,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=384,
    ),
}


def model_dir(cache: Path, family: str) -> Path:
    path = cache / f"{family}-medium-bf16"
    if not (path / "model.safetensors").is_file():  # written last: its presence means complete
        write_model(path, FAMILIES[family], dtype=torch.bfloat16)
    return path


def measure(engines: Engines, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {name: {} for name in engines}
    for engine in engines.values():
        engine.generate(random_prompts(1, PROMPT_LEN), 4)  # warm-up
    for batch in (1, 16):
        prompts = random_prompts(batch, PROMPT_LEN)
        step = best_decode_step(engines, prompts, 2, 2 + args.steps, args.repeats)
        for name, seconds in step.items():
            out[name][f"decode_b{batch}_tok_s"] = batch / seconds
    return out


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    plt = pyplot()
    panels = [(family, metric) for family in results for metric in results[family]["tgq"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * len(panels), 3.4))
    for ax, (family, metric) in zip(axes, panels, strict=True):
        names = list(results[family])
        values = [results[family][name][metric] for name in names]
        bar_panel(ax, f"{family}: {metric}", names, values, "%.0f")
    save_figure(fig, "tgq vs transformers, newer families, bf16, CPU 2 threads (tok/s)", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--families", nargs="*", default=sorted(FAMILIES))
    # 32 steps, 5 repeats: at 16 and 3 a batch-16 window was ~0.2 s, and the same build's ratio
    # moved 2.5-3.2 between runs on a shared 2-core machine
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results: dict[str, dict[str, dict[str, float]]] = {}
    runner = None
    for family in args.families:
        path = model_dir(args.cache, family)
        engines: Engines = {"transformers": HFEngine(path), "tgq": TgqEngine(path, "auto")}
        results[family] = measure(engines, args)
        tgq = engines["tgq"]
        assert isinstance(tgq, TgqEngine)
        runner = tgq.runner
        del engines
    write_results("families", args, results, runner)
    plot(results, RESULTS / "families-cpu.png")
    print(f"{'family':<10}{'metric':<20}{'transformers':>14}{'tgq':>10}{'tgq/hf':>9}")
    for family, by_engine in results.items():
        for metric, base in by_engine["transformers"].items():
            ours = by_engine["tgq"][metric]
            print(f"{family:<10}{metric:<20}{base:>14.1f}{ours:>10.1f}{ours / base:>9.2f}")


if __name__ == "__main__":
    main()
