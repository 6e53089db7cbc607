"""What quantization costs in quality, measured against the same model unquantized: the variants
(`--quantize int8|fp8` as transformers' model of the dequantized weights, q * scale, which tgq's
quantized layers compute exactly; compressed-tensors checkpoints the library writes and runs;
GPTQ and AWQ int4 checkpoints, `devtools.grouped_checkpoint`, dequantized to bf16), and the
teacher-forced metrics over corpus text (mean KL(bf16 || quantized) of the next-token
distributions, and how often their argmax agrees). `bench/bench_quant_quality.py` reports them on
the demo and medium models; `tests/gpu_worker/test_quant_quality.py` holds a small trained model
to `BOUNDS`, the documented bounds (README, "Quantization quality")."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from tgq.devtools.compressed_checkpoint import write_compressed
from tgq.devtools.corpus import load_corpus
from tgq.devtools.grouped_checkpoint import dequantized_dir, write_grouped
from tgq.devtools.quantized_reference import dequantize_in_place
from tgq.gpu_worker.layers.linear import quantize_rows

# Each variant's bounds on a trained model's teacher-forced metrics against bf16: (largest mean
# KL, smallest top-1 agreement). Int8 weight-only keeps >= 95% of the argmaxes (issue 28); the
# 4-bit ones are round-to-nearest in groups of 128 (GPTQ's and AWQ's calibrated algorithms do
# better). Measured (2,048 positions of the demo model; 1,024 of the test's model): int8 KL
# 0.00006 / 0.00004, top-1 99.1% / 98.7%; fp8 - / 0.00014, 97.9%; GPTQ 0.0018 / 0.0011, 95.6% /
# 96.1%; AWQ 0.0015 / 0.0009, 95.9% / 96.7%.
BOUNDS: dict[str, tuple[float, float]] = {
    "int8": (0.0005, 0.95),
    "fp8": (0.001, 0.95),
    "gptq int4": (0.005, 0.90),
    "awq int4": (0.005, 0.90),
}
# The FP8 KV cache (per-tensor scale 1) against the bf16 cache, tgq both: the prompt positions'
# argmax agrees at least this often (measured on the test's model: 95.8%, mean |logprob drift|
# 0.024).
KV_FP8_MIN_TOP1 = 0.92


WINDOW = 256  # tokens per teacher-forced window


def corpus_ids(model_dir: Path, count: int) -> list[int]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: list[int] = []
    for text in load_corpus():
        ids += tokenizer.encode(text).ids
        if len(ids) >= count:
            break
    return ids[:count]


METHODS = ("int8", "fp8")  # `--quantize`
SCHEMES = ("FP8_DYNAMIC", "W8A8", "W4A16")  # compressed-tensors checkpoints the library writes
GROUPED = ("gptq", "awq")  # 4-bit checkpoints devtools.grouped_checkpoint writes (groups of 128)
GROUP_SIZE = 128


@dataclass(frozen=True)
class Variant:
    model_dir: Path  # what tgq loads
    quantize: str | None  # `--quantize`
    reference: Callable[[], Any]  # transformers' model of the same weights, bf16


def variants(model_dir: Path, cache: Path, wanted: set[str]) -> dict[str, Variant]:
    """The quantized variants of `model_dir` labelled in `wanted` (all where empty), their
    checkpoints written on first use; the library's W4A16 only where every linear's inputs
    are whole groups of 128 (it has no partial groups)."""
    from transformers import AutoModelForCausalLM

    def keep(label: str) -> bool:
        return not wanted or label in wanted

    def dequantized(method: str) -> Callable[[], Any]:
        rows = functools.partial(quantize_rows, method=method)
        model = functools.partial(AutoModelForCausalLM.from_pretrained, model_dir)
        return lambda: dequantize_in_place(model(dtype=torch.bfloat16), rows, torch.bfloat16).eval()

    def library(path: Path) -> Callable[[], Any]:
        return lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()

    config = json.loads((model_dir / "config.json").read_text())
    whole_groups = all(config[k] % GROUP_SIZE == 0 for k in ("hidden_size", "intermediate_size"))
    found = {m: Variant(model_dir, m, dequantized(m)) for m in METHODS if keep(m)}
    for scheme in SCHEMES:
        if not keep(f"ct {scheme}") or (scheme == "W4A16" and not whole_groups):
            continue
        path = write_compressed(model_dir, cache / f"{model_dir.name}-{scheme}", scheme)
        found[f"ct {scheme}"] = Variant(path, None, library(path))
    for fmt in GROUPED:
        if not keep(f"{fmt} int4"):
            continue
        path = write_grouped(model_dir, cache / f"{model_dir.name}-{fmt}", fmt, GROUP_SIZE)
        found[f"{fmt} int4"] = Variant(path, None, library(dequantized_dir(path)))
    return found


def teacher_forced(model_dir: Path, quantized: Any, positions: int) -> dict[str, float]:
    """KL(bf16 || quantized) and argmax agreement over corpus windows, transformers both."""
    from transformers import AutoModelForCausalLM

    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = torch.tensor(corpus_ids(model_dir, positions + positions // WINDOW + 1))
    kl_sum, agree, count = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, positions, WINDOW):
            window = ids[start : start + WINDOW + 1][None, :-1]
            ref = torch.log_softmax(bf16(window).logits[0].float(), -1)
            ours = torch.log_softmax(quantized(window).logits[0].float(), -1)
            kl_sum += (ref.exp() * (ref - ours)).sum(-1).sum().item()
            agree += int((ref.argmax(-1) == ours.argmax(-1)).sum())
            count += window.shape[1]
    return {"mean_kl": kl_sum / count, "top1_agreement": agree / count, "positions": count}
