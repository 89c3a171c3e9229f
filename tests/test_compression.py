"""`compression="zstd"`: chunks go through zarr v3's blosc codec, compressed where a probe
shows that pays at the speed the store takes this process's writes, else stored as they
are behind blosc's header. Either way they restore exactly, any zarr reader reads them,
and checksums, damage checks, ranged restores, copies and reuse keep working."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
import zarr
from builders import mesh
from fault_proxy import Delay, FaultProxy
from jax.sharding import NamedSharding, PartitionSpec as P

import zarrckpt
from zarrckpt import _storage
from zarrckpt._format import chunks as _chunks
from zarrckpt._options import SaveOptions
from zarrckpt._save import protocol as _protocol
from zarrckpt._save.compression import Compressor


def weights() -> dict:
    """Weights as a model holds them (normally distributed: no trained model ships in a
    package here), bf16 and f32, sharded over 8 devices in 256 KiB chunks and more, and
    a leaf of random bytes, which no compressor shrinks."""
    sharding = NamedSharding(mesh((8,), ("fsdp",)), P("fsdp"))
    return {"w16": jax.device_put(jax.random.normal(jax.random.key(0), (1024, 1024), jnp.bfloat16), sharding),
            "w32": jax.device_put(jax.random.normal(jax.random.key(1), (512, 1024), jnp.float32), sharding),
            "noise": np.random.default_rng(0).integers(0, 256, 2**20, np.uint8),
            "small": np.arange(16.0)}


def stored_sizes(step: Path, leaf: str) -> list[int]:
    return [p.stat().st_size for p in sorted((step / leaf).iterdir()) if p.name.startswith("c")]


def save_with(url: str, tree: dict, compressor: Compressor, **options) -> None:
    """A save whose cost model starts from `compressor` (what a manager knows of its
    store's speed after its first save)."""
    job = _protocol.SaveJob.create(_storage.resolve(url), tree, SaveOptions(compression="zstd", **options),
                                   compressor=compressor)
    job.run_admitted()


def slow_store() -> Compressor:
    compressor = Compressor()
    compressor.wrote(2**20, 20.0)  # 50 KB/s a writer: what this process's own writes cannot undo
    return compressor


def fast_store() -> Compressor:
    compressor = Compressor()
    compressor.wrote(2**30, 1e-3)  # faster than any compressor
    return compressor


def chunk_bytes(url: str, leaf: str) -> int:
    stored = next(m for m in zarrckpt.metadata(url).leaves if m.name == leaf)
    return int(np.prod(stored.chunks)) * np.dtype(stored.dtype).itemsize


def test_on_a_slow_store_compressible_chunks_are_compressed_and_restore_exactly(tmp_path):
    tree = weights()
    url = str(tmp_path / "ckpt")
    save_with(url, tree, slow_store())
    # bf16 weights shrink by about a quarter (their exponents alike); f32's, by less
    # than pays for itself, may be either.
    sizes = stored_sizes(tmp_path / "ckpt", "w16")
    assert len(sizes) >= 2 and all(size < 0.85 * chunk_bytes(url, "w16") for size in sizes), sizes
    # Random bytes do not shrink: stored as they are, behind blosc's header, then the CRC.
    assert stored_sizes(tmp_path / "ckpt", "noise") == [2**20 + _chunks.BLOSC_HEADER + _chunks.CHECKSUM_BYTES]
    restored = zarrckpt.load_pytree(url, target=tree)
    for leaf in tree:
        assert np.array_equal(np.asarray(restored[leaf]), np.asarray(tree[leaf])), leaf
    assert zarrckpt.verify(url).ok


def test_on_a_fast_store_nothing_is_compressed_and_every_chunk_is_blosc_framed(tmp_path):
    tree = weights()
    url = str(tmp_path / "ckpt")
    save_with(url, tree, fast_store())
    for leaf in ("w16", "w32", "noise"):
        framed = chunk_bytes(url, leaf) + _chunks.BLOSC_HEADER + _chunks.CHECKSUM_BYTES
        assert set(stored_sizes(tmp_path / "ckpt", leaf)) == {framed}, leaf
    # A leaf too small to gain from blosc is stored as zarrckpt always stores it.
    assert stored_sizes(tmp_path / "ckpt", "small") == [16 * 8 + _chunks.CHECKSUM_BYTES]
    restored = zarrckpt.load_pytree(url, target=tree)
    assert all(np.array_equal(np.asarray(restored[k]), np.asarray(tree[k])) for k in tree)


@pytest.mark.parametrize("store", ["slow", "fast"])
def test_zarr_python_and_tensorstore_read_compressed_and_framed_chunks(tmp_path, store):
    tree = weights()
    save_with(str(tmp_path / "ckpt"), tree, slow_store() if store == "slow" else fast_store())
    for leaf in ("w32", "noise"):
        expected = np.asarray(tree[leaf])
        assert np.array_equal(zarr.open_array(str(tmp_path / "ckpt" / leaf), mode="r")[...], expected), leaf
        opened = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "ckpt" / leaf)}},
                         open=True, read=True).result()
        assert np.array_equal(opened.read().result(), expected), leaf


