"""Tests for zarrckpt._format.dtypes: ml_dtypes data types in zarr, and TensorStore interop."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import zarr
import zarr.storage
from zarr.dtype import data_type_registry

from zarrckpt._format import dtypes as _dtypes

try:
    from zarr.errors import DataTypeValidationError
except ImportError:  # zarr 3.1
    from zarr.core.dtype.common import DataTypeValidationError

_dtypes.register()

# The exhaustive test data includes signalling NaNs; zarr's empty-chunk check
# compares them with ==, which sets the FP "invalid" flag. Harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

FLOAT_NAMES = [
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
]
INT_NAMES = ["int4", "uint4"]
ALL_NAMES = FLOAT_NAMES + INT_NAMES
# TensorStore 0.1.x has no uint4.
TENSORSTORE_NAMES = [n for n in ALL_NAMES if n != "uint4"]
# Types with a distinct -0.0 whose NumPy kind is "V" (see the module docstring).
SIGNED_ZERO_KIND_V = [
    n for n in FLOAT_NAMES if np.dtype(getattr(ml_dtypes, n)).kind == "V" and "fnuz" not in n
]


def np_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(getattr(ml_dtypes, name))


def all_values(name: str) -> np.ndarray:
    """Every representable value of the type, in bit-pattern order.

    Exhaustive, so NaN payloads, +-inf, -0.0, subnormals and +-max are all in
    it; 4-bit integers get their 16 canonical bytes (the high nibble of a byte
    is not part of the value, so only canonical bytes are expected to survive).
    """
    dtype = np_dtype(name)
    if name in INT_NAMES:
        info = ml_dtypes.iinfo(dtype)
        return np.arange(int(info.min), int(info.max) + 1).astype(dtype)
    bits = np.arange(2 ** (8 * dtype.itemsize), dtype=f"u{dtype.itemsize}")
    return bits.view(dtype)


def as_bytes(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr).view(np.uint8)


def assert_same_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(as_bytes(actual), as_bytes(expected))


def test_special_values_are_covered() -> None:
    # Guards the exhaustive test data: each special value really is in it.
    for name in FLOAT_NAMES:
        values = all_values(name)
        as_f32 = values.astype(np.float32)
        finfo = ml_dtypes.finfo(np_dtype(name))
        assert np.isnan(as_f32).any()
        assert float(finfo.max) in as_f32 and float(finfo.min) in as_f32
        assert float(finfo.smallest_subnormal) in as_f32
        if "fnuz" not in name:
            assert np.signbit(as_f32[as_f32 == 0]).any()
        if name in ("bfloat16", "float8_e5m2"):
            assert np.isposinf(as_f32).any() and np.isneginf(as_f32).any()


def test_register_is_idempotent() -> None:
    _dtypes.register()
    before = dict(data_type_registry.contents)
    _dtypes.register()
    assert data_type_registry.contents == before
    for cls in _dtypes.ZDTYPES:
        assert data_type_registry.get(cls._zarr_v3_name) is cls
    # Every ml_dtypes type still resolves to exactly one wrapper.
    for name in ALL_NAMES:
        assert data_type_registry.match_dtype(np_dtype(name)).to_json(zarr_format=3) == name


def test_register_from_threads() -> None:
    data_type_registry.unregister("bfloat16")
    errors: list[BaseException] = []

    def target() -> None:
        try:
            _dtypes.register()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=target) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert data_type_registry.get("bfloat16") is _dtypes.BFloat16


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> zarr.storage.StoreLike:
    if request.param == "local":
        return zarr.storage.LocalStore(tmp_path)
    return zarr.storage.MemoryStore()


@pytest.mark.parametrize("name", ALL_NAMES)
def test_roundtrip_bit_exact(name: str, store: zarr.storage.StoreLike) -> None:
    values = all_values(name)
    # 2-D with ragged edge chunks, to cross chunk boundaries in both axes.
    data = values.reshape(16, -1) if values.size >= 256 else values.reshape(4, -1)
    chunks = (5, max(1, data.shape[1] // 3))
    arr = zarr.create_array(store, shape=data.shape, dtype=np_dtype(name), chunks=chunks)
    arr[...] = data
    assert arr.nchunks_initialized > 1

    back = zarr.open_array(store, mode="r")
    assert back.dtype == np_dtype(name)
    assert_same_bits(back[...], data)
    # Partial reads cross chunk boundaries too.
    assert_same_bits(back[1:4, 1:-1], data[1:4, 1:-1])


@pytest.mark.parametrize("name", ALL_NAMES)
def test_zarr_json_names(name: str, tmp_path: Path) -> None:
    arr = zarr.create_array(
        zarr.storage.LocalStore(tmp_path),
        shape=(3,),
        dtype=getattr(ml_dtypes, name),  # the scalar type, as users (and jnp) spell it
        chunks=(2,),
        compressors=None,
    )
    arr[:] = np.array([1, 0, 1]).astype(np_dtype(name))
    meta = json.loads((tmp_path / "zarr.json").read_text())
    assert meta["data_type"] == name
    assert meta["fill_value"] == 0
    (bytes_codec,) = meta["codecs"]
    if name == "bfloat16":
        assert bytes_codec == {"name": "bytes", "configuration": {"endian": "little"}}
    else:
        # 1-byte types: no endian, as TensorStore writes them.
        assert bytes_codec.get("configuration", {}).get("endian") is None


def test_big_endian_bfloat16(tmp_path: Path) -> None:
    data = all_values("bfloat16")
    big = data.astype(np_dtype("bfloat16").newbyteorder(">"))
    arr = zarr.create_array(
        zarr.storage.LocalStore(tmp_path), shape=big.shape, dtype=big.dtype, chunks=(10000,),
        serializer=zarr.codecs.BytesCodec(endian="big"), compressors=None,
    )
    arr[:] = big
    meta = json.loads((tmp_path / "zarr.json").read_text())
    assert meta["codecs"][0]["configuration"]["endian"] == "big"
    raw = (tmp_path / "c" / "0").read_bytes()
    assert raw == big[:10000].tobytes()
    back = zarr.open_array(zarr.storage.LocalStore(tmp_path), mode="r")[:]
    np.testing.assert_array_equal(
        as_bytes(back.astype(np_dtype("bfloat16"))), as_bytes(data)
    )


def test_sharded_bfloat16() -> None:
    data = all_values("bfloat16").reshape(256, 256)
    arr = zarr.create_array(
        zarr.storage.MemoryStore(), shape=data.shape, dtype=data.dtype,
        shards=(128, 128), chunks=(32, 64),
    )
    arr[...] = data
    assert_same_bits(arr[...], data)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "int4", "uint4"])
def test_zarr_v2_uncompressed(name: str, tmp_path: Path) -> None:
    data = all_values(name)
    arr = zarr.create_array(
        zarr.storage.LocalStore(tmp_path), shape=data.shape, dtype=name, chunks=(100,),
        zarr_format=2, compressors=None,
    )
    arr[:] = data
    assert json.loads((tmp_path / ".zarray").read_text())["dtype"] == name
    assert_same_bits(zarr.open_array(zarr.storage.LocalStore(tmp_path), mode="r")[:], data)


def test_jax_dtype() -> None:
    jnp = pytest.importorskip("jax.numpy")
    arr = zarr.create_array(zarr.storage.MemoryStore(), shape=(5,), dtype=jnp.bfloat16, chunks=(2,))
    src = jnp.array([1.5, -0.0, jnp.nan, jnp.inf, 3.0], dtype=jnp.bfloat16)
    arr[:] = np.asarray(src)
    assert_same_bits(arr[:], np.asarray(src))


@pytest.mark.parametrize("name", SIGNED_ZERO_KIND_V)
def test_negative_zero_chunks_with_write_empty_chunks(name: str) -> None:
    data = np.array([-0.0, -0.0, 0.0, -0.0]).astype(np_dtype(name))
    arr = zarr.create_array(
        zarr.storage.MemoryStore(), shape=(4,), dtype=name, chunks=(2,),
        config={"write_empty_chunks": True},
    )
    arr[:] = data
    assert_same_bits(arr[:], data)


@pytest.mark.parametrize("name", SIGNED_ZERO_KIND_V)
def test_zarrckpt_keeps_chunks_of_negative_zeros(name: str, tmp_path: Path) -> None:
    """zarr's own writer skips a chunk equal to the fill value, and compares -0.0 == 0.0
    for these dtypes; zarrckpt writes every chunk, so the sign survives, for zarrckpt
    and for zarr reading what zarrckpt wrote."""
    import zarrckpt

    data = np.array([-0.0] * 4).astype(np_dtype(name))
    zarrckpt.save_pytree(str(tmp_path), {"x": data})
    assert_same_bits(zarrckpt.load_pytree(str(tmp_path))["x"], data)
    assert_same_bits(zarr.open_array(zarr.storage.LocalStore(tmp_path / "x"), mode="r")[...], data)


# --- fill values ---------------------------------------------------------------


def bf16_bits(bits: int) -> Any:
    return np.array(bits, np.uint16).view(ml_dtypes.bfloat16)[()]


@pytest.mark.parametrize(
    ("fill", "expected_json", "expected_bits"),
    [
        (0.0, 0.0, 0x0000),
        (-0.0, -0.0, 0x8000),
        (1.5, 1.5, 0x3FC0),
        (float("nan"), "NaN", 0x7FC0),
        (float("inf"), "Infinity", 0x7F80),
        (float("-inf"), "-Infinity", 0xFF80),
        ("NaN", "NaN", 0x7FC0),
        (bf16_bits(0x0001), float(bf16_bits(0x0001)), 0x0001),  # smallest subnormal
        (bf16_bits(0xFFC1), "0xffc1", 0xFFC1),  # non-canonical NaN stays exact
    ],
)
def test_bfloat16_fill_value(
    fill: Any, expected_json: Any, expected_bits: int, tmp_path: Path
) -> None:
    store = zarr.storage.LocalStore(tmp_path)
    zarr.create_array(store, shape=(4,), dtype="bfloat16", chunks=(2,), fill_value=fill)
    stored = json.loads((tmp_path / "zarr.json").read_text())["fill_value"]
    assert stored == expected_json
    if isinstance(expected_json, float):
        assert np.signbit(stored) == np.signbit(expected_json)
    back = zarr.open_array(store, mode="r")
    assert _dtypes._bits(back.fill_value) == expected_bits
    np.testing.assert_array_equal(back[:].view(np.uint16), np.full(4, expected_bits, np.uint16))


@pytest.mark.parametrize("name", FLOAT_NAMES)
def test_fill_value_json_roundtrip(name: str) -> None:
    zdtype = data_type_registry.get(name)()
    for value in all_values(name):
        for fmt in (2, 3):
            encoded = zdtype.to_json_scalar(value, zarr_format=fmt)
            json.dumps(encoded, allow_nan=False)  # strict JSON: no bare NaN
            decoded = zdtype.from_json_scalar(encoded, zarr_format=fmt)
            if fmt == 3 or not np.isnan(float(value)):
                assert _dtypes._bits(decoded) == _dtypes._bits(value)
            else:
                assert np.isnan(float(decoded))


def test_fill_value_parsing() -> None:
    bf16 = _dtypes.BFloat16()
    assert _dtypes._bits(bf16.from_json_scalar("0x7f80", zarr_format=3)) == 0x7F80
    assert _dtypes._bits(bf16.from_json_scalar(None, zarr_format=2)) == 0
    assert float(bf16.from_json_scalar("2.5", zarr_format=2)) == 2.5
    assert float(bf16.from_json_scalar(3, zarr_format=3)) == 3.0
    with pytest.raises(TypeError):
        bf16.from_json_scalar("pi", zarr_format=3)
    with pytest.raises(TypeError):
        bf16.from_json_scalar([1], zarr_format=3)
    with pytest.raises(TypeError):
        bf16.cast_scalar("pi")
    fnuz = _dtypes.Float8E4M3FNUZ()
    assert fnuz.to_json_scalar(float("nan"), zarr_format=3) == "NaN"
    with pytest.raises(ValueError, match="no infinity"):
        fnuz.from_json_scalar("Infinity", zarr_format=3)
    assert _dtypes._bits(fnuz.from_json_scalar("0x80", zarr_format=3)) == 0x80
    e4m3 = _dtypes.Float8E4M3FN()
    assert _dtypes._bits(e4m3.from_json_scalar("0xff", zarr_format=3)) == 0xFF
    assert e4m3.to_json_scalar(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max, zarr_format=3) == 448.0

    int4 = _dtypes.Int4()
    assert int4.to_json_scalar(np.int8(-8), zarr_format=3) == -8
    assert int(int4.from_json_scalar(7, zarr_format=3)) == 7
    assert int(int4.from_json_scalar(-1.0, zarr_format=3)) == -1
    assert int(int4.cast_scalar(ml_dtypes.int4(3))) == 3
    with pytest.raises(ValueError, match="out of range"):
        int4.cast_scalar(8)
    with pytest.raises(ValueError, match="out of range"):
        _dtypes.UInt4().cast_scalar(-1)
    with pytest.raises(TypeError):
        int4.cast_scalar(1.5)
    with pytest.raises(TypeError):
        int4.from_json_scalar("NaN", zarr_format=3)


def test_dtype_json() -> None:
    bf16 = _dtypes.BFloat16
    assert bf16.from_json("bfloat16", zarr_format=3) == bf16()
    assert bf16.from_json({"name": "bfloat16", "object_codec_id": None}, zarr_format=2) == bf16()
    with pytest.raises(DataTypeValidationError):
        bf16.from_json("float16", zarr_format=3)
    with pytest.raises(DataTypeValidationError):
        bf16.from_json({"name": "<V2", "object_codec_id": None}, zarr_format=2)
    with pytest.raises(DataTypeValidationError):
        bf16.from_native_dtype(np.dtype("float16"))
    big = bf16.from_native_dtype(np_dtype("bfloat16").newbyteorder(">"))
    assert big.endianness == "big"
    assert big.to_native_dtype() == np_dtype("bfloat16").newbyteorder(">")
    with pytest.raises(ValueError, match="little-endian"):
        big.to_json(zarr_format=2)
    assert not hasattr(_dtypes.Float8E5M2(), "endianness")
    assert _dtypes.Int4().item_size == 1 and bf16().item_size == 2


# --- TensorStore interop ---------------------------------------------------------


def ts_spec(driver: str, path: Path) -> dict[str, Any]:
    return {"driver": driver, "kvstore": {"driver": "file", "path": str(path)}}


@pytest.mark.parametrize("name", TENSORSTORE_NAMES)
def test_tensorstore_reads_zarr_written(name: str, tmp_path: Path) -> None:
    ts = pytest.importorskip("tensorstore")
    data = all_values(name)
    arr = zarr.create_array(
        zarr.storage.LocalStore(tmp_path), shape=data.shape, dtype=name,
        chunks=(max(1, data.size // 3),),  # default compressor (zstd) on purpose
    )
    arr[:] = data
    got = ts.open(ts_spec("zarr3", tmp_path), open=True).result().read().result()
    assert_same_bits(got, data)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2fnuz", "int4"])
def test_zarr_reads_tensorstore_written(name: str, tmp_path: Path) -> None:
    ts = pytest.importorskip("tensorstore")
    data = all_values(name)
    t = ts.open(
        ts_spec("zarr3", tmp_path), create=True, dtype=name, shape=[data.size + 7],
        chunk_layout=ts.ChunkLayout(chunk_shape=[max(1, data.size // 3)]),
    ).result()
    t[: data.size].write(data).result()
    assert json.loads((tmp_path / "zarr.json").read_text())["data_type"] == name

    back = zarr.open_array(zarr.storage.LocalStore(tmp_path), mode="r")
    got = back[:]
    assert_same_bits(got[: data.size], data)
    # The tail lies in a partly written chunk: TensorStore's fill value (0).
    assert not as_bytes(got[data.size :]).any()


def test_tensorstore_nan_fill_value(tmp_path: Path) -> None:
    ts = pytest.importorskip("tensorstore")
    ts.open(
        ts_spec("zarr3", tmp_path), create=True, dtype="bfloat16", shape=[4],
        fill_value=float("nan"),
    ).result()
    back = zarr.open_array(zarr.storage.LocalStore(tmp_path), mode="r")
    assert _dtypes._bits(back.fill_value) == 0x7FC0
    assert np.isnan(back[:].astype(np.float32)).all()


def test_zarr_reads_tensorstore_v2_bfloat16(tmp_path: Path) -> None:
    ts = pytest.importorskip("tensorstore")
    data = all_values("bfloat16")
    t = ts.open(
        ts_spec("zarr", tmp_path), create=True, dtype="bfloat16", shape=[data.size + 3],
        chunk_layout=ts.ChunkLayout(chunk_shape=[20000]),
    ).result()
    t[: data.size].write(data).result()
    zarray = json.loads((tmp_path / ".zarray").read_text())
    assert zarray["dtype"] == "bfloat16"
    assert zarray["fill_value"] is None  # TensorStore's v2 convention

    back = zarr.open_array(zarr.storage.LocalStore(tmp_path), mode="r", zarr_format=2)
    assert back.dtype == np_dtype("bfloat16")
    assert_same_bits(back[: data.size], data)  # blosc-compressed by TensorStore


# --- other readers of a real zarrckpt checkpoint --------------------------------


def _saved_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """A zarrckpt checkpoint (CRC-32C on every chunk; small shards merged side by side,
    large ones split) of the dtypes other readers should read; returns its values."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import zarrckpt

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    values = {"bf16": np.arange(64 * 64).reshape(64, 64).astype(ml_dtypes.bfloat16),
              "f8": (np.arange(256) % 17).astype(ml_dtypes.float8_e4m3fn),
              "i4": (np.arange(96) % 16 - 8).astype(ml_dtypes.int4),
              "f32": np.arange(2**19, dtype=np.float32).reshape(1024, 512)}
    specs = {"bf16": P("a", "b"), "f8": P("b"), "i4": P(), "f32": P("a")}
    zarrckpt.save_pytree(str(path), {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in values.items()},
                         max_chunk_bytes=2**19)
    return values


