"""Attacks on reuse by bytes (`_run.same_chunks`): a chunk whose CRC-32C and size match
the step it would be made from is read from it, compared byte for byte, then made from
it only from the version recorded. Another program changing the step between the
compare and the copy, forged records of that step, copies of a run, rollbacks: every
step committed holds the values its save was given, and restores alone."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import fsspec
import jax.numpy as jnp
import numpy as np
import pytest

import zarrckpt
import zarrckpt._commit
import zarrckpt._storage

# Small leaves (below the fingerprinted size): every chunk goes through the byte path.
VALUES = np.arange(4096, dtype=np.int32)


def state(step: int) -> dict:
    return {"w": jnp.asarray(VALUES), "v": jnp.asarray(VALUES[::-1].copy()), "step": jnp.array(step)}


def step_url(store, step: int) -> str:
    return f"{store.url.rstrip('/')}/{step:010d}"


def fs_of(store):
    protocol = store.url.split("://")[0] if "://" in store.url else "file"
    return fsspec.filesystem(protocol, **(store.options or {}))


def chunk_paths(store, step: int) -> list[str]:
    fs = fs_of(store)
    return sorted(p for p in fs.find(step_url(store, step)) if "/c" in p.rpartition(step_url(store, step))[2]
                  and not p.endswith("zarr.json"))


def assert_restores(store, step: int, expected: dict) -> None:
    restored = zarrckpt.load_checkpoint(store.url, step, storage_options=store.options)
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(value))
    assert zarrckpt.verify(step_url(store, step), storage_options=store.options).ok


def change(store, path: str, how: str, other: str) -> None:
    """Another program changes the chunk at `path` of a committed step."""
    fs = fs_of(store)
    data = fs.cat_file(path)
    if how == "deleted":
        fs.rm_file(path)
    elif how == "truncated":
        fs.pipe_file(path, data[: len(data) // 2])
    elif how == "rewritten":  # other bytes, same size
        fs.pipe_file(path, bytes(b ^ 0xFF for b in data[:-4]) + data[-4:])
    elif how == "replaced by another step's chunk":
        fs.pipe_file(path, fs.cat_file(other))
    elif how == "step removed":  # retention of another job, mid-save
        zarrckpt._commit.remove(zarrckpt._storage.resolve(path.rpartition("/w/")[0], store.options))
    elif how == "rewritten in place" and store.kind == "local":
        with open(path, "r+b") as f:
            f.write(bytes(b ^ 0xFF for b in data[:8]))
    else:
        raise AssertionError(how)


HOWS = ["deleted", "truncated", "rewritten", "replaced by another step's chunk", "step removed"]


@pytest.mark.parametrize("kind", ["local", "memory", "s3", "gcs"])
@pytest.mark.parametrize("how", HOWS + ["rewritten in place"])
@pytest.mark.parametrize("saver", ["manager", "unchanged_since"])
def test_a_chunk_changed_as_it_is_copied_is_written_never_made_from_the_change(
        new_store, monkeypatch, kind, how, saver):
    """The chunk of the step made from changes once its bytes matched (on S3 and GCS,
    after the step's chunk was read and compared) and before the copy or link: the copy
    is refused by its version, or (on a local disk and memory://) the chunk made is
    compared and found other; either way the bytes in hand are written."""
    if how == "rewritten in place" and kind != "local":
        pytest.skip("in place: a local file only")
    store = new_store(kind)
    copy_new, changed = zarrckpt._storage.Location.copy_new, []

    def change_then_copy(self, key, source, **kwargs):
        if key.startswith("w/") and not changed:
            path = f"{source.url.rstrip('/')}/{key}"
            if store.kind == "local":
                path = path.removeprefix("file://")
            change(store, path, how, chunk_paths(store, 0)[0] if how.startswith("replaced") else "")
            changed.append(key)
        return copy_new(self, key, source, **kwargs)

    zarrckpt.save_checkpoint(store.url, 0, {"w": jnp.asarray(VALUES + 1)}, storage_options=store.options)
    if saver == "manager":
        with zarrckpt.CheckpointManager(store.url, storage_options=store.options, async_save=False) as mgr:
            mgr.save(1, state(1))
            monkeypatch.setattr(zarrckpt._storage.Location, "copy_new", change_then_copy)
            mgr.save(2, state(2))
            monkeypatch.undo()
    else:
        zarrckpt.save_checkpoint(store.url, 1, state(1), storage_options=store.options)
        monkeypatch.setattr(zarrckpt._storage.Location, "copy_new", change_then_copy)
        zarrckpt.save_checkpoint(store.url, 2, state(2), unchanged_since=1, storage_options=store.options)
        monkeypatch.undo()
    assert changed
    assert_restores(store, 2, state(2))


# -- forged records of the step made from ---------------------------------------------


def forge(step_dir: Path, field: str, value) -> None:
    """Another program rewrites what step's commit records of its chunk w/c.0."""
    path = step_dir / "zarr.json"
    group = json.loads(path.read_text())
    group["attributes"]["zarrckpt"][field]["w"]["c.0"] = value
    path.write_text(json.dumps(group))


def version_of(path: Path) -> str:
    info = path.stat()
    return f"{info.st_mtime_ns}:{info.st_size}"


FORGERIES = {
    "another step's chunk's version": lambda d: ("chunks_version", version_of(d.parent / "0000000000" / "w" / "c.0")),
    "the group metadata's version": lambda d: ("chunks_version", version_of(d / "zarr.json")),
    "a huge string": lambda d: ("chunks_version", "9" * 100_000),
    "a string of 256 colons": lambda d: ("chunks_version", ":" * 256),
    "no size": lambda d: ("chunks_version", "12345"),
    "a size of many digits": lambda d: ("chunks_version", "1:" + "9" * 250),
    "a size that is not the chunk's": lambda d: ("chunks_version",
                                                 version_of(d / "w" / "c.0").rpartition(":")[0] + ":16"),
    "a number": lambda d: ("chunks_version", 7),
    "a crc32c of another chunk": lambda d: ("chunks_crc32c", 12345),
    "a negative crc32c": lambda d: ("chunks_crc32c", -1),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
@pytest.mark.parametrize("saver", ["restored by a manager", "unchanged_since"])
def test_a_forged_record_of_the_step_made_from_never_changes_what_a_save_commits(tmp_path, forgery, saver):
    zarrckpt.save_checkpoint(str(tmp_path), 0, {"w": jnp.asarray(VALUES + 1)})
    zarrckpt.save_checkpoint(str(tmp_path), 1, state(1))
    step1 = tmp_path / "0000000001"
    before = {p: p.read_bytes() for p in step1.rglob("c*") if p.is_file()}
    forge(step1, *FORGERIES[forgery](step1))
    if saver == "unchanged_since":
        zarrckpt.save_checkpoint(str(tmp_path), 2, state(2), unchanged_since=1)
    else:
        with zarrckpt.CheckpointManager(str(tmp_path), async_save=False) as mgr:
            try:
                mgr.restore(state(0), step=1)
            except zarrckpt.CheckpointError:
                pass  # a record it refuses: nothing known, every chunk written
            mgr.save(2, state(2))
    assert {p: p.read_bytes() for p in before} == before
    shutil.rmtree(step1)
    shutil.rmtree(tmp_path / "0000000000")
    assert_restores(type("S", (), {"url": str(tmp_path), "options": None})(), 2, state(2))


# -- copies, farms, rollbacks --------------------------------------------------------


def test_unchanged_since_on_a_copy_made_by_zarrckpt_cp_restores_alone(tmp_path):
    import subprocess
    import sys
    zarrckpt.save_checkpoint(str(tmp_path / "run"), 1, state(1))
    done = subprocess.run([sys.executable, "-m", "zarrckpt", "cp", str(tmp_path / "run" / "0000000001"),
                           str(tmp_path / "copy" / "0000000001")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                              str(Path(zarrckpt.__file__).parents[1]), os.environ.get("PYTHONPATH")]))})
    assert done.returncode == 0, done.stderr
    zarrckpt.save_checkpoint(str(tmp_path / "copy"), 2, state(2), unchanged_since=1)
    zarrckpt.save_checkpoint(str(tmp_path / "copy"), 3, {**state(3), "w": jnp.asarray(VALUES * 2)},
                             unchanged_since=2)
    shutil.rmtree(tmp_path / "run")
    shutil.rmtree(tmp_path / "copy" / "0000000001")
    shutil.rmtree(tmp_path / "copy" / "0000000002")
    restored = zarrckpt.load_checkpoint(str(tmp_path / "copy"), 3)
    np.testing.assert_array_equal(np.asarray(restored["w"]), VALUES * 2)
    np.testing.assert_array_equal(np.asarray(restored["v"]), VALUES[::-1])