def test_a_compressed_step_restores_onto_another_mesh_reading_parts_of_chunks(tmp_path):
    tree = weights()
    save_with(str(tmp_path / "ckpt"), tree, slow_store())
    other = NamedSharding(mesh((2, 4), ("a", "b")), P("b", "a"))  # blocks across every stored chunk
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other) for k, v in tree.items()
              if k in ("w16", "w32")}
    restored = zarrckpt.load_pytree(str(tmp_path / "ckpt"), target=target, partial=True)
    for leaf in target:
        assert restored[leaf].sharding == other
        assert np.array_equal(np.asarray(restored[leaf]), np.asarray(tree[leaf])), leaf


def corrupt(chunk: Path, at: int, value: bytes, fix_crc: bool) -> None:
    data = bytearray(chunk.read_bytes())
    data[at:at + len(value)] = value
    if fix_crc:
        data[-4:] = _chunks._crc(bytes(data[:-4]))
    chunk.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["payload bit", "header size, checksum fixed", "header compressor, checksum fixed",
                                    "stored-as-is size, checksum fixed", "cut short"])
def test_a_damaged_compressed_chunk_is_an_error_naming_it_never_values(tmp_path, damage):
    tree = {"w": jax.device_put(jax.random.normal(jax.random.key(0), (2048, 1024), jnp.bfloat16),
                                NamedSharding(mesh((8,), ("x",)), P("x")))}
    save_with(str(tmp_path / "ckpt"), tree, fast_store() if damage.startswith("stored") else slow_store())
    chunks = sorted((tmp_path / "ckpt" / "w").glob("c.*"))
    assert len(chunks) > 1
    chunk = chunks[1]
    if damage == "payload bit":
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x10
        chunk.write_bytes(bytes(data))
    elif damage == "header size, checksum fixed":
        corrupt(chunk, 4, (2**20 + 2).to_bytes(4, "little"), fix_crc=True)  # claims more than the chunk holds
    elif damage == "header compressor, checksum fixed":
        header = chunk.read_bytes()[:3]
        corrupt(chunk, 2, bytes([(header[2] & 0x1F) | (1 << 5)]), fix_crc=True)  # lz4, not zstd
    elif damage == "stored-as-is size, checksum fixed":
        data = chunk.read_bytes()
        chunk.write_bytes(data[:-1000])
        corrupt(chunk, 0, b"", fix_crc=True)
    else:
        chunk.write_bytes(chunk.read_bytes()[:10])
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=chunk.name.replace(".", r"\.")):
        zarrckpt.load_pytree(str(tmp_path / "ckpt"))
    report = zarrckpt.verify(str(tmp_path / "ckpt"))
    assert [problem.key for problem in report.problems] == [f"w/{chunk.name}"], report.problems


