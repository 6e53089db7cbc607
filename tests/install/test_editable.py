"""An editable install of the repository, in a fresh venv beside the latest transformers (and so
Hugging Face's `kernels`): `tgq serve` with Postgres and Redis, started from a directory outside
the repository, answers `/generate` and `/v1/chat/completions`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.install.venvs import (
    ROOT,
    assert_kernels_is_hugging_faces,
    build_kernels,
    complete_requests,
    new_venv,
    serving,
)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with torch, the repository installed editable (its pins, transformers apart)
    and the latest transformers."""
    return new_venv(tmp_path_factory.mktemp("venv"), "transformers>=5.25", editable=ROOT)


def test_an_editable_install_serves_beside_hugging_faces_kernels(
    venv: Path, model_dir: Path, tmp_path: Path
) -> None:
    found = assert_kernels_is_hugging_faces(venv, tmp_path)
    assert Path(str(found["tgq"])).resolve().is_relative_to(ROOT), found
    # DISABLE_CUSTOM_KERNELS keeps the model's layers off the C++ kernels, but the sampler's
    # argmax still loads them: built first, in a cache of the test's own (the session's cache
    # holds a build for the tests' torch, which this one must not rewrite under them).
    own_cache = tmp_path / "kernel-cache"
    build_kernels(venv, own_cache, tmp_path)
    with serving(
        venv, model_dir, tmp_path, TGQ_KERNEL_CACHE=str(own_cache), DISABLE_CUSTOM_KERNELS="true"
    ) as url:
        complete_requests(url)
