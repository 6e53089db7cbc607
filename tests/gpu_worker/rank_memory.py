"""`python -m tests.gpu_worker.rank_memory MODEL_DIR RANK WORLD_SIZE`: loads one rank's slice
of the model and prints, as JSON, the parameter bytes it holds and the peak of the process's
private (anonymous) memory during the load above what it used before, sampled every ms. File
pages of the memory-mapped checkpoint are shared page cache, not counted."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch

from tgq.gpu_worker.loader import load_model
from tgq.gpu_worker.parallel import TensorParallel


def anonymous_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main() -> None:
    model_dir, rank, world_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    before = anonymous_bytes()
    peak, done = before, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, anonymous_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    loaded = load_model(model_dir, device=torch.device("cpu"), tp=TensorParallel(rank, world_size))
    done.set()
    sampler.join()
    peak = max(peak, anonymous_bytes())
    num_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    print(json.dumps({"param_bytes": num_bytes, "peak_anon_bytes": peak - before}))


if __name__ == "__main__":
    main()
