from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.stack import write_text_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_model(tmp_path_factory.mktemp("model"))
