"""Damage to a committed checkpoint is always an error naming what is damaged, or, when
choosing the newest step, a skipped step with a warning: never wrong values."""

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import zarr

import zarrckpt
import zarrckpt._storage


def saved(tmp_path) -> Path:
    for step in (1, 2):
        zarrckpt.save_checkpoint(str(tmp_path), step, {"w": np.arange(64, dtype=np.float32).reshape(8, 8) + step,
                                                       "b": np.ones(3)}, max_chunk_bytes=64)
    return tmp_path / "0000000002"


def flip_byte(url):
    chunk = url / "w" / "c.1.0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x10
    chunk.write_bytes(bytes(data))


def flip_checksum(url):
    chunk = url / "w" / "c.1.0"
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0x01
    chunk.write_bytes(bytes(data))


def truncate(url):
    chunk = url / "w" / "c.1.0"
    chunk.write_bytes(chunk.read_bytes()[:-3])


def extend(url):
    chunk = url / "w" / "c.1.0"
    chunk.write_bytes(chunk.read_bytes() + b"\0")


def delete_chunk(url):
    os.remove(url / "w" / "c.1.0")


@pytest.mark.parametrize("damage, message", [
    (flip_byte, r"chunk 'w/c.1.0' of checkpoint .*0000000002 fails its CRC-32C checksum"),
    (flip_checksum, r"chunk 'w/c.1.0' of checkpoint .*0000000002 fails its CRC-32C checksum"),
    (truncate, r"chunk 'w/c.1.0' of checkpoint .*0000000002 has 65 bytes, expected 68"),
    (extend, r"chunk 'w/c.1.0' of checkpoint .*0000000002 has 69 bytes, expected 68"),
    (delete_chunk, r"chunk 'w/c.1.0' is missing from checkpoint .*0000000002"),
])
def test_damaged_chunks_are_errors_naming_leaf_and_chunk(tmp_path, damage, message):
    url = saved(tmp_path)
    damage(url)
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=message) as info:
        zarrckpt.load_pytree(str(url))
    assert "while reading leaf ['w']" in "\n".join(info.value.__notes__)


@pytest.mark.parametrize("damage, load_error", [
    (lambda url: (url / "zarr.json").unlink(), "no checkpoint at"),
    (lambda url: (url / "zarr.json").write_text("{ not json"), "is not a JSON object"),
    (lambda url: edit(url, lambda d: d["attributes"].update(write_completed="yes")), "is not committed"),
])
def test_damaged_commit_metadata_is_skipped_with_a_warning(tmp_path, caplog, damage, load_error):
    url = saved(tmp_path)
    damage(url)
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        state, step = zarrckpt.load_checkpoint_if_it_exists(str(tmp_path), {"w": np.zeros((8, 8), np.float32),
                                                                            "b": np.zeros(3)})
    assert step == 1 and state["w"][0, 0] == 1.0
    if (url / "zarr.json").exists():
        assert "treated as not committed" in caplog.text
    with pytest.raises(zarrckpt.CheckpointError, match=load_error):
        zarrckpt.load_pytree(str(url))


def edit(url, change):
    doc = json.loads((url / "zarr.json").read_text())
    change(doc)
    (url / "zarr.json").write_text(json.dumps(doc))


def test_corrupted_array_metadata_is_an_error(tmp_path):
    url = saved(tmp_path)
    edit(url, lambda d: d["consolidated_metadata"]["metadata"]["w"].update(data_type="int32"))
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=r"leaf \['w'\]: array data_type 'int32'"):
        zarrckpt.load_pytree(str(url))


@pytest.mark.parametrize("url_of", [lambda tmp_path: str(tmp_path / "ckpt"), lambda tmp_path: f"memory://{tmp_path}/ckpt"],
                         ids=["local", "memory"])
def test_damage_anywhere_in_a_large_chunk_is_caught(tmp_path, url_of):
    """A flipped bit at the start, in the middle or at the end of a multi-MiB chunk is
    caught, whether the chunk is read straight into the array (a local file) or
    fetched whole (any other store)."""
    url = url_of(tmp_path)
    x = np.random.default_rng(0).standard_normal(3 * 2**20 // 4 + 3, dtype=np.float32)
    zarrckpt.save_pytree(url, {"x": x})
    loc = zarrckpt._storage.resolve(url)
    np.testing.assert_array_equal(zarr.open_array(zarr.storage.FsspecStore.from_url(url) if url.startswith("memory")
                                                  else zarr.storage.LocalStore(url), path="x", mode="r")[...], x)
    good = loc.read("x/c.0", cap=None)
    for offset in (7, len(good) // 2, len(good) - 6):
        loc.write("x/c.0", good[:offset] + bytes([good[offset] ^ 1]) + good[offset + 1:])
        with pytest.raises(zarrckpt.CheckpointCorruptError, match="fails its CRC-32C checksum"):
            zarrckpt.load_pytree(url)
    loc.write("x/c.0", good)
    np.testing.assert_array_equal(zarrckpt.load_pytree(url)["x"], x)


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_a_chunk_of_another_save_in_a_committed_step_is_damage_never_values(new_store, kind):
    """A committed step one of whose chunks another writer replaced with the chunk of
    the same key from another save (a job that took the run over while this one was
    paused, a copy from another run): the chunk's own checksum passes, but its commit
    records another. `verify` fails naming it, a load, a manager's restore and an
    export raise, naming it (before: all passed, and a load returned values of two
    saves)."""
    import fsspec

    store, other = new_store(kind), new_store(kind)
    tree = {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.ones(3)}
    for where, scale in ((store, 1), (other, 2)):
        zarrckpt.save_checkpoint(where.url, 1, {"w": tree["w"] * scale, "b": tree["b"]},
                                 storage_options=where.options, max_chunk_bytes=64)
    fs, root = fsspec.core.url_to_fs(store.url, **(store.options or {}))
    other_fs, other_root = fsspec.core.url_to_fs(other.url, **(other.options or {}))
    fs.pipe_file(f"{root}/0000000001/w/c.1.0", other_fs.cat_file(f"{other_root}/0000000001/w/c.1.0"))
    step = f"{store.url}/0000000001"
    report = zarrckpt.verify(step, storage_options=store.options)
    assert not report.ok and [p.key for p in report.problems] == ["w/c.1.0"], report.problems
    match = r"chunk 'w/c.1.0' of checkpoint .*0000000001 is not the chunk its commit records"
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=match):
        zarrckpt.load_pytree(step, storage_options=store.options)
    with zarrckpt.CheckpointManager(store.url, storage_options=store.options) as mgr:
        with pytest.raises(zarrckpt.CheckpointCorruptError, match=match):
            mgr.restore(tree)
