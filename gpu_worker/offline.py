"""The offline engine lives in `tgq.batcher.offline`: it is the batcher's `LLMEngine`, which
`gpu_worker` must not import (imports run downward only). This alias stays until `bench/` imports
it from there (issue 24)."""

from tgq.batcher.offline import OfflineEngine

__all__ = ["OfflineEngine"]
