"""A safetensors file or set made by someone else, loaded (into host memory and onto a
mesh) and imported: it claims no byte it does not hold, names no tensor twice, makes
nothing allocate past its own size, and loads every shape Hugging Face writes exactly;
anything else is a CheckpointCorruptError naming the file and the tensor, before a byte
of data is read or anything is committed.

Files as Hugging Face writes them are written by the `safetensors` package itself;
hostile ones, and the extremes of what an array holds, by hand."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors.numpy
from builders import mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import zarrckpt
from zarrckpt._format import safetensors as _format
from zarrckpt._util import stats as _stats

WAYS = ["load", "mesh", "import"]  # load_safetensors without a target, onto a mesh; import_checkpoint


def hostile(path: Path, header: dict | bytes, data: bytes) -> Path:
    """A file of `header` (a dict, or JSON text as bytes: a dict cannot name a key twice)
    and `data`, as a hostile writer makes one."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def u8(begin: int, end: int, shape: list[int] | None = None) -> dict:
    return {"dtype": "U8", "shape": [end - begin] if shape is None else shape, "data_offsets": [begin, end]}


def attempt(way: str, path: Path, shapes: dict[str, tuple[tuple[int, ...], np.dtype]]):
    """Loads or imports the file or set at `path` one way; `shapes` are what the target
    of a load onto a mesh asks for (every tensor replicated over 8 devices)."""
    if way == "load":
        return zarrckpt.load_safetensors(str(path))
    if way == "mesh":
        everywhere = NamedSharding(mesh((8,), ("x",)), P())
        target = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=everywhere)
                  for name, (shape, dtype) in shapes.items()}
        return zarrckpt.load_safetensors(str(path), target)
    return zarrckpt.import_checkpoint(str(path), str(path.parent / "imported"))


def refused(way: str, path: Path, shapes: dict, *messages: str) -> None:
    """`attempt` raises CheckpointCorruptError naming `path` and saying `messages`, with
    no data read and nothing imported."""
    _stats.reset()
    with pytest.raises(zarrckpt.CheckpointCorruptError) as info:
        attempt(way, path, shapes)
    for expected in (str(path), *messages):
        assert expected in str(info.value), (expected, str(info.value))
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")  # or the first read, 64 KiB, if more
    assert _stats.snapshot()["store_bytes_read"] <= max(header, 64 * 2**10), "read data of a file it refused"
    assert not (path.parent / "imported").exists()


@pytest.mark.parametrize("way", WAYS)
def test_tensors_sharing_bytes_are_refused_not_multiplied(tmp_path: Path, way: str) -> None:
    """256 tensors over the same MiB: a 1 MiB file that loaded as 256 MiB (Hugging
    Face's reader: "invalid offset"); a header at its 100 MiB cap could claim 1.2 TiB."""
    path = hostile(tmp_path / "model.safetensors", {f"t{i:03d}": u8(0, 2**20) for i in range(256)}, b"\1" * 2**20)
    shapes = {f"t{i:03d}": ((2**20,), np.dtype(np.uint8)) for i in range(256)}
    refused(way, path, shapes, "'t000' (bytes [0, 1,048,576]) and 't001' (bytes [0, 1,048,576]) over the same bytes")


@pytest.mark.parametrize(("header", "data", "message"), [
    ({"a": u8(0, 4), "b": u8(8, 12)}, 12, "4 bytes between tensors 'a' and 'b' that no tensor holds"),
    ({"a": u8(4, 8)}, 8, "4 bytes before its first tensor 'a' that no tensor holds"),
    ({"a": u8(0, 4)}, 12, "8 bytes after its last tensor 'a' that no tensor holds"),
    ({"a": u8(0, 4), "z": u8(2, 2, [0, 3])}, 4, "'a' (bytes [0, 4]) and 'z' (bytes [2, 2]) over the same bytes"),
    ({}, 4, "4 bytes of data and no tensor"),
], ids=["gap", "before", "after", "empty-inside-another", "no-tensor"])
def test_bytes_no_tensor_holds_or_two_tensors_hold_are_refused(tmp_path: Path, header: dict, data: int,
                                                                message: str) -> None:
    """The tensors tile the data section exactly, as Hugging Face's reader requires: a
    byte outside every tensor is damage, or data hidden from readers that check."""
    path = hostile(tmp_path / "model.safetensors", header, b"\0" * data)
    refused("load", path, {}, message)


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
     b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', "naming 'a' twice"),
    (b'{"a": {"dtype": "F32", "dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}', "naming 'dtype' twice"),
], ids=["tensor", "field"])
@pytest.mark.parametrize("way", WAYS)
def test_a_header_naming_a_key_twice_is_refused(tmp_path: Path, raw: bytes, message: str, way: str) -> None:
    """json keeps the last of two keys: `a` was loaded from bytes [1, 2] where a reader
    keeping the first reads [0, 1]."""
    path = hostile(tmp_path / "model.safetensors", raw, b"\1\2")
    refused(way, path, {"a": ((1,), np.dtype(np.uint8))}, message)


def two_files(folder: Path, first: dict[str, np.ndarray], second: dict[str, np.ndarray], index: bytes) -> Path:
    folder.mkdir()
    safetensors.numpy.save_file(first, str(folder / "model-00001-of-00002.safetensors"))
    safetensors.numpy.save_file(second, str(folder / "model-00002-of-00002.safetensors"))
    (folder / _format.INDEX_NAME).write_bytes(index)
    return folder


