"""Resolving model dirs (local and hub cache, offline), refusing pickles, reading safetensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tgq.gpu_worker.hub import (
    ModelNotFoundError,
    PickleWeightsError,
    is_hub_offline,
    resolve_model_dir,
)
from tgq.gpu_worker.weights import Checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(10, 6, generator=gen),
        "layers.0.proj.weight": torch.randn(8, 6, generator=gen),
        "layers.1.proj.weight": torch.randn(8, 6, generator=gen),
        "norm.weight": torch.randn(6, generator=gen),
    }


def write_single(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(model_dir / "model.safetensors"))


def write_sharded(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Two shards plus an index, with a stray copy the index does not name (ignored)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(model_dir / file))
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    index = {"metadata": {}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(tensors, str(model_dir / "consolidated.safetensors"))


@pytest.fixture(params=["single", "sharded", "unindexed"])
def model_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    tensors = make_tensors()
    if request.param == "single":
        write_single(tmp_path, tensors)
    elif request.param == "sharded":
        write_sharded(tmp_path, tensors)
    else:
        save_file({"embed.weight": tensors["embed.weight"]}, str(tmp_path / "a.safetensors"))
        rest = {n: t for n, t in tensors.items() if n != "embed.weight"}
        save_file(rest, str(tmp_path / "b.safetensors"))
    return tmp_path


def test_names_shapes_and_full_copy(model_dir: Path) -> None:
    tensors = make_tensors()
    with Checkpoint.open(model_dir) as ckpt:
        assert ckpt.names() == sorted(tensors)
        assert ckpt.has("norm.weight") and not ckpt.has("lm_head.weight")
        assert ckpt.shape("layers.0.proj.weight") == (8, 6)
        for name, expected in tensors.items():
            out = torch.empty_like(expected)
            ckpt.copy_into(name, out)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_sliced_copies_along_dims_0_and_1_convert_to_bf16(model_dir: Path) -> None:
    weight = make_tensors()["layers.1.proj.weight"]
    with Checkpoint.open(model_dir) as ckpt:
        rows = torch.empty(4, 6, dtype=torch.bfloat16)
        ckpt.copy_into("layers.1.proj.weight", rows, dim=0, start=4)
        assert torch.equal(rows, weight[4:].to(torch.bfloat16))
        cols = torch.empty(8, 3, dtype=torch.bfloat16)
        ckpt.copy_into("layers.1.proj.weight", cols, dim=1, start=1, stop=4)
        assert torch.equal(cols, weight[:, 1:4].to(torch.bfloat16))
        last = torch.empty(8, 2)
        ckpt.copy_into("layers.1.proj.weight", last, dim=-1, start=4)
        assert torch.equal(last, weight[:, 4:])


def test_copy_into_a_parameter_that_requires_grad(tmp_path: Path) -> None:
    write_single(tmp_path, make_tensors())
    param = torch.nn.Parameter(torch.empty(6, dtype=torch.bfloat16))
    with Checkpoint.open(tmp_path) as ckpt:
        ckpt.copy_into("norm.weight", param)
        assert torch.equal(param.detach(), make_tensors()["norm.weight"].to(torch.bfloat16))
        assert torch.equal(ckpt.get("norm.weight", torch.float32), make_tensors()["norm.weight"])


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path: Path) -> None:
    write_single(tmp_path, make_tensors())
    with Checkpoint.open(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=r"'embed.weight'.*\(5, 6\).*\(10, 6\).*\(4, 6\)"):
            ckpt.copy_into("embed.weight", torch.empty(4, 6), stop=5)
        with pytest.raises(ValueError, match="out of range"):
            ckpt.copy_into("embed.weight", torch.empty(4, 6), start=8, stop=12)
        with pytest.raises(ValueError, match="has no dim 2"):
            ckpt.copy_into("embed.weight", torch.empty(10, 6), dim=2)
        with pytest.raises(KeyError, match="'missing' is not in the checkpoint"):
            ckpt.copy_into("missing", torch.empty(1))


def test_close_releases_handles(tmp_path: Path) -> None:
    write_single(tmp_path, make_tensors())
    ckpt = Checkpoint.open(tmp_path)
    ckpt.close()
    assert ckpt.names() == []


def test_local_dir_resolves_to_itself(tmp_path: Path) -> None:
    write_single(tmp_path, make_tensors())
    assert resolve_model_dir(str(tmp_path)) == tmp_path


def test_local_dir_with_only_pickle_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(os.urandom(64))
    with pytest.raises(PickleWeightsError, match=r"\(pytorch_model.bin\); tgq loads safetensors"):
        resolve_model_dir(str(tmp_path))


def test_local_dir_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"no \*.safetensors weights in"):
        resolve_model_dir(str(tmp_path))


def make_hub_cache(cache: Path, repo: str, files: dict[str, bytes]) -> Path:
    """The huggingface_hub cache layout: refs/main -> commit, snapshots/<commit>/<files>."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(COMMIT)
    snapshot = storage / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return snapshot


def safetensors_bytes(tmp_path: Path) -> bytes:
    write_single(tmp_path / "src", make_tensors())
    return (tmp_path / "src" / "model.safetensors").read_bytes()


def test_hub_id_resolves_from_the_cache_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = {"config.json": b"{}", "model.safetensors": safetensors_bytes(tmp_path)}
    snapshot = make_hub_cache(tmp_path / "cache", "org/tiny", files)
    cache = tmp_path / "cache"
    assert resolve_model_dir("org/tiny", cache_dir=cache) == snapshot
    assert resolve_model_dir("org/tiny", revision=COMMIT, cache_dir=str(cache)) == snapshot
    with Checkpoint.open(snapshot) as ckpt:
        assert ckpt.names() == sorted(make_tensors())


def test_unknown_hub_id_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "true")
    with pytest.raises(ModelNotFoundError, match=r"'org/absent'.*revision=main.*offline"):
        resolve_model_dir("org/absent", cache_dir=tmp_path)


def test_hub_repo_with_only_pickle_weights_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = {"config.json": b"{}", "pytorch_model.bin": os.urandom(64)}
    make_hub_cache(tmp_path, "org/old", files)
    with pytest.raises(PickleWeightsError, match=r"hub repo 'org/old'.*never unpickles"):
        resolve_model_dir("org/old", cache_dir=tmp_path)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("TRUE", True), ("yes", True), ("on", True), ("0", False), ("", False)],
)
def test_offline_flag_is_read_at_call_time(
    value: str, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert is_hub_offline() is expected


def test_missing_local_path_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="is not a local directory"):
        resolve_model_dir(str(tmp_path / "no" / "such" / "dir"))
