"""GPU check: run on a machine with an NVIDIA GPU (`make gpu-check`); not part of the CPU suite.

1. Kernel parity: every attention backend available here (flash-attn when installed) against the
   torch oracle on the same paged cache, bf16, for a prefill step (fresh prompts and chunks after
   a cached prefix), a decode step, and a mixed step; prints the max abs error.
2. Model parity: greedy tokens of the runner on CUDA (auto backend) equal the CPU fp32 runner's
   for a tiny random model (fp32 on GPU).
3. Tensor parallelism on NCCL: with two or more GPUs, greedy tokens of `--num-shard 2`
   (two `gpu_worker.rank` processes, one GPU each) equal the CPU fp32 runner's; with one GPU
   this says it could not run (NCCL needs a GPU per rank; TP=1 on the GPU is check 2).
4. Decode step time of the medium model (bf16) at batch 1 and 64.

Prints one line per check and exits non-zero if a parity check fails.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from tgq.batcher.engine import LLMEngine
from tgq.batcher.ranks import ShardConfig, ShardedRunner
from tgq.batcher.request import StoppingParams
from tgq.devtools.random_model import make_config, write_model
from tgq.gpu_worker.offline import OfflineEngine
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig
from tgq.kernels import AttentionStep, SeqSpan, get_backend

BLOCK_SIZE = 256  # flash-attn's paged mode needs a multiple of 256
TOLERANCE = 2e-2  # bf16


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


def kernel_parity(device: torch.device) -> bool:
    cases = {
        "prefill": ([300, 17], [300, 17]),
        "prefill-after-prefix": ([64, 9], [600, 265]),
        "decode": ([1] * 8, [1, 5, 256, 257, 511, 700, 1000, 3]),
        "mixed": ([1, 1, 120], [40, 900, 520]),
    }
    ok = True
    for backend_name in ("flash",):
        try:
            backend = get_backend(backend_name, device)
        except RuntimeError as exc:
            print(f"kernel {backend_name}: not run ({exc})")
            continue
        oracle = get_backend("torch", device)
        for case, (q_lens, kv_lens) in cases.items():
            for window in (None, 128):
                step = paged_step(q_lens, kv_lens, num_blocks=64)
                shape = (64, BLOCK_SIZE, 4, 128)
                k_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
                v_cache = torch.randn_like(k_cache)
                n = sum(q_lens)
                q = torch.randn(n, 16, 128, device=device, dtype=torch.bfloat16)
                k, v = torch.randn(2, n, 4, 128, device=device, dtype=torch.bfloat16)
                outs = []
                for b in (oracle, backend):
                    meta = b.prepare(step, device)
                    b.write_kv(k_cache, v_cache, k, v, meta)
                    outs.append(
                        b.attend(q, k_cache, v_cache, meta, scale=128**-0.5, sliding_window=window)
                    )
                err = (outs[0].float() - outs[1].float()).abs().max().item()
                ok &= err < TOLERANCE
                print(f"kernel {backend_name} {case} window={window}: max abs err {err:.2e}")
    return ok


PARITY_PROMPTS = [[random.Random(i).randrange(3, 512) for _ in range(20 + 7 * i)] for i in range(4)]


def model_parity(device: torch.device, tmp: Path) -> bool:
    model_dir = write_model(tmp / "tiny", make_config("LlamaForCausalLM"))
    prompts = PARITY_PROMPTS
    results = {}
    for dev in ("cpu", device.type):
        runner = ModelRunner(
            RunnerConfig(
                str(model_dir), device=dev, num_blocks=64, block_size=BLOCK_SIZE, dtype="float32"
            )
        )
        results[dev] = [
            g.token_ids for g in OfflineEngine(runner).generate(prompts, max_new_tokens=16)
        ]
    same = results["cpu"] == results[device.type]
    print(f"model parity cuda vs cpu (fp32, {runner.backend.name}): {'ok' if same else 'DIFF'}")
    return same


def tensor_parallel_parity(tmp: Path) -> bool:
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        print(f"tensor parallel (NCCL): not run, {num_gpus} GPU here (needs one per rank)")
        return True
    model_dir = tmp / "tiny"  # written by model_parity
    cpu = ModelRunner(
        RunnerConfig(str(model_dir), num_blocks=64, block_size=BLOCK_SIZE, dtype="float32")
    )
    sharded = ShardedRunner(
        ShardConfig(
            str(model_dir), 2, device="cuda", dtype="float32", block_size=BLOCK_SIZE,
            num_blocks=64,
        )
    )  # fmt: skip
    try:
        stopping = StoppingParams(max_new_tokens=16, ignore_eos=True)
        expected = [g.token_ids for g in LLMEngine(cpu).generate(PARITY_PROMPTS, stopping=stopping)]
        got = [g.token_ids for g in LLMEngine(sharded).generate(PARITY_PROMPTS, stopping=stopping)]
    finally:
        sharded.close()
    same = got == expected
    print(f"tensor parallel TP=2 on 2 GPUs (NCCL) vs cpu fp32: {'ok' if same else 'DIFF'}")
    return same


def decode_timing(device: torch.device, tmp: Path) -> None:
    model_dir = write_model(
        tmp / "medium",
        make_config("LlamaForCausalLM", "medium", dtype="bfloat16"),
        dtype=torch.bfloat16,
    )
    runner = ModelRunner(
        RunnerConfig(str(model_dir), device=device.type, num_blocks=512, block_size=BLOCK_SIZE)
    )
    engine = OfflineEngine(runner)
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
            f"({batch / step:.0f} tokens/s, backend {runner.backend.name})"
        )


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        ok = kernel_parity(device) & model_parity(device, Path(tmp))
        ok &= tensor_parallel_parity(Path(tmp))
        decode_timing(device, Path(tmp))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