def test_without_checksums_a_damaged_compressed_chunk_is_still_refused(tmp_path):
    tree = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(256, 256)), jnp.bfloat16)}
    save_with(str(tmp_path / "ckpt"), tree, slow_store(), checksums=False)
    chunk = tmp_path / "ckpt" / "w" / "c.0.0"
    data = bytearray(chunk.read_bytes())
    assert len(data) < 256 * 256 * 2  # compressed
    data[_chunks.BLOSC_HEADER + 40:] = bytes(len(data) - _chunks.BLOSC_HEADER - 40)  # the stream zeroed
    chunk.write_bytes(bytes(data))
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=r"c\.0\.0"):
        zarrckpt.load_pytree(str(tmp_path / "ckpt"))


def test_copy_and_export_of_a_compressed_step_keep_its_values(tmp_path):
    pytest.importorskip("safetensors")
    tree = weights()
    save_with(str(tmp_path / "ckpt"), tree, slow_store())
    zarrckpt.copy_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "copy"))
    copied = zarrckpt.load_pytree(str(tmp_path / "copy"))
    assert all(np.array_equal(np.asarray(copied[k]), np.asarray(tree[k])) for k in tree)
    assert stored_sizes(tmp_path / "copy", "w16") == stored_sizes(tmp_path / "ckpt", "w16")
    zarrckpt.export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors"))
    exported = zarrckpt.load_safetensors(str(tmp_path / "model.safetensors"))
    assert np.array_equal(np.asarray(exported["w32"]), np.asarray(tree["w32"]))


def test_a_manager_with_compression_reuses_unchanged_compressed_chunks(tmp_path):
    tree = weights()
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=False, compression="zstd") as manager:
        manager._compressor.wrote(2**20, 20.0)  # as if its store were slow
        manager.save(1, tree)
        manager.save(2, {**tree, "small": np.arange(16.0) + 1})
    first, second = tmp_path / "0000000001" / "w16", tmp_path / "0000000002" / "w16"
    for a, b in zip(sorted(first.glob("c.*")), sorted(second.glob("c.*"))):
        assert a.stat().st_ino == b.stat().st_ino  # linked, not written again
        assert a.stat().st_size < 0.85 * chunk_bytes(str(tmp_path / "0000000001"), "w16")
    restored = zarrckpt.load_checkpoint(str(tmp_path), 2, tree)
    assert np.array_equal(np.asarray(restored["w16"]), np.asarray(tree["w16"]))


def test_on_a_slow_object_store_a_save_learns_to_compress(s3_server):
    """S3 behind a proxy that holds every write 50 ms: the first chunks are written
    whole (nothing is known of the store's speed yet), the rest compressed; zarr-python
    reads every one of them through s3fs."""
    proxy = FaultProxy(s3_server.endpoint, "s3")
    try:
        proxy.fault = lambda kind, method, target, body: Delay(0.05) if kind == "write" else None
        bucket = s3_server.new_bucket()
        options = {**s3_server.options(), "endpoint_url": proxy.endpoint}
        values = np.random.default_rng(0).normal(size=(64, 2**15)).astype(np.float32)
        tree = {"w": jnp.asarray(values).astype(jnp.bfloat16)}
        url = f"s3://{bucket}/ckpt"
        zarrckpt.save_pytree(url, tree, storage_options=options, compression="zstd", max_chunk_bytes=2**18,
                             max_workers=2)
        fs = fsspec.filesystem("s3", **s3_server.options())
        sizes = [fs.size(key) for key in fs.ls(f"{bucket}/ckpt/w") if key.rsplit("/", 1)[1].startswith("c.")]
        whole = 2**18 + _chunks.BLOSC_HEADER + _chunks.CHECKSUM_BYTES
        assert len(sizes) == 16 and any(size < 2**18 for size in sizes), sizes
        assert all(size <= whole for size in sizes), sizes
        store = zarr.storage.FsspecStore.from_url(f"{url}/w", storage_options=s3_server.options(), read_only=True)
        assert np.array_equal(zarr.open_array(store, mode="r")[...], np.asarray(tree["w"]))
        restored = zarrckpt.load_pytree(url, storage_options=s3_server.options())
        assert np.array_equal(np.asarray(restored["w"]), np.asarray(tree["w"]))
    finally:
        proxy.stop()


