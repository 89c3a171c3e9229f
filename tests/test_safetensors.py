"""`load_safetensors`: Hugging Face safetensors files, written by the `safetensors`
package itself, restored as nested dicts or onto a mesh, on a local disk and through
fsspec; hostile files refused naming what is wrong."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import fsspec
import jax
import ml_dtypes
import multiprocess
import numpy as np
import pytest
import safetensors.numpy
from builders import mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import zarrckpt
from zarrckpt._format import safetensors as _format
from zarrckpt._util import stats as _stats


def tensors() -> dict[str, np.ndarray]:
    """A small model's tensors in every dtype the format has and zarrckpt reads."""
    rng = np.random.default_rng(0)
    normal = rng.standard_normal
    return {
        "model.embed_tokens.weight": normal((64, 16)).astype(ml_dtypes.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": normal((16, 16)).astype(np.float32),
        "model.layers.0.mlp.up_proj.weight": normal((32, 16)).astype(ml_dtypes.float8_e4m3fn),
        "model.layers.1.mlp.up_proj.weight": normal((32, 16)).astype(ml_dtypes.float8_e5m2),
        "model.layers.1.norm.weight": normal(16).astype(np.float16),
        "model.norm.eps": np.array(1e-6, np.float64),
        "lm_head.bias": np.arange(-5, 5, dtype=np.int64),
        "lm_head.mask": rng.integers(0, 2, (4, 4)).astype(np.bool_),
        "tokens": rng.integers(0, 255, 7).astype(np.uint8),
    }


def at(tree: dict, name: str):
    for part in name.split("."):
        tree = tree[part]
    return tree


def assert_exact(got, want: np.ndarray, name: str) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
    assert np.atleast_1d(got).tobytes() == np.atleast_1d(want).tobytes(), name  # bit for bit: NaNs, -0.0


def sharded_set(folder: Path, every: dict[str, np.ndarray]) -> None:
    """`every` as a two-file set with its index, as `transformers` writes one."""
    names = sorted(every)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    folder.mkdir(parents=True, exist_ok=True)
    for file, part in parts.items():
        safetensors.numpy.save_file({n: every[n] for n in part}, str(folder / file), metadata={"format": "np"})
    weight_map = {n: file for file, part in parts.items() for n in part}
    (folder / _format.INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))


def test_a_file_restores_as_nested_dicts_bit_for_bit(tmp_path: Path) -> None:
    every = tensors()
    safetensors.numpy.save_file(every, str(tmp_path / "model.safetensors"))
    back = zarrckpt.load_safetensors(str(tmp_path / "model.safetensors"))
    assert sorted(back) == ["lm_head", "model", "tokens"] and sorted(back["model"]["layers"]) == ["0", "1"]
    for name, want in every.items():
        assert_exact(at(back, name), want, name)


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_a_sharded_set_lands_on_the_targets_sharding(tmp_path: Path, where: str, request) -> None:
    every = tensors()
    folder = tmp_path / "set"
    sharded_set(folder, every)
    url, options = str(folder), None
    if where != "local":  # any fsspec URL: memory://, and S3 (moto's server on loopback)
        if where == "s3":
            server = request.getfixturevalue("s3_server")
            url, options = f"s3://{server.new_bucket()}/set", server.options()
        else:
            url = f"memory://zarrckpt-tests/{tmp_path.name}/set"
        fs = fsspec.filesystem(url.split("://")[0], **(options or {}))
        for file in folder.iterdir():
            fs.pipe_file(f"{url}/{file.name}", file.read_bytes())
    devices = mesh((2, 4), ("data", "model"))

    def spec(x: np.ndarray) -> P:
        if x.ndim == 2:
            return P("data", "model")  # rows and columns cut
        return P("model") if x.ndim == 1 and x.shape[0] % 4 == 0 else P()

    target = {}
    for name, x in every.items():
        node = target
        *outer, last = name.split(".")
        for part in outer:
            node = node.setdefault(part, {})
        # 64-bit values stay on the host (JAX holds none without jax_enable_x64).
        node[last] = np.zeros(x.shape, x.dtype) if x.dtype.itemsize == 8 else \
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(devices, spec(x)))
    back = zarrckpt.load_safetensors(url, target, storage_options=options)
    checked = 0
    for name, want in every.items():
        got = at(back, name)
        if isinstance(at(target, name), np.ndarray):
            assert_exact(got, want, name)
            continue
        assert got.sharding == at(target, name).sharding, name
        for shard in got.addressable_shards:
            assert_exact(shard.data, want[shard.index], f"{name} {shard.index}")
            checked += 1
    assert checked == 8 * sum(x.dtype.itemsize < 8 for x in every.values())