def test_a_farm_of_steps_linking_steps_that_link_restores_each_step_alone(tmp_path, tmp_path_factory):
    steps = {s: {**state(s), "w": jnp.asarray(VALUES + (s // 2))} for s in range(1, 7)}
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=False) as mgr:
        for s, given in steps.items():
            mgr.save(s, given)
    chunk = tmp_path / "0000000006" / "v" / "c.0"
    assert chunk.stat().st_nlink == 6  # one file, six steps
    for keep in steps:
        scratch = tmp_path_factory.mktemp(f"alone{keep}")
        shutil.copytree(tmp_path / f"{keep:010d}", scratch / f"{keep:010d}")
        restored = zarrckpt.load_checkpoint(str(scratch), keep)
        for name, value in steps[keep].items():
            np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(value))
    for s in (1, 3, 5, 2, 4):
        zarrckpt._commit.remove(zarrckpt._storage.resolve(str(tmp_path / f"{s:010d}")))
    assert_restores(type("S", (), {"url": str(tmp_path), "options": None})(), 6, steps[6])


def test_a_rollback_then_saves_keep_every_step_as_saved(tmp_path, tmp_path_factory):
    given = {s: {**state(s), "w": jnp.asarray(VALUES * s)} for s in (1, 2, 3)}
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, given[s])
        restored, _ = mgr.restore(state(0), step=1)
        given[4] = {**restored, "step": jnp.array(4)}
        mgr.save(4, given[4])
        given[5] = {**given[4], "w": jnp.asarray(VALUES * 3), "step": jnp.array(5)}  # step 3's bytes, not step 4's
        mgr.save(5, given[5])
    for s in (1, 2, 3, 4, 5):
        scratch = tmp_path_factory.mktemp(f"alone{s}")
        shutil.copytree(tmp_path / f"{s:010d}", scratch / f"{s:010d}")
        assert_restores(type("S", (), {"url": str(scratch), "options": None})(), s, given[s])


@pytest.mark.parametrize("options", [{"compression": "zstd"}, {"checksums": False}], ids=["zstd", "no checksums"])
def test_options_keep_every_step_as_saved(tmp_path, options):
    given = {1: state(1), 2: state(2), 3: {**state(3), "w": jnp.asarray(VALUES + 7)}}
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=False, **options) as mgr:
        for s, value in given.items():
            mgr.save(s, value)
    linked = (tmp_path / "0000000003" / "v" / "c.0").stat().st_nlink
    assert linked == (1 if "checksums" in options else 3)
    for s in (1, 2):
        zarrckpt._commit.remove(zarrckpt._storage.resolve(str(tmp_path / f"{s:010d}")))
    restored = zarrckpt.load_checkpoint(str(tmp_path), 3)
    for name, value in given[3].items():
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(value))


