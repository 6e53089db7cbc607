"""GPU check: run on a machine with an NVIDIA GPU (`make gpu-check`); not part of the CPU suite.

Everything runs in bf16: flash-attn has no fp32 kernels.

1. Kernel parity: every attention backend available here besides the torch oracle (flash-attn
   when installed; the C++ kernels with `--device cpu`) against the oracle on the same paged
   cache, for a prefill step (fresh prompts and chunks after a cached prefix), a decode step and
   a mixed step; prints the max abs error (bf16 tolerance).
2. Model parity: greedy tokens of the runner (auto backend: flash-attn, paged prefill and decode,
   KV blocks of its own size) on a tiny random model are, at every position, the argmax of the
   torch oracle backend's logprobs on the same bf16 weights within a bf16 tolerance (bf16 ties
   may break either way, so exact token equality is not the test).
3. Tensor parallelism on NCCL: with two or more GPUs, the greedy tokens of `--num-shard 2` (two
   `gpu_worker.rank` processes, one GPU each) pass the same check; with one GPU this says it
   could not run (NCCL needs a GPU per rank; TP=1 on the GPU is check 2).
4. Decode step time of the medium model (bf16) at batch 1 and 64.

Prints one line per check and exits non-zero if a parity check fails. `--device cpu` runs
checks 1 and 2 on the CPU (the C++ kernels against the oracle): the check's own code, without
a GPU.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tgq.batcher.engine import LLMEngine, StepRunner
from tgq.batcher.offline import OfflineEngine
from tgq.batcher.ranks import ShardConfig, ShardedRunner
from tgq.batcher.request import StoppingParams
from tgq.devtools.random_model import make_config, write_model
from tgq.gpu_worker.plan import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig
from tgq.kernels import (
    AttentionBackend,
    AttentionStep,
    SeqSpan,
    available_backends,
    get_backend,
)

BLOCK_SIZE = 256  # of the kernel check: flash-attn's paged mode needs a multiple of 256
TOLERANCE = 2e-2  # bf16: attention outputs (check 1)
LOGPROB_TOLERANCE = 5e-2  # bf16: a chosen token's logprob below the oracle's best (checks 2, 3)
NUM_TOP = 5  # the oracle's top logprobs read per position
DTYPE = "bfloat16"


def paged_step(query_lens: list[int], kv_lens: list[int], num_blocks: int) -> AttentionStep:
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    spans, slots = [], []
    for q_len, kv_len in zip(query_lens, kv_lens, strict=True):
        table = [free.pop() for _ in range(-(-kv_len // BLOCK_SIZE))]
        spans.append(SeqSpan(q_len, kv_len, table))
        slots += [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for p in range(kv_len - q_len, kv_len)
        ]
    return AttentionStep(spans, slots, BLOCK_SIZE)


KERNEL_CASES = {
    "prefill": ([300, 17], [300, 17]),
    "prefill-after-prefix": ([64, 9], [600, 265]),
    "decode": ([1] * 8, [1, 5, 256, 257, 511, 700, 1000, 3]),
    "mixed": ([1, 1, 120], [40, 900, 520]),
}


def kernel_parity(device: torch.device) -> bool:
    ok = True
    oracle = get_backend("torch", device)
    for backend_name in [name for name in available_backends() if name != "torch"]:
        try:
            backend = get_backend(backend_name, device)
        except RuntimeError as exc:
            print(f"kernel {backend_name}: not run ({exc})")
            continue
        for case, (q_lens, kv_lens) in KERNEL_CASES.items():
            for window in (None, 128):
                err = kernel_error(oracle, backend, device, q_lens, kv_lens, window)
                ok &= err < TOLERANCE
                print(f"kernel {backend_name} {case} window={window}: max abs err {err:.2e}")
    return ok


def kernel_error(
    oracle: AttentionBackend[Any],
    backend: AttentionBackend[Any],
    device: torch.device,
    q_lens: list[int],
    kv_lens: list[int],
    window: int | None,
) -> float:
    """Max abs difference of the two backends' attention over the same bf16 paged cache."""
    step = paged_step(q_lens, kv_lens, num_blocks=64)
    k_cache = torch.randn((64, BLOCK_SIZE, 4, 128), device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    n = sum(q_lens)
    q = torch.randn(n, 16, 128, device=device, dtype=torch.bfloat16)
    k, v = torch.randn(2, n, 4, 128, device=device, dtype=torch.bfloat16)
    outs = []
    for b in (oracle, backend):
        meta = b.prepare(step, device)
        b.write_kv(k_cache, v_cache, k, v, meta)
        outs.append(b.attend(q, k_cache, v_cache, meta, scale=128**-0.5, sliding_window=window))
    return float((outs[0].float() - outs[1].float()).abs().max().item())


PARITY_PROMPTS = [[random.Random(i).randrange(3, 512) for _ in range(20 + 7 * i)] for i in range(4)]
NUM_NEW_TOKENS = 16


def runner(model_dir: Path, device: str, **config: Any) -> ModelRunner:
    return ModelRunner(RunnerConfig(str(model_dir), device=device, dtype=DTYPE, **config))


def greedy(runner: StepRunner) -> list[list[int]]:
    """NUM_NEW_TOKENS greedy tokens after each of PARITY_PROMPTS (paged prefill, then decode)."""
    stopping = StoppingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return [g.token_ids for g in LLMEngine(runner).generate(PARITY_PROMPTS, stopping=stopping)]


def worst_gap(oracle: ModelRunner, outputs: list[list[int]]) -> float:
    """Over every position of every output: how far the chosen token's logprob is below the
    oracle's best at that position (0 where it is the oracle's argmax; inf where it is not
    among the oracle's NUM_TOP). All contexts are prefilled in one step of the oracle."""
    contexts = [
        (prompt + tokens[:k], tokens[k])
        for prompt, tokens in zip(PARITY_PROMPTS, outputs, strict=True)
        for k in range(len(tokens))
    ]
    sampling = SamplingParams(top_n_logprobs=NUM_TOP)
    free = iter(range(1, oracle.num_blocks))
    new, chunks = [], []
    for index, (context, _) in enumerate(contexts):
        block_ids = [next(free) for _ in range(-(-len(context) // oracle.block_size))]
        new.append(NewSequence(f"c{index}", context, len(context), sampling, block_ids))
        chunks.append(ScheduledChunk(f"c{index}", 0, len(context)))
    result = oracle.execute(StepPlan(new_sequences=new, chunks=chunks))
    oracle.execute(StepPlan(finished_request_ids=[seq.request_id for seq in new]))
    tops = {token.request_id: token.top_logprobs for token in result.sampled}
    gap = 0.0
    for index, (_, chosen) in enumerate(contexts):
        top = tops[f"c{index}"]
        logprob = next((t.logprob for t in top if t.token_id == chosen), float("-inf"))
        gap = max(gap, top[0].logprob - logprob)
    return gap


def oracle_for(model_dir: Path, device: str) -> ModelRunner:
    """Plain torch ops and the torch attention backend (no custom kernel), with room to prefill
    every context of `worst_gap` in one step."""
    num_contexts = len(PARITY_PROMPTS) * NUM_NEW_TOKENS
    longest = max(map(len, PARITY_PROMPTS)) + NUM_NEW_TOKENS
    num_blocks = 1 + num_contexts * -(-longest // 16)
    return runner(model_dir, device, custom_kernels=False, block_size=16, num_blocks=num_blocks)


def model_parity(device: torch.device, tmp: Path) -> bool:
    model_dir = write_model(tmp / "tiny", make_config("LlamaForCausalLM"))
    tested = runner(model_dir, device.type, num_blocks=64)  # auto: its backend, its block size
    gap = worst_gap(oracle_for(model_dir, device.type), greedy(tested))
    name, block_size = tested.backend.name, tested.block_size
    print(
        f"model parity {device.type} {DTYPE} ({name}, blocks of {block_size}) vs the torch"
        f" oracle: greedy tokens within {gap:.2e} of its argmax logprob"
        f" ({'ok' if gap < LOGPROB_TOLERANCE else 'DIFF'})"
    )
    return gap < LOGPROB_TOLERANCE


def tensor_parallel_parity(tmp: Path) -> bool:
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        print(f"tensor parallel (NCCL): not run, {num_gpus} GPU here (needs one per rank)")
        return True
    model_dir = tmp / "tiny"  # written by model_parity
    sharded = ShardedRunner(
        ShardConfig(str(model_dir), 2, device="cuda", dtype=DTYPE, num_blocks=64)
    )
    try:
        outputs = greedy(sharded)
    finally:
        sharded.close()
    gap = worst_gap(oracle_for(model_dir, "cuda"), outputs)
    print(
        f"tensor parallel TP=2 on 2 GPUs (NCCL) {DTYPE} vs the torch oracle: greedy tokens"
        f" within {gap:.2e} of its argmax logprob ({'ok' if gap < LOGPROB_TOLERANCE else 'DIFF'})"
    )
    return gap < LOGPROB_TOLERANCE


def decode_timing(device: torch.device, tmp: Path) -> None:
    model_dir = write_model(
        tmp / "medium",
        make_config("LlamaForCausalLM", "medium", dtype="bfloat16"),
        dtype=torch.bfloat16,
    )
    tested = runner(model_dir, device.type, num_blocks=512)
    engine = OfflineEngine(tested)
    for batch in (1, 64):
        prompts = [[3 + i] * 32 for i in range(batch)]

        def run(n: int, p: list[list[int]] = prompts) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(p, max_new_tokens=n)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        run(4)
        step = (run(68) - run(4)) / 64
        print(
            f"decode step medium bf16 batch {batch}: {step * 1e3:.2f} ms "
            f"({batch / step:.0f} tokens/s, backend {tested.backend.name})"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_check", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"),
        help="cpu: checks 1 and 2 with the C++ kernels, without a GPU",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--device cpu checks the CPU kernels)")
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        ok = kernel_parity(device) & model_parity(device, Path(tmp))
        if device.type == "cuda":
            ok &= tensor_parallel_parity(Path(tmp))
            decode_timing(device, Path(tmp))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
