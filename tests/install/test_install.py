"""tgq as users install it, in one fresh venv beside the latest transformers (so Hugging Face's
`kernels`): the wheel, built from the repository's files, holds nothing outside `tgq/` and the
kernel sources the installed package builds from are the repository's; installed, and then the
repository installed editable in its place, `tgq serve` with Postgres and Redis, started from a
directory outside the repository, answers `/generate` and `/v1/chat/completions`, with
`DISABLE_CUSTOM_KERNELS` and without building the C++ kernels (the suite builds and runs them
from these very sources).

The venv is built once (torch from the local wheel first; the rest, with the wheel's pins, from
pip's cache or the index: about a minute on two cores); each test installs its own tgq into it
(`--no-deps`: the dependencies are the same)."""

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


def install_tgq(venv: Path, cwd: Path, *target: str | Path) -> None:
    """tgq from `target` (the wheel, or `-e` the repository) in place of the venv's own; an
    editable build uses the venv's setuptools, as the wheel's build uses the tests' own."""
    pip: list[str | Path] = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile"]
    run([*pip, "--no-deps", "--force-reinstall", "--no-build-isolation", *target], cwd=cwd)


def serves_without_building_the_kernels(venv: Path, model_dir: Path, tmp_path: Path) -> None:
    own_cache = tmp_path / "kernel-cache"
    with serving(
        venv, model_dir, tmp_path, TGQ_KERNEL_CACHE=str(own_cache), DISABLE_CUSTOM_KERNELS="true"
    ) as url:
        complete_requests(url)
    assert not own_cache.exists() or not any(own_cache.rglob("*.so")), sorted(own_cache.rglob("*"))
    assert_kernels_is_hugging_faces(venv, tmp_path)


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
    venv: Path, wheel: Path, model_dir: Path, tmp_path: Path
) -> None:
    install_tgq(venv, tmp_path, wheel)
    found = assert_kernels_is_hugging_faces(venv, tmp_path)
    assert not Path(str(found["tgq"])).resolve().is_relative_to(ROOT), found
    # The installed kernels build from the wheel's copies of the sources this suite builds and
    # runs (byte for byte, every one the build lists, at the path it reads them from), with the
    # same torch; building them again here took ~3 minutes of the suite's 2 cores.
    for installed in kernel_sources(venv, tmp_path):
        assert installed.read_bytes() == (ROOT / "kernels" / "csrc" / installed.name).read_bytes()
    serves_without_building_the_kernels(venv, model_dir, tmp_path)


def test_an_editable_install_serves_beside_hugging_faces_kernels(
    venv: Path, model_dir: Path, tmp_path: Path
) -> None:
    install_tgq(venv, tmp_path, "-e", ROOT)
    found = assert_kernels_is_hugging_faces(venv, tmp_path)
    assert Path(str(found["tgq"])).resolve().is_relative_to(ROOT), found
    serves_without_building_the_kernels(venv, model_dir, tmp_path)