@pytest.mark.parametrize("way", WAYS)
def test_a_tensor_in_two_files_of_a_set_is_refused(tmp_path: Path, way: str) -> None:
    index = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                       "b": "model-00002-of-00002.safetensors"}}).encode()
    folder = two_files(tmp_path / "set", {"a": np.zeros(2, np.uint8)},
                       {"a": np.ones(2, np.uint8), "b": np.ones(2, np.uint8)}, index)
    shapes = {"a": ((2,), np.dtype(np.uint8)), "b": ((2,), np.dtype(np.uint8))}
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="tensor 'a' is in two files of .*set: "
                       "'model-00001-of-00002.safetensors' and 'model-00002-of-00002.safetensors'"):
        attempt(way, folder, shapes)


@pytest.mark.parametrize("way", WAYS)
def test_an_index_listing_a_tensor_twice_is_refused(tmp_path: Path, way: str) -> None:
    """`a` listed in the second file, then the first: json kept the first file's, and
    the set loaded as if the index had said so."""
    index = (b'{"weight_map": {"a": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors", '
             b'"b": "model-00002-of-00002.safetensors"}}')
    folder = two_files(tmp_path / "set", {"a": np.zeros(2, np.uint8)}, {"b": np.ones(2, np.uint8)}, index)
    shapes = {"a": ((2,), np.dtype(np.uint8)), "b": ((2,), np.dtype(np.uint8))}
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=f"{_format.INDEX_NAME} lists 'a' twice"):
        attempt(way, folder, shapes)


def test_a_sparse_index_is_refused_at_the_header_cap_without_reading_it_whole(tmp_path: Path) -> None:
    """An index of 3 GiB that takes 8 KiB of disk took 6.18 GiB of memory before it
    was found not to be JSON (here one of three times the cap): an index is read under
    the cap a header is."""
    folder = tmp_path / "set"
    folder.mkdir()
    with open(folder / _format.INDEX_NAME, "wb") as f:
        f.truncate(3 * _format.MAX_HEADER_BYTES)  # a hole: no disk, all zeros
    safetensors.numpy.save_file({"a": np.zeros(2, np.uint8)}, str(folder / "model-00001-of-00001.safetensors"))
    tracemalloc.start()
    try:
        with pytest.raises(zarrckpt.CheckpointCorruptError, match=f"{_format.INDEX_NAME} is over 104,857,600 bytes"):
            zarrckpt.load_safetensors(str(folder))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * _format.MAX_HEADER_BYTES, f"{peak:,} bytes allocated for an index it refused"


@pytest.mark.parametrize("way", WAYS)
def test_tensors_with_a_zero_size_dimension_load_exactly_as_empty_arrays(tmp_path: Path, way: str) -> None:
    """Hugging Face writes and reads a (0, 5) tensor; zarrckpt raised ZeroDivisionError."""
    every = {"empty_rows": np.zeros((0, 5), np.float32), "empty_columns": np.zeros((3, 0), np.int8),
             "w": np.arange(8, dtype=np.float32)}
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(every, str(path))
    shapes = {name: (x.shape, x.dtype) for name, x in every.items()}
    assert {name: (x.shape, x.dtype) for name, x in safetensors.numpy.load_file(str(path)).items()} == shapes
    back = attempt(way, path, shapes)
    if way == "import":
        back = zarrckpt.load_pytree(back.url)
    for name, want in every.items():
        got = np.asarray(back[name])
        assert got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want), name


@pytest.mark.parametrize(("shape", "message"), [
    ([2**64, 0], "'h' of shape [18446744073709551616, 0], not a list of ints from 0 to 2**63 - 1"),
    ([2**63, 0], "'h' of shape [9223372036854775808, 0]"),
    ([-1, 0], "'h' of shape [-1, 0]"),
    ([1.0, 0], "'h' of shape [1.0, 0]"),
    ([True, 0], "'h' of shape [True, 0]"),
    ([1] * 65, "'h' of 65 dimensions, more than an array has (64)"),
    ([1] * 100, "'h' of 100 dimensions"),
    ([2**62, 2, 0], "'h' of shape [4611686018427387904, 2, 0]: its other dimensions span 2**63 bytes"),
    ([2**32, 2**32, 0], "'h' of shape [4294967296, 4294967296, 0]: its other dimensions"),
])
@pytest.mark.parametrize("way", ["load", "import"])
def test_a_shape_no_array_has_is_refused_before_anything_is_committed(tmp_path: Path, shape: list, message: str,
                                                                      way: str) -> None:
    """[2**64, 0] was committed by an import that nothing could then load; rank 100
    raised numpy's ValueError."""
    path = hostile(tmp_path / "model.safetensors", {"h": u8(0, 1, shape)}, b"\1")
    refused(way, path, {}, message)


@pytest.mark.parametrize("shape", [(2**63 - 1, 0), (1,) * 64], ids=["largest-dimension", "most-dimensions"])
def test_the_largest_shapes_an_array_has_load_and_import(tmp_path: Path, shape: tuple[int, ...]) -> None:
    size = int(np.prod(shape, dtype=object))
    path = hostile(tmp_path / "model.safetensors", {"h": u8(0, size, list(shape))}, b"\7" * size)
    assert zarrckpt.load_safetensors(str(path))["h"].shape == shape
    result = zarrckpt.import_checkpoint(str(path), str(tmp_path / "imported"))
    assert np.asarray(zarrckpt.load_pytree(result.url)["h"]).shape == shape


@pytest.mark.parametrize("way", WAYS)
def test_a_name_nested_deeper_than_a_tree_saves_is_refused(tmp_path: Path, way: str) -> None:
    """A name of 2,000 parts between dots raised RecursionError."""
    name = ".".join(["a"] * 2000)
    path = hostile(tmp_path / "model.safetensors", {name: u8(0, 1)}, b"\1")
    refused(way, path, {name: ((1,), np.dtype(np.uint8))}, "of 2,000 parts between dots, deeper than a tree "
            "zarrckpt saves (100)")

