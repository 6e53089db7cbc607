"""The api refuses to start on a quantized checkpoint, with the message the batcher gives
(tests/gpu_worker/test_quantized.py), before it serves anything."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.api.stack import Stack


def test_the_api_does_not_start_on_a_quantized_checkpoint(
    text_model_dir: Path, pg_url: str, tmp_path: Path
) -> None:
    model_dir = tmp_path / "awq"
    shutil.copytree(text_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    section = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": section}))
    stack = Stack(model_dir, pg_url, tmp_path)
    try:
        with pytest.raises(RuntimeError, match="the api exited") as caught:
            stack.start_api()
    finally:
        stack.stop()
    assert (
        "quantized checkpoints are not supported yet: this one uses quant_method 'awq'"
        " (config.json quantization_config)"
    ) in str(caught.value)