def test_a_partial_target_reads_its_tensors_alone(tmp_path: Path) -> None:
    every = {"big.weight": np.ones((4096, 256), np.float32), "small.weight": np.arange(16, dtype=np.float32)}
    safetensors.numpy.save_file(every, str(tmp_path / "model.safetensors"))
    _stats.reset()
    back = zarrckpt.load_safetensors(str(tmp_path), {"small": {"weight": np.zeros(16, np.float32)}}, partial=True)
    assert_exact(back["small"]["weight"], every["small.weight"], "small.weight")
    read = _stats.snapshot()["store_bytes_read"]
    assert read <= 64 * 2**10 + 64, f"read {read:,} bytes for a 64-byte tensor beside a 4 MiB one"  # header, it


def test_mismatches_are_listed_as_for_a_checkpoint(tmp_path: Path) -> None:
    safetensors.numpy.save_file(tensors(), str(tmp_path / "model.safetensors"))
    target = {"lm_head": {"bias": np.zeros(3, np.int64), "scale": np.zeros(1)}, "tokens": np.zeros(7, np.uint8)}
    with pytest.raises(zarrckpt.CheckpointMismatchError) as info:
        zarrckpt.load_safetensors(str(tmp_path), target)
    message = str(info.value)
    assert "['lm_head']['bias']: shape (10,) in the checkpoint, (3,) in the target" in message
    assert "['lm_head']['scale']: in the target but not in the checkpoint" in message
    assert "['model']['norm']['eps']: in the checkpoint but not in the target" in message and "partial=True" in message
    # Named as the user named it: the folder, or the one file of it.
    assert message.startswith(f"checkpoint {tmp_path} does not match")
    with pytest.raises(zarrckpt.CheckpointMismatchError) as info:
        zarrckpt.load_safetensors(str(tmp_path / "model.safetensors"), target)
    assert str(info.value).startswith(f"checkpoint {tmp_path / 'model.safetensors'} does not match")


def test_a_directory_without_one_file_or_an_index_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="no .safetensors file there"):
        zarrckpt.load_safetensors(str(tmp_path))
    for name in ("a.safetensors", "b.safetensors"):
        safetensors.numpy.save_file({"x": np.zeros(2)}, str(tmp_path / name))
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="2 .safetensors files and no model.safetensors.index"):
        zarrckpt.load_safetensors(str(tmp_path))
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="no safetensors file at .*c.safetensors"):
        zarrckpt.load_safetensors(str(tmp_path / "c.safetensors"))


def header_file(path: Path, header: dict, data: bytes = b"\0" * 16, length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


@pytest.mark.parametrize(("header", "length", "message"), [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 2**40, "declares a header of 1,099,511,627,776"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, None, "tensor 'w' of 16 bytes"),
    ({"w": {"dtype": "F32", "shape": [2**30], "data_offsets": [0, 2**32]}}, None, "data section of 16"),
    ({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, None, "dtype 'F4', which zarrckpt does not read"),
    ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, None, "of shape [-2]"),
    ({"w": [1, 2]}, None, "described by [1, 2]"),
    ({"a.b": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
      "a.b.c": {"dtype": "U8", "shape": [8], "data_offsets": [8, 16]}}, None, "one is inside the other"),
    ({"__metadata__": {"n": 1}}, None, "__metadata__"),
])
def test_a_hostile_file_is_refused_naming_what_is_wrong(tmp_path: Path, header: dict, length: int | None,
                                                        message: str) -> None:
    header_file(tmp_path / "model.safetensors", header, length=length)
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=tmp_path.name) as info:  # naming where
        zarrckpt.load_safetensors(str(tmp_path))
    assert message in str(info.value)


