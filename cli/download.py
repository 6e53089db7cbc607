"""`tgq download MODEL_ID`: the hub snapshot of a model's safetensors weights, config and
tokenizer files (no pickle weights), as the batcher would fetch it; prints the local path.

Progress bars go to stderr, the path to stdout. With `HF_HUB_OFFLINE=1` only the local cache is
read.
"""

from __future__ import annotations

import argparse

from huggingface_hub.utils import enable_progress_bars

from tgq.cli import CommandError
from tgq.gpu_worker.hub import ModelNotFoundError, PickleWeightsError, resolve_model_dir


def download(args: argparse.Namespace) -> int:
    enable_progress_bars()  # a no-op warning when HF_HUB_DISABLE_PROGRESS_BARS is set
    try:
        path = resolve_model_dir(args.model_id, revision=args.revision, cache_dir=args.cache_dir)
    except (ModelNotFoundError, PickleWeightsError) as error:
        raise CommandError(str(error)) from error
    print(path)
    return 0
