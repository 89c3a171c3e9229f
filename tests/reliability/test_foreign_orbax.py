"""An Orbax checkpoint made by someone else, imported: it can read nothing outside
itself, claim nothing it does not hold, and make no import hang or abort.

Each case is built from a real Orbax save (orbax-checkpoint, OCDBT and one directory
per array), then edited as a hostile or broken source would be."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_cli import run_together
from test_special_files import within_seconds

import zarrckpt
import zarrckpt._storage.guard

LAYOUTS = {"ocdbt": {"use_ocdbt": True}, "per-array": {"use_ocdbt": False},
           "per-array-zarr3": {"use_ocdbt": False, "use_zarr3": True}}


def orbax_item(path: Path, tree: dict, layout: str = "ocdbt") -> Path:
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**LAYOUTS[layout])).save(str(path), tree)
    return path


def rename_key(item: Path, old: str, new: str) -> None:
    """Makes the leaf `old` of the item's `_METADATA` a leaf named `new`."""
    meta = json.loads((item / "_METADATA").read_text())
    entry = meta["tree_metadata"].pop(f"('{old}',)")
    entry["key_metadata"][0]["key"] = new
    meta["tree_metadata"][f"('{new}',)"] = entry
    (item / "_METADATA").write_text(json.dumps(meta))


def chunk_files(array_dir: Path) -> list[Path]:
    return sorted(p for p in array_dir.rglob("*") if p.is_file() and p.name not in (".zarray", ".zattrs", "zarr.json"))


def nothing_landed(dst: Path) -> bool:
    return not dst.exists() or not zarrckpt.all_steps(str(dst.parent))


VICTIM = {"w": jnp.full((8,), 7.0)}


def test_a_percent_encoded_key_never_reads_an_array_outside_the_item(tmp_path):
    """`..%2F..%2Fvictim%2Fw` names no directory of the item; decoded as a URL it would
    name another checkpoint's array."""
    orbax_item(tmp_path / "victim", VICTIM, "per-array")
    item = orbax_item(tmp_path / "src" / "item", {"w": jnp.zeros(8)}, "per-array")
    shutil.rmtree(item / "w")
    rename_key(item, "w", "..%2F..%2Fvictim%2Fw")
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="opening array"):
        zarrckpt.import_checkpoint(str(item), str(tmp_path / "dst"))
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("layout", ["ocdbt", "per-array"])
def test_a_percent_encoded_item_directory_never_reads_another_run(tmp_path, layout):
    """A step's item directory named `p%2F..%2F..%2F..%2Fvictim`: decoded, another run's
    item; as data, an item whose arrays are missing (opening them fails)."""
    orbax_item(tmp_path / "victim", VICTIM, layout)
    step = tmp_path / "run" / "5"
    item = orbax_item(step / "p%2F..%2F..%2F..%2Fvictim", {"w": jnp.zeros(8)}, layout)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    for entry in item.iterdir():
        if entry.name not in ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt"):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=r"opening array \S*victim\.w of"):
        zarrckpt.import_checkpoint(str(step), str(tmp_path / "dst"))
    assert nothing_landed(tmp_path / "dst" / "0000000005")


@pytest.mark.parametrize("name", ["exp%41", "exp#1", "exp?a=1"])
@pytest.mark.parametrize("layout", ["ocdbt", "per-array"])
def test_a_source_directory_named_with_url_syntax_imports_its_own_arrays(tmp_path, name, layout):
    orbax_item(tmp_path / "expA", VICTIM, layout)  # what `exp%41` decodes to
    orbax_item(tmp_path / name, {"w": jnp.arange(8.0)}, layout)
    result = zarrckpt.import_checkpoint(str(tmp_path / name), str(tmp_path / "dst"))
    assert np.array_equal(zarrckpt.load_pytree(result.url)["w"], np.arange(8.0))


@pytest.mark.parametrize("layout", ["per-array", "per-array-zarr3"])
@pytest.mark.parametrize("what", ["array directory", "chunk"])
def test_a_symlink_inside_the_item_is_refused_and_never_followed(tmp_path, layout, what):
    orbax_item(tmp_path / "victim", VICTIM, layout)
    item = orbax_item(tmp_path / "item", {"w": jnp.zeros(8)}, layout)
    if what == "array directory":
        shutil.rmtree(item / "w")
        (item / "w").symlink_to(tmp_path / "victim" / "w")
    else:
        chunk = chunk_files(item / "w")[0]
        chunk.unlink()
        chunk.symlink_to(chunk_files(tmp_path / "victim" / "w")[0])
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="symbolic link"):
        zarrckpt.import_checkpoint(str(item), str(tmp_path / "dst"))
    assert not (tmp_path / "dst").exists()


