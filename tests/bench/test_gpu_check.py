"""The GPU check's own code, on the CPU: its bf16 parity checks run against the C++ kernels
(`--device cpu`), and its greedy-token check tells the argmax from tokens that are not."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from bench import gpu_check
from tgq.devtools.random_model import make_config, write_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_cpu_run_of_the_gpu_check_passes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--device", "cpu"],
        check=False, capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("device: cpu")
    assert any(line.startswith("model parity cpu bfloat16") for line in lines), lines


def test_the_greedy_check_refuses_tokens_that_are_not_the_argmax(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path / "tiny", make_config("LlamaForCausalLM"))
    oracle = gpu_check.oracle_for(model_dir, "cpu")
    assert gpu_check.worst_gap(oracle, gpu_check.greedy(oracle)) == 0.0
    rng = random.Random(0)
    others = [[rng.randrange(3, 512) for _ in range(gpu_check.NUM_NEW_TOKENS)] for _ in range(4)]
    assert gpu_check.worst_gap(oracle, others) > gpu_check.LOGPROB_TOLERANCE