def test_an_index_naming_a_file_elsewhere_is_refused(tmp_path: Path) -> None:
    (tmp_path / "secret.safetensors").write_bytes(b"")  # outside the set's folder
    folder = tmp_path / "set"
    folder.mkdir()
    weight_map = {"w": "../secret.safetensors"}
    (folder / _format.INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="not a .safetensors file beside it"):
        zarrckpt.load_safetensors(str(folder))


def test_a_file_cut_short_is_damage_named(tmp_path: Path) -> None:
    safetensors.numpy.save_file({"w": np.ones((64, 16), np.float32)}, str(tmp_path / "model.safetensors"))
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="model.safetensors"):
        zarrckpt.load_safetensors(str(path))


def test_each_process_reads_only_the_rows_its_devices_hold(tmp_path: Path) -> None:
    every = {f"layer{i}.weight": np.random.default_rng(i).standard_normal((4096, 1024)).astype(ml_dtypes.bfloat16)
             for i in range(4)}  # 8 MiB each, read in parts of 2048 rows: one per process
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(every, str(path))
    results = multiprocess.run("mp_safetensors", str(path), processes=2, devices=4)
    total = sum(x.nbytes for x in every.values())
    for r in results:
        assert r["checked"] == 4 * 4  # 4 tensors, 4 shards on each process's devices
        assert total / 2 <= r["read"] <= total / 2 + 64 * 2**10, r["read"]  # its half, and the header


def test_a_hugging_face_cache_snapshot_of_links_into_its_blobs_is_read(tmp_path: Path) -> None:
    # huggingface_hub's cache: snapshots/<revision>/<file> are links to ../../blobs/<hash>.
    every = tensors()
    made = tmp_path / "made"
    sharded_set(made, every)
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(made.iterdir())):
        (blobs / f"{i:040x}").write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(f"../../blobs/{i:040x}")
    back = zarrckpt.load_safetensors(str(snapshot))
    for name, want in every.items():
        assert_exact(at(back, name), want, name)
    one = zarrckpt.load_safetensors(str(snapshot / "model-00001-of-00002.safetensors"))
    assert sorted(one) and all(isinstance(x, np.ndarray) for x in jax.tree.leaves(one))


def test_thousands_of_tensors_of_every_size_load_bit_for_bit_each_in_memory_of_its_own(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    # Without a target the file is read as it lies: small tensors together, a large one
    # in parts. Parts of 4 KiB make a few MiB of tensors exercise both.
    monkeypatch.setattr(_format, "PART_BYTES", 4096)
    rng = np.random.default_rng(0)
    kinds = [np.uint8, np.float32, ml_dtypes.bfloat16, np.int64, np.bool_]
    every = {f"layers.{i // 100}.t{i % 100}": rng.integers(0, 100, rng.integers(0, 40, i % 3)).astype(kinds[i % 5])
             for i in range(3000)}  # 0-d, 1-d and 2-d, some with no element
    every.update({"big.weight": rng.standard_normal((100, 50)).astype(np.float32),  # 5 parts of 4 KiB
                  "big.empty": np.zeros((0, 7), np.float16)})
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(every, str(path))
    back = zarrckpt.load_safetensors(str(path), max_workers=4)
    want = safetensors.numpy.load_file(str(path))
    for name in every:
        assert_exact(at(back, name), want[name], name)
        assert at(back, name).flags.owndata, name  # no tensor keeps a buffer of others alive
    assert list(back) == sorted(back) and list(back["layers"]["7"]) == sorted(back["layers"]["7"])  # as saved


@pytest.mark.parametrize(("change", "message"), [
    ("cut", r"model.safetensors ends at byte .* before the end of tensor 'b' .*: it was cut short after it was opened"),
    ("removed", r"model.safetensors was removed while it was being read"),
])
def test_a_file_cut_short_or_removed_once_opened_is_damage_named(tmp_path: Path, change: str, message: str) -> None:
    from zarrckpt._foreign import safetensors as opening
    from zarrckpt._options import LoadOptions

    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"a": np.ones(64, np.float32), "b": np.ones(64, np.float32)}, str(path))
    opened = opening._open(*opening.locate(str(path)))  # its header checked against the whole file
    if change == "cut":
        path.write_bytes(path.read_bytes()[:-100])
    else:
        path.unlink()
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=message):
        opening._load_on_host(opened, LoadOptions())
