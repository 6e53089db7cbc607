"""`--quantize int8` and `--quantize fp8` against bf16 on the medium model (hidden 768, 12 layers,
vocab 32000): the decode step at batch 1 and tokens/s at batch 16, tgq each time, same weights,
same run, CPU, 2 threads. The decoder layers' linears are int8 or FP8 E4M3 with one scale per
output row (the lm_head stays bf16, read through its int8 greedy screen either way); and the same
model as compressed-tensors FP8-dynamic and INT8 W8A8 checkpoints written by the library (8-bit
weights, inputs quantized per token at run time), and 4-bit weights in groups of 128: GPTQ and AWQ
checkpoints (`devtools.grouped_checkpoint`) and a compressed-tensors W4A16 one.

Then `--kv-cache-dtype fp8` against the bf16 cache: the decode step of 16 sequences with 4,096
tokens of context each (prefilled once; the timed runs hit the prefix cache), one engine at a time.

Each figure is `bench_engine`'s difference of a long and a short run, fastest of a few, taken in
turns (bf16, int8, fp8, bf16, ...). Prints one table and writes JSON and a bar chart to
bench/results/.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from unittest import mock

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
from tgq.devtools.compressed_checkpoint import write_compressed
from tgq.devtools.grouped_checkpoint import write_grouped
from tgq.kernels import cpu_ops

PROMPT_LEN = 16
# The FP8 KV cache against bf16's: a decode step of 16 sequences with this much context each,
# where attention reads the cache (the prompts are prefilled once: later runs hit the prefix
# cache).
KV_CONTEXT, KV_BATCH = 4096, 16
KV_BLOCKS = KV_BATCH * (KV_CONTEXT // 16 + 4) + 64
METRIC_KV = f"decode_b{KV_BATCH}_ctx4k_ms"
GROUP_SIZE = 128  # the group size GPTQ and AWQ checkpoints are usually published with
BATCHES = (1, 16)


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    plt = pyplot()
    metrics = list(results["bf16"])
    width = max(3.2, 0.95 * len(results))  # per panel: room for each engine's label
    fig, axes = plt.subplots(1, len(metrics), figsize=(width * len(metrics), 3.4))
    for ax, metric in zip(axes, metrics, strict=True):
        bar_panel(ax, metric, list(results), [results[n][metric] for n in results], "%.2f")
    save_figure(fig, "tgq 8-bit and 4-bit weights vs bf16, medium model, CPU 2 threads", path)


def without_vnni(make: Callable[[], TgqEngine]) -> TgqEngine:
    """An engine whose INT8 W8A8 layers load onto the 8-bit weight kernels, not VNNI's."""
    with mock.patch.object(cpu_ops, "has_vnni_w8a8_linear", lambda: False):
        return make()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--engines",
        default="int8,fp8,ct-fp8-dyn,ct-w8a8,gptq-int4,awq-int4,ct-w4a16",
        help="comma-separated, beside bf16 (also: bf16-full-head, gptq-int4-full-head,"
        " ct-w8a8-dequant)",
    )
    parser.add_argument("--no-kv", action="store_true", help="skip the FP8 KV cache comparison")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = medium_llama_2k(args.cache)

    def checkpoint(name: str) -> Path:
        """The medium model stored in `name`'s format (written once, kept in the cache)."""
        if name in ("gptq", "awq"):
            out = args.cache / f"medium-llama-2k-{name}"
            return write_grouped(path, out, name, GROUP_SIZE)
        return write_compressed(path, args.cache / f"medium-llama-2k-{name}", name)

    makers: dict[str, Callable[[], TgqEngine]] = {
        "bf16": lambda: TgqEngine(path, "auto"),
        "int8": lambda: TgqEngine(path, "auto", quantize="int8"),
        "fp8": lambda: TgqEngine(path, "auto", quantize="fp8"),
        "ct-fp8-dyn": lambda: TgqEngine(checkpoint("FP8_DYNAMIC"), "auto"),
        "ct-w8a8": lambda: TgqEngine(checkpoint("W8A8"), "auto"),
        "gptq-int4": lambda: TgqEngine(checkpoint("gptq"), "auto"),
        "awq-int4": lambda: TgqEngine(checkpoint("awq"), "auto"),
        "ct-w4a16": lambda: TgqEngine(checkpoint("W4A16"), "auto"),
        # Without the greedy head's int8 screen (every row's logits in full): what it buys.
        "bf16-full-head": lambda: TgqEngine(path, "auto", greedy_head=False),
        "gptq-int4-full-head": lambda: TgqEngine(checkpoint("gptq"), "auto", greedy_head=False),
        # INT8 W8A8 without the VNNI kernel (inputs dequantized, then the 8-bit weight kernel).
        "ct-w8a8-dequant": lambda: without_vnni(lambda: TgqEngine(checkpoint("W8A8"), "auto")),
    }
    chosen = ["bf16", *(n for n in args.engines.split(",") if n and n != "bf16")]
    unknown = sorted(set(chosen) - set(makers))
    if unknown:
        parser.error(f"unknown engines {unknown} (choose from {sorted(makers)})")
    engines: Engines = {name: makers[name]() for name in chosen}
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
    last = engines[chosen[-1]]
    assert isinstance(last, TgqEngine)
    write_results("quant", args, results, last.runner)
    plot(results, RESULTS / "quant-cpu.png")
    others = [name for name in results if name != "bf16"]
    width = max(17, *(len(n) + 7 for n in others))  # each engine's value and ratio to bf16
    print(f"{'metric':<22}{'bf16':>10}" + "".join(f"{f'{n}/bf16':>{width}}" for n in others))
    for metric, base in results["bf16"].items():
        ratios = "".join(
            f"{results[n][metric]:>{width - 7}.2f} {results[n][metric] / base:>6.3f}"
            for n in others
        )
        print(f"{metric:<22}{base:>10.2f}{ratios}")
    del engines
    if not args.no_kv:
        kv_cache(path, args)