@pytest.mark.parametrize(("value", "error"), [("gzip", ValueError), ("ZSTD", ValueError), (1, TypeError),
                                               (True, TypeError)])
def test_an_unknown_compression_is_refused_naming_the_option(tmp_path, value, error):
    with pytest.raises(error, match="compression"):
        zarrckpt.save_pytree(str(tmp_path / "x"), {"a": np.ones(4)}, compression=value)
    with pytest.raises(error, match="compression"):
        zarrckpt.CheckpointManager(str(tmp_path / "run"), compression=value)
    assert not (tmp_path / "x").exists()


def padded_frame(codec: _chunks.ChunkCodec, data: np.ndarray) -> bytes:
    """A compressed blosc frame of `data` that holds exactly the chunk's bytes plus
    blosc's header (blosc itself can make one), yet is not one stored as it is: the
    frame zero-padded to that size, its header saying so. blosc and zarr decode it."""
    frame = bytearray(codec.compress(codec.payload(data)))
    assert len(frame) < data.nbytes + _chunks.BLOSC_HEADER and not frame[2] & _chunks._MEMCPYED
    frame += bytes(data.nbytes + _chunks.BLOSC_HEADER - len(frame))
    frame[12:16] = len(frame).to_bytes(4, "little")
    return bytes(frame)


def vouch(checkpoint, array: str, chunk: str, crc: bytes) -> None:
    """Records `crc` as the CRC-32C of `chunk` in the commit of `checkpoint`."""
    metadata = checkpoint / "zarr.json"
    document = json.loads(metadata.read_text())
    document["attributes"]["zarrckpt"]["chunks_crc32c"][array][chunk] = int.from_bytes(crc, "little")
    metadata.write_text(json.dumps(document))


def test_a_compressed_chunk_of_the_most_bytes_is_decoded_never_taken_as_it_is(tmp_path):
    tree = {"w": np.random.default_rng(0).normal(size=2**16).astype(np.float32)}
    save_with(str(tmp_path / "ckpt"), tree, fast_store())
    codec = _chunks.ChunkCodec.of("w", np.dtype(np.float32), (2**16,), True, "zstd")
    frame = padded_frame(codec, tree["w"])
    (tmp_path / "ckpt" / "w" / "c.0").write_bytes(frame + _chunks._crc(frame))
    vouch(tmp_path / "ckpt", "w", "c.0", _chunks._crc(frame))  # as if the save had made this frame
    assert np.array_equal(zarrckpt.load_pytree(str(tmp_path / "ckpt"))["w"], tree["w"])  # read into the array
    assert np.array_equal(zarr.open_array(str(tmp_path / "ckpt" / "w"), mode="r")[...], tree["w"])
    # zarrckpt never writes such a frame: one of the most bytes is always stored as it is.
    parts = codec.frame(codec.payload(tree["w"]), frame)
    assert parts[0][2] & _chunks._MEMCPYED and sum(memoryview(p).nbytes for p in parts) == codec.stored_bytes


def test_metadata_declaring_compressed_chunks_zarrckpt_never_writes_is_refused(tmp_path):
    """blosc holds at most 2 GiB in a frame and zarrckpt compresses no chunk under 64
    KiB: a leaf declaring either is damage, before any chunk is read (a tiny object
    would otherwise make a reader allocate what its header claims)."""
    from zarrckpt._format import zarrjson
    from zarrckpt._restore import checkpoint

    for shape, dtype in (((3 * 2**30,), np.uint8), ((1024,), np.uint8)):
        codec = _chunks.ChunkCodec("w", np.dtype(dtype), shape, True, "zstd")
        record = {"kind": "leaf", "name": "w", "type": "numpy", "shape": list(shape), "dtype": "uint8"}
        with pytest.raises(ValueError, match="compressed chunks of"):
            checkpoint.stored_leaf(("w",), record, zarrjson.array_document(shape, codec))