def test_a_restore_with_rename_then_save_keeps_what_the_renamed_leaves_hold(tmp_path):
    """Two leaves swapped by a rename: each restored array holds the other's chunks."""
    big = np.arange(2**20, dtype=np.float32)  # fingerprinted too
    given = {"a": jnp.asarray(big), "b": jnp.asarray(big[::-1].copy()), "c": jnp.asarray(VALUES),
             "d": jnp.asarray(VALUES + 1)}
    swap = {"a": "b", "b": "a", "c": "d", "d": "c"}
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=False) as mgr:
        mgr.save(1, given)
        restored, _ = mgr.restore(given, step=1, rename=lambda name: swap[name])
        mgr.save(2, restored)
        mgr.save(3, restored)
    shutil.rmtree(tmp_path / "0000000001")
    shutil.rmtree(tmp_path / "0000000002")
    expected = {name: given[swap[name]] for name in given}
    assert_restores(type("S", (), {"url": str(tmp_path), "options": None})(), 3, expected)


def test_a_chunk_replaced_before_the_link_by_one_of_the_same_mtime_and_size_is_never_linked(tmp_path, monkeypatch):
    """On a local disk a chunk's version is its modification time and size, which any
    program may set: a file of other bytes renamed over step 1's chunk just before the
    link, its modification time set to the recorded one (`os.utime`, `rsync -t`, `cp -p`),
    passes the link's check; the chunk linked is then read and compared, and written
    over with the bytes in hand. Step 2 restores what was saved."""
    zarrckpt.save_checkpoint(str(tmp_path), 1, state(1))
    copy, changed = zarrckpt._storage.local.LocalDisk.copy, []

    def replace_then_copy(self, key, source, **kwargs):
        if key.endswith("w/c.0") and not changed:
            path = tmp_path / "0000000001" / "w" / "c.0"
            info, data = path.stat(), path.read_bytes()
            aside = path.with_name("aside")
            aside.write_bytes(bytes(b ^ 0xFF for b in data[:-4]) + data[-4:])
            os.utime(aside, ns=(info.st_atime_ns, info.st_mtime_ns))
            aside.rename(path)
            changed.append(key)
        return copy(self, key, source, **kwargs)

    monkeypatch.setattr(zarrckpt._storage.local.LocalDisk, "copy", replace_then_copy)
    zarrckpt.save_checkpoint(str(tmp_path), 2, state(2), unchanged_since=1)
    monkeypatch.undo()
    assert changed
    restored = zarrckpt.load_checkpoint(str(tmp_path), 2)
    np.testing.assert_array_equal(np.asarray(restored["w"]), VALUES)
    assert zarrckpt.verify(str(tmp_path / "0000000002")).ok