def test_tensorstore_reads_a_zarrckpt_checkpoint(tmp_path: Path) -> None:
    ts = pytest.importorskip("tensorstore")
    values = _saved_checkpoint(tmp_path)
    for name, expected in values.items():
        document = json.loads((tmp_path / name / "zarr.json").read_text())
        assert {"name": "crc32c"} in document["codecs"]
        got = ts.open(ts_spec("zarr3", tmp_path / name), open=True).result().read().result()
        assert_same_bits(got, expected)
    assert len(list((tmp_path / "f32").glob("c.*"))) > 2  # split chunks
    assert len(list((tmp_path / "bf16").glob("c.*"))) < 8  # merged shards


def test_plain_zarr_reads_zarrckpt_dtypes_without_importing_zarrckpt(tmp_path: Path) -> None:
    """Installed zarrckpt registers its dtypes through zarr's entry points (zarr loads
    them, and so zarrckpt, when it meets `bfloat16`); zarr 3.1 never loads data types
    from entry points, so there a reader imports zarrckpt first (as
    docs/pytree-zarr-checkpoint.md says)."""
    import subprocess
    import sys

    values = _saved_checkpoint(tmp_path)
    read = ("import sys, numpy as np, zarr; {first}g = zarr.open_group(sys.argv[1], mode='r'); "
            "np.save(sys.stdout.buffer, np.concatenate([np.ascontiguousarray(g[k][...]).view(np.uint8).ravel() "
            "for k in sys.argv[2:]]))")
    names = list(values)
    expected = np.concatenate([np.ascontiguousarray(values[k]).view(np.uint8).ravel() for k in names])
    plain = subprocess.run([sys.executable, "-c", read.format(first=""), str(tmp_path), *names],
                           capture_output=True)
    if zarr.__version__.startswith("3.1."):
        assert b"No Zarr data type found that matches 'bfloat16'" in plain.stderr
        plain = subprocess.run([sys.executable, "-c", read.format(first="import zarrckpt; "),
                                str(tmp_path), *names], capture_output=True)
    assert plain.returncode == 0, plain.stderr.decode()[-2000:]
    import io
    np.testing.assert_array_equal(np.load(io.BytesIO(plain.stdout)), expected)
