"""An editable install of the repository, in a fresh venv beside the latest transformers (and so
Hugging Face's `kernels`): `tgq serve` with Postgres and Redis and `DISABLE_CUSTOM_KERNELS`,
started from a directory outside the repository, answers `/generate` and `/v1/chat/completions`
without building the C++ kernels."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.install.venvs import (
    ROOT,
    assert_kernels_is_hugging_faces,
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
    # With DISABLE_CUSTOM_KERNELS nothing builds the C++ kernels (the suite itself builds them
    # from these very sources): the cache given stays empty.
    own_cache = tmp_path / "kernel-cache"
    with serving(
        venv, model_dir, tmp_path, TGQ_KERNEL_CACHE=str(own_cache), DISABLE_CUSTOM_KERNELS="true"
    ) as url:
        complete_requests(url)
    assert not own_cache.exists() or not any(own_cache.rglob("*.so")), sorted(own_cache.rglob("*"))