def test_a_symlinked_ocdbt_data_file_is_refused(tmp_path):
    orbax_item(tmp_path / "victim", {"w": jnp.full((8,), 7.0)})
    item = orbax_item(tmp_path / "item", {"w": jnp.full((8,), 3.0)})
    data = next((item / "d").iterdir())
    data.unlink()
    data.symlink_to(next((tmp_path / "victim" / "d").iterdir()))
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="symbolic link"):
        zarrckpt.import_checkpoint(str(item), str(tmp_path / "dst"))


@pytest.mark.parametrize("layout", ["per-array", "per-array-zarr3"])
def test_a_missing_chunk_is_damage_named_not_zeros(tmp_path, layout):
    item = orbax_item(tmp_path / "item", {"w": jnp.arange(4096.0).reshape(64, 64)}, layout)
    meta = json.loads((item / "_METADATA").read_text())
    assert meta["store_array_data_equal_to_fill_value"] is True  # Orbax says it wrote every chunk
    chunk_files(item / "w")[0].unlink()
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=r"array w of .* lacks chunks of 16.0 KiB"):
        zarrckpt.import_checkpoint(str(item), str(tmp_path / "dst"))
    assert not (tmp_path / "dst").exists()


def test_an_item_orbax_wrote_sparse_imports_missing_chunks_as_the_fill_value_and_says_so(tmp_path, caplog):
    item = orbax_item(tmp_path / "item", {"w": jnp.arange(8.0)}, "per-array")
    meta = json.loads((item / "_METADATA").read_text())
    meta["store_array_data_equal_to_fill_value"] = False  # as an older Orbax wrote it: all-zero chunks left out
    (item / "_METADATA").write_text(json.dumps(meta))
    for chunk in chunk_files(item / "w"):
        chunk.unlink()
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        result = zarrckpt.import_checkpoint(str(item), str(tmp_path / "dst"))
    assert np.array_equal(zarrckpt.load_pytree(result.url)["w"], np.zeros(8))
    assert any("lack chunks" in r.getMessage() and "(w)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("layout", ["per-array", "per-array-zarr3"])
def test_a_huge_claim_in_small_metadata_is_refused_before_anything_is_written(tmp_path, layout):
    """1 KB of metadata claiming 32 GiB: every chunk it claims must be there."""
    item = orbax_item(tmp_path / "item", {"w": jnp.arange(8.0)}, layout)
    meta_file = item / "w" / ("zarr.json" if layout.endswith("zarr3") else ".zarray")
    meta = json.loads(meta_file.read_text())
    meta["shape"] = [2**32]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=r"lacks chunks of 16.0 GiB"):
        zarrckpt.import_checkpoint(str(item), str(tmp_path / "dst"))
    assert not (tmp_path / "dst").exists()


def test_a_sparse_claim_larger_than_fill_values_could_be_is_refused_before_anything_is_written(tmp_path):
    """An item that says it was written sparse may lack chunks of fill values, up to 4x
    what it stores plus 1 GiB: an 4 PiB claim is refused (and would not fit the disk)."""
    item = orbax_item(tmp_path / "item", {"w": jnp.arange(8.0)}, "per-array")
    meta = json.loads((item / "_METADATA").read_text())
    meta["store_array_data_equal_to_fill_value"] = False
    (item / "_METADATA").write_text(json.dumps(meta))
    zarray = json.loads((item / "w" / ".zarray").read_text())
    zarray["shape"], zarray["chunks"] = [2**50], [2**20]  # 4 PiB, chunks of 4 MiB
    (item / "w" / ".zarray").write_text(json.dumps(zarray))
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="lacks chunks of 4.0 PiB .* more than chunks of fill"):
        zarrckpt.import_checkpoint(str(item), str(tmp_path / "dst"))
    assert not (tmp_path / "dst").exists()