def kv_cache(path: Path, args: argparse.Namespace) -> None:
    """The decode step of KV_BATCH sequences of KV_CONTEXT tokens: bf16 cache against FP8 E4M3
    and FP8 E5M2."""
    steps: dict[str, dict[str, float]] = {}
    prompts = random_prompts(KV_BATCH, KV_CONTEXT)
    names = {"auto": "bf16 KV", "fp8": "fp8 KV", "fp8_e5m2": "e5m2 KV"}
    for kv, name in names.items():  # one at a time: each holds a 4,096-token context per row
        engine = TgqEngine(path, "auto", kv_cache_dtype=kv, num_blocks=KV_BLOCKS)
        engine.generate(prompts, 1)  # the prefill, once: the runs below hit the prefix cache
        step = best_decode_step({kv: engine}, prompts, 2, 2 + args.steps, args.repeats)[kv]
        steps[name] = {METRIC_KV: step * 1e3}
        del engine
    write_results("quant-kv", args, steps, None)
    plt = pyplot()
    fig, ax = plt.subplots(1, 1, figsize=(4.2, 3.4))
    bar_panel(ax, METRIC_KV, list(steps), [v[METRIC_KV] for v in steps.values()], "%.2f")
    save_figure(fig, "tgq FP8 KV caches vs bf16, medium model", RESULTS / "quant-kv-cpu.png")
    bf16 = steps["bf16 KV"][METRIC_KV]
    print(
        f"{METRIC_KV:<22}{'bf16 KV':>10}{bf16:>9.2f}"
        + "".join(
            f"{name:>10}{steps[name][METRIC_KV]:>9.2f}{steps[name][METRIC_KV] / bf16:>8.3f}"
            for name in ("fp8 KV", "e5m2 KV")
        )
    )


if __name__ == "__main__":
    main()
