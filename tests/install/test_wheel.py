"""The wheel, built from the repository's files, holds nothing outside `tgq/` (so Hugging Face's
`kernels`, which the latest transformers pulls in, stays Hugging Face's); installed into a fresh
venv beside the latest transformers, `tgq serve` with Postgres and Redis, started from a
directory outside the repository, answers `/generate` and `/v1/chat/completions`; the kernel
sources the installed package builds from are the repository's.

The venv is built once per module (torch from the local wheel first; the rest from pip's cache
or the index): about a minute on two cores."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest

from tests.install.venvs import (
    ROOT,
    assert_kernels_is_hugging_faces,
    complete_requests,
    kernel_sources,
    new_venv,
    run,
    serving,
    source_copy,
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = source_copy(tmp_path_factory.mktemp("source"))
    out = tmp_path_factory.mktemp("wheel")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    run([*pip_wheel, "-w", out, source], cwd=out)
    (built,) = out.glob("tgq-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A fresh venv with torch, the wheel (the repository's pins, transformers apart) and the
    latest transformers."""
    return new_venv(tmp_path_factory.mktemp("venv"), wheel, "transformers>=5.25")


def test_the_wheel_holds_only_tgq(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"tgq", wheel.name.split("-py3")[0] + ".dist-info"}, sorted(tops)
    sources = {Path(name).name for name in names if name.startswith("tgq/kernels/csrc/")}
    assert sources == {p.name for p in (ROOT / "kernels" / "csrc").iterdir()}
    migrations = {name for name in names if name.startswith("tgq/migrations/")}
    expected = {f"tgq/{p.relative_to(ROOT)}" for p in (ROOT / "migrations").rglob("*.*")}
    assert migrations == {m for m in expected if "__pycache__" not in m}


def test_the_installed_wheel_serves_beside_hugging_faces_kernels(
    venv: Path, model_dir: Path, tmp_path: Path
) -> None:
    found = assert_kernels_is_hugging_faces(venv, tmp_path)
    assert not Path(str(found["tgq"])).resolve().is_relative_to(ROOT), found
    # The installed kernels build from the wheel's copies of the sources this suite builds and
    # runs (byte for byte, every one the build lists, at the path it reads them from), with the
    # same torch; building them again here took ~3 minutes of the suite's 2 cores, so the
    # service runs without them (DISABLE_CUSTOM_KERNELS), as in the editable install's test.
    for installed in kernel_sources(venv, tmp_path):
        assert installed.read_bytes() == (ROOT / "kernels" / "csrc" / installed.name).read_bytes()
    own_cache = tmp_path / "kernel-cache"
    with serving(
        venv, model_dir, tmp_path, TGQ_KERNEL_CACHE=str(own_cache), DISABLE_CUSTOM_KERNELS="true"
    ) as url:
        complete_requests(url)
    assert not own_cache.exists() or not any(own_cache.rglob("*.so")), sorted(own_cache.rglob("*"))
    assert_kernels_is_hugging_faces(venv, tmp_path)