def test_arrays_larger_than_the_free_local_disk_are_refused_before_anything_is_written(tmp_path, small_disk):
    item = orbax_item(tmp_path / "item", {"w": jnp.arange(2**20, dtype=jnp.float32)}, "per-array")  # 4 MiB
    with pytest.raises(zarrckpt.CheckpointWriteError, match=r"holds 4.0 MiB of arrays, more than the .* free"):
        zarrckpt.import_checkpoint(str(item), str(small_disk / "dst"))
    assert not (small_disk / "dst").exists()


def test_a_source_chunk_over_the_byte_budget_is_refused_naming_the_option(tmp_path):
    item = orbax_item(tmp_path / "item", {"w": jnp.arange(2**18, dtype=jnp.float32)}, "per-array")  # one 1 MiB chunk
    with pytest.raises(ValueError, match=r"array w .* max_inflight_bytes .* at least 1048576"):
        zarrckpt.import_checkpoint(str(item), str(tmp_path / "dst"), max_inflight_bytes=2**19)
    assert not (tmp_path / "dst").exists()
    small, enough = run_together([["import", str(item), str(tmp_path / name), "--max-inflight-bytes", str(budget)]
                                  for name, budget in (("small", 2**19), ("enough", 2**20))])
    assert small.returncode == 1 and "--max-inflight-bytes" in small.stderr and "max_inflight_bytes" not in small.stderr
    assert enough.returncode == 0, enough.stderr
    assert np.array_equal(zarrckpt.load_pytree(str(tmp_path / "enough"))["w"], np.arange(2**18, dtype=np.float32))


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
@pytest.mark.parametrize("where", ["_METADATA", "chunk"])
def test_a_special_file_in_an_item_is_refused_before_tensorstore_opens_it(tmp_path, special_file, kind, where):
    item = orbax_item(tmp_path / "item", {"w": jnp.arange(8.0)}, "per-array")
    special_file(item / "_METADATA" if where == "_METADATA" else chunk_files(item / "w")[0], kind)
    error = within_seconds(lambda: zarrckpt.import_checkpoint(str(item), str(tmp_path / "dst")))
    assert isinstance(error, zarrckpt.CheckpointCorruptError) and "Orbax checkpoint holds only regular files" in \
        str(error), error
    assert not (tmp_path / "dst").exists()


def test_a_tensorstore_request_that_never_answers_is_abandoned_at_the_stores_deadline(monkeypatch):
    """TensorStore reads an Orbax source on an object store, making and retrying its
    requests itself: an operation of its that never answers is given up (cancelled)
    after the time any request there may take with all its tries (request_timeout_s
    each, and the waits between them), as a TimeoutError (an OSError) naming what was
    read, instead of holding the import forever. TensorStore's own deadline error is
    its error, on a local disk too."""
    import tensorstore as ts

    from zarrckpt._foreign import orbax as _orbax

    monkeypatch.setattr(zarrckpt._storage.guard, "_MAX_BACKOFF_S", 0.01)  # the rule is tested, not the pace
    remote = zarrckpt._storage.resolve("memory://orbax-source", {"request_timeout_s": 0.05})
    what = "reading array w of the Orbax checkpoint memory://orbax-source"
    _, never = ts.Promise.new()
    raised: list[BaseException] = []

    def wait() -> None:  # in a thread: without a deadline, the test fails instead of hanging
        try:
            _orbax._answer(never, remote, what)
        except BaseException as e:
            raised.append(e)

    started = time.monotonic()
    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    waiting.join(30)
    assert not waiting.is_alive(), "a request that never answers was waited for past its deadline"
    assert time.monotonic() - started >= 11 * 0.05 + 10 * 0.01  # every try's deadline, and the waits
    assert isinstance(raised[0], TimeoutError) and what in str(raised[0]) and "no answer in" in str(raised[0])
    assert never.cancelled()
    promise, answered = ts.Promise.new()
    promise.set_result(7)
    assert _orbax._answer(answered, remote, "listing") == 7
    for where in (remote, zarrckpt._storage.resolve(".")):
        promise, failed = ts.Promise.new()
        promise.set_exception(TimeoutError("DEADLINE_EXCEEDED: the store took too long"))
        with pytest.raises(OSError, match="listing: DEADLINE_EXCEEDED: the store took too long"):
            _orbax._answer(failed, where, "listing")
