"""A file linked into two steps, as a save that reuses an unchanged chunk links it: no
path that writes or deletes one step (a save over it, `overwrite=True`, a copy onto
it, an import, a deletion, `zarrckpt gc`, a save killed while it links) changes a byte
the other step holds."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import fsspec
import jax
import multiprocess
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from test_cli import run
from test_kill import Watched
from workers.common import distinct_values

import zarrckpt
from zarrckpt import _storage
from zarrckpt._util import stats as _stats


def files_of(step: Path) -> dict[str, bytes]:
    return {str(p.relative_to(step)): p.read_bytes() for p in sorted(step.rglob("*")) if p.is_file()}


def linked_step(run_dir: Path, src: int, dst: int, *, committed: bool = True) -> None:
    """Step `dst` made of hard links to every file of step `src` (without its group
    metadata, the commit, unless `committed`)."""
    for path in sorted((run_dir / f"{src:010d}").rglob("*")):
        target = run_dir / f"{dst:010d}" / path.relative_to(run_dir / f"{src:010d}")
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif committed or path.relative_to(run_dir / f"{src:010d}") != Path("zarr.json"):
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)


@pytest.mark.parametrize("how", ["in place", "atomic", "as a save's object"])
def test_a_write_over_a_file_linked_elsewhere_leaves_the_other_name_as_it_was(tmp_path, how):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "c").write_bytes(b"kept" * 1000)
    os.link(tmp_path / "a" / "c", tmp_path / "b" / "c")
    loc = _storage.resolve(str(tmp_path))
    if how == "as a save's object":
        loc.write_new("b/c", b"new")
    else:
        loc.write("b/c", b"new", atomic=how == "atomic", durable=True)
    assert (tmp_path / "a" / "c").read_bytes() == b"kept" * 1000
    assert (tmp_path / "b" / "c").read_bytes() == b"new"
    assert (tmp_path / "a" / "c").stat().st_nlink == 1


def test_a_write_over_a_file_of_its_own_still_replaces_all_of_it(tmp_path):
    """The file is emptied first, not written over its start: a shorter write leaves
    no tail of the longer file it replaced."""
    (tmp_path / "c").write_bytes(b"x" * 1000)
    _storage.resolve(str(tmp_path)).write("c", b"short", durable=True)
    assert (tmp_path / "c").read_bytes() == b"short"


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal(32), "step": seed}


@pytest.mark.parametrize("path", ["save with overwrite", "save over uncommitted", "copy onto it", "import onto it",
                                  "manager delete", "gc"])
def test_every_path_that_writes_or_deletes_a_step_leaves_a_step_sharing_its_files_as_it_was(tmp_path, path):
    import safetensors.numpy

    run_dir = tmp_path / "run"
    zarrckpt.save_checkpoint(str(run_dir), 1, state(1))
    before = files_of(run_dir / "0000000001")
    other = 0 if path == "gc" else 2  # gc keeps the newest step: the linked one is older
    linked_step(run_dir, 1, other, committed=path != "save over uncommitted")
    if path == "save with overwrite":
        zarrckpt.save_checkpoint(str(run_dir), 2, state(2), overwrite=True)
    elif path == "save over uncommitted":
        zarrckpt.save_checkpoint(str(run_dir), 2, state(2))
    elif path == "copy onto it":
        zarrckpt.save_pytree(str(tmp_path / "other"), state(2))
        zarrckpt.copy_checkpoint(str(tmp_path / "other"), str(run_dir / "0000000002"), overwrite=True)
    elif path == "import onto it":
        safetensors.numpy.save_file({"w": state(2)["w"]}, str(tmp_path / "model.safetensors"))
        zarrckpt.import_checkpoint(str(tmp_path / "model.safetensors"), str(run_dir), step=2, overwrite=True)
    elif path == "manager delete":
        with zarrckpt.CheckpointManager(str(run_dir)) as manager:
            manager.delete(2)
    else:
        assert run("gc", str(run_dir), "--keep-last", "1").returncode == 0
    if path in ("save with overwrite", "save over uncommitted", "copy onto it"):
        restored = zarrckpt.load_checkpoint(str(run_dir), 2, state(0))
        assert np.array_equal(restored["w"], state(2)["w"]) and restored["step"] == 2
    elif path in ("manager delete", "gc"):
        assert not (run_dir / f"{other:010d}").exists()
    assert files_of(run_dir / "0000000001") == before
    assert zarrckpt.verify(str(run_dir / "0000000001")).ok
    restored = zarrckpt.load_checkpoint(str(run_dir), 1, state(0))
    assert all(np.array_equal(restored[k], v) for k, v in state(1).items())


def digests(url: str, options: dict | None, step: int) -> dict[str, str]:
    """The sha256 of every object of `step` under `url`, by its key."""
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    fs.invalidate_cache()
    top = f"{root}/{step:010d}"
    return {path[len(top):]: hashlib.sha256(fs.cat_file(path)).hexdigest() for path in fs.find(top)}


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_save_killed_while_it_links_unchanged_chunks_leaves_every_earlier_step_as_it_was(
        tmp_path, new_store, kind):
    """A manager saves steps 1 and 2 of a state whose base does not change, then step 3,
    and is killed (SIGKILL) inside step 3's first copy of a base chunk from step 2, the
    others still to make (workers/kill_target.py, `linking`): steps 1 and 2 are byte for
    byte as they were, step 3 is not committed, and a new manager in a new process
    restores step 2 and saves step 3 again, which commits, its base made from step 2's
    chunks again, and every step restores exactly."""
    store = new_store(kind)
    go = tmp_path / "go"
    os.mkfifo(go)
    pipe = os.open(go, os.O_RDWR)  # never blocks: the worker reads its line whenever it opens it
    try:
        (proc,) = multiprocess.launch("kill_target", "linking", store.url, str(go), processes=1, devices=8,
                                      storage_options=store.options)
        child = Watched(proc)
        try:
            assert child.wait_for("committed 2", 180), proc.output.read_text(errors="replace")[-5000:]
            before = {step: digests(store.url, store.options, step) for step in (1, 2)}
            os.write(pipe, b"go\n")
            assert child.wait_for("linked", 180), proc.output.read_text(errors="replace")[-5000:]
            proc.kill()  # SIGKILL: inside a copy, the rest of the base's chunks not made
        finally:
            proc.kill()
            proc.wait()
            shutil.rmtree(proc.said.parent, ignore_errors=True)
    finally:
        os.close(pipe)
    base = {step: {key for key in digests(store.url, store.options, step) if key.startswith("/base/c")}
            for step in (2, 3)}
    assert base[3] and base[3] < base[2], (len(base[3]), len(base[2]))  # some made, not all
    assert {step: digests(store.url, store.options, step) for step in (1, 2)} == before
    assert zarrckpt.all_steps(store.url, storage_options=store.options) == [1, 2]

    (relinked,) = multiprocess.run("kill_target", "relink", store.url, "3", processes=1, devices=8,
                                   storage_options=store.options)
    assert relinked["restored"] == 2
    assert zarrckpt.all_steps(store.url, storage_options=store.options) == [1, 2, 3]
    assert {step: digests(store.url, store.options, step) for step in (1, 2)} == before
    for step, attempt in ((1, 0), (2, 0), (3, 1)):
        restored = zarrckpt.load_checkpoint(store.url, step, storage_options=store.options)
        np.testing.assert_array_equal(restored["base"], distinct_values(0, 0, 0, restored["base"].shape))
        np.testing.assert_array_equal(restored["adapter"], distinct_values(1, step, attempt, restored["adapter"].shape))
        assert restored["step"] == step
    assert zarrckpt.verify(_storage.resolve(store.url, store.options).step(3).url,
                           storage_options=store.options).ok
    if kind == "local":  # made from step 2's chunks again: the same files
        inodes = {step: {p.name: p.stat().st_ino for p in (Path(store.url) / f"{step:010d}" / "base").glob("c*")}
                  for step in (2, 3)}
        assert inodes[3] == inodes[2] and len(inodes[3]) == len(base[2])


@pytest.mark.parametrize("planted", ["a symbolic link to a file outside", "a FIFO"])
@pytest.mark.parametrize("together", [False, True], ids=["alone", "together"])
def test_a_chunk_made_from_a_planted_link_or_fifo_is_refused_and_nothing_is_followed(tmp_path, planted, together):
    """An unchanged chunk is linked from the step before: what is planted there is
    linked as itself, never followed or read (a FIFO would block a reader), then
    removed and refused, alone or among a save's writes made together."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"not a checkpoint's")
    run_dir = tmp_path / "run"
    (run_dir / "1" / "a").mkdir(parents=True)
    if planted == "a FIFO":
        os.mkfifo(run_dir / "1" / "a" / "c.0")
    else:
        (run_dir / "1" / "a" / "c.0").symlink_to(outside)
    root = _storage.resolve(str(run_dir))
    if together:
        with pytest.raises(zarrckpt.CheckpointCorruptError), root.child("2").write_batch() as new:
            new.copy_new("a/c.0", root.child("1"), nbytes=18, expect="any version: never looked at")
    else:
        with pytest.raises(zarrckpt.CheckpointCorruptError):
            root.child("2").copy_new("a/c.0", root.child("1"), nbytes=18, expect="any version: never looked at")
    assert not os.path.lexists(run_dir / "2" / "a" / "c.0")
    assert outside.read_bytes() == b"not a checkpoint's" and os.stat(outside).st_nlink == 1


@pytest.mark.parametrize("learnt", ["saved", "restored"])
@pytest.mark.parametrize("kind", ["local", "memory", "s3", "gcs"])
def test_a_chunk_rewritten_after_its_step_was_saved_or_restored_is_never_made_from(new_store, kind, learnt):
    """A manager knows step 1 (it saved it, or a new manager restored it); another
    program then rewrites a chunk of it with a valid chunk of other values (as zarr-python
    does: a new object at its key; the commit and save identity untouched). The next
    save of the very same arrays fails naming that chunk, nothing of it committed,
    rather than make the new step from it; the save after writes every chunk, and both
    steps it holds restore exactly what was saved."""
    store, other = new_store(kind), new_store(kind)
    options = store.options
    w = np.arange(2**18, dtype=np.float32)
    state1 = {"w": jax.device_put(w), "step": 1}
    zarrckpt.save_checkpoint(other.url, 1, {"w": w + 1, "step": 1}, storage_options=other.options)
    fs, root = fsspec.core.url_to_fs(store.url, **(options or {}))
    other_fs, other_root = fsspec.core.url_to_fs(other.url, **(other.options or {}))
    with zarrckpt.CheckpointManager(store.url, async_save=False, storage_options=options) as mgr:
        mgr.save(1, state1)
    with zarrckpt.CheckpointManager(store.url, async_save=False, storage_options=options) as mgr:
        if learnt == "restored":
            state1, _ = mgr.restore({"w": jax.device_put(np.zeros_like(w)), "step": 0})
        else:
            mgr.save(2, {**state1, "step": 2})
        known = 2 if learnt == "saved" else 1
        chunk = f"{root}/{known:010d}/w/c.0"
        fs.pipe_file(chunk, other_fs.cat_file(f"{other_root}/{1:010d}/w/c.0"))  # a valid chunk, other values
        with pytest.raises(zarrckpt.CheckpointWriteError, match=f"{known:010d}/w/c.0"):
            mgr.save(known + 1, {**state1, "step": known + 1})
        assert zarrckpt.all_steps(store.url, storage_options=options) == list(range(1, known + 1))
        mgr.save(known + 2, {**state1, "step": known + 2})
        mgr.save(known + 3, {**state1, "step": known + 3})  # made from the step just written
    for step in (known + 2, known + 3):
        restored = zarrckpt.load_checkpoint(store.url, step, storage_options=options)
        np.testing.assert_array_equal(restored["w"], w)
        assert restored["step"] == step


@pytest.mark.parametrize("kind", ["local", "memory", "s3", "gcs"])
def test_save_checkpoint_never_makes_a_chunk_from_one_rewritten_since_its_step_was_committed(new_store, kind):
    """Another program rewrites a chunk of step 1 after its commit with a valid chunk of
    other values (a new object at its key, the commit untouched). The next
    `save_checkpoint(unchanged_since=1)` of the values step 1 was saved with holds that
    chunk's bytes as step 1's commit records them, but the object is not the version
    recorded: the bytes in hand are written, every other chunk is made from step 1, and
    step 2 restores and verifies exactly what was saved."""
    store, other = new_store(kind), new_store(kind)
    options = store.options
    w = np.arange(2**20, dtype=np.float32)
    state = {"w": jax.device_put(w, NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))), "step": 1}
    zarrckpt.save_checkpoint(other.url, 1, {**state, "w": w + 1}, storage_options=other.options)
    zarrckpt.save_checkpoint(store.url, 1, state, storage_options=options)
    fs, root = fsspec.core.url_to_fs(store.url, **(options or {}))
    other_fs, other_root = fsspec.core.url_to_fs(other.url, **(other.options or {}))
    fs.pipe_file(f"{root}/{1:010d}/w/c.0", other_fs.cat_file(f"{other_root}/{1:010d}/w/c.0"))
    written = _stats.snapshot().get("store_bytes_written", 0)
    zarrckpt.save_checkpoint(store.url, 2, {**state, "step": 2}, storage_options=options, unchanged_since=1)
    chunk = fs.size(f"{root}/{1:010d}/w/c.1")
    assert chunk <= _stats.snapshot()["store_bytes_written"] - written < 2 * chunk  # the rewritten chunk alone
    restored = zarrckpt.load_checkpoint(store.url, 2, storage_options=options)
    np.testing.assert_array_equal(restored["w"], w)
    assert zarrckpt.verify(f"{store.url}/{2:010d}", storage_options=options).ok


def test_where_links_cannot_be_made_unchanged_chunks_are_copied_and_still_checked(tmp_path, monkeypatch):
    """On a file system that refuses hard links (gcsfuse, blobfuse) an unchanged chunk
    is copied in the kernel: saves of the very same arrays commit, each step with files
    of its own, and a chunk rewritten after its step was saved still fails the next
    save, which names it (rewritten with the same bytes, it is written again)."""
    import errno

    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    w = jax.device_put(np.arange(2**18, dtype=np.float32))
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=False, max_chunk_bytes=2**18) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": w, "step": step})
        chunk = tmp_path / "0000000003" / "w" / "c.0"
        assert chunk.stat().st_ino != (tmp_path / "0000000002" / "w" / "c.0").stat().st_ino
        other = (tmp_path / "0000000003" / "w" / "c.1").read_bytes()  # a valid chunk of other values
        chunk.write_bytes(other)  # rewritten in place
        with pytest.raises(zarrckpt.CheckpointWriteError, match="0000000003/w/c.0"):
            mgr.save(4, {"w": w, "step": 4})
        mgr.save(5, {"w": w, "step": 5})
    assert zarrckpt.all_steps(str(tmp_path)) == [1, 2, 3, 5]
    for step in (1, 2, 5):
        restored = zarrckpt.load_checkpoint(str(tmp_path), step)
        np.testing.assert_array_equal(restored["w"], np.arange(2**18, dtype=np.float32))
        assert restored["step"] == step


def test_a_touched_chunk_is_written_again_and_the_save_commits(tmp_path):
    """A chunk of the step the next save makes from, touched (a scratch file system's
    anti-purge job, `touch`, a copy of the same bytes): its version changed, its bytes
    did not. The next save commits, that chunk written anew from the bytes its step's
    commit records (CRC-32C and size), the others linked; the save after links from it
    (before: CheckpointWriteError into the training loop, and every chunk written at
    the save after)."""
    w = jax.device_put(np.arange(2**18, dtype=np.float32))
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=False, max_chunk_bytes=2**18) as mgr:
        mgr.save(1, {"w": w, "step": 1})
        mgr.save(2, {"w": w, "step": 2})
        touched = tmp_path / "0000000002" / "w" / "c.0"
        os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
        mgr.save(3, {"w": w, "step": 3})
        mgr.save(4, {"w": w, "step": 4})
    assert zarrckpt.all_steps(str(tmp_path)) == [1, 2, 3, 4]

    def inode(step: int, chunk: str) -> int:
        return (tmp_path / f"{step:010d}" / "w" / chunk).stat().st_ino

    assert inode(3, "c.0") != inode(2, "c.0") and inode(4, "c.0") == inode(3, "c.0")  # written anew, then linked
    assert inode(3, "c.1") == inode(2, "c.1") == inode(1, "c.1")
    for step in (3, 4):
        assert zarrckpt.verify(str(tmp_path / f"{step:010d}")).ok
        np.testing.assert_array_equal(zarrckpt.load_checkpoint(str(tmp_path), step)["w"], np.asarray(w))


@pytest.mark.parametrize("how", ["cp", "in place"])
def test_another_chunk_copied_over_a_linked_chunk_is_damage_in_every_step_linking_it(tmp_path, how):
    """A valid chunk of other values written over a chunk of step 1 that later steps
    link (`cp` of another chunk, `rsync --inplace`): it changes every step that links
    the file. Its own checksum passes, but not the one each step's commit records:
    `verify` of the later step fails naming it, and a load raises, never returning its
    values (before: both passed, and the load returned the other chunk's values)."""
    w = jax.device_put(np.arange(2**18, dtype=np.float32))
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=False, max_chunk_bytes=2**18) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": w, "step": step})
    chunk, other = tmp_path / "0000000001" / "w" / "c.0", tmp_path / "0000000001" / "w" / "c.1"
    assert chunk.stat().st_ino == (tmp_path / "0000000003" / "w" / "c.0").stat().st_ino
    if how == "cp":
        shutil.copyfile(other, chunk)  # opens the file it replaces: every link sees it
    else:
        with open(chunk, "r+b") as f:
            f.write(other.read_bytes())
    report = zarrckpt.verify(str(tmp_path / "0000000003"))
    assert not report.ok and [p.key for p in report.problems] == ["w/c.0"], report.problems
    assert "not the chunk its commit records" in report.problems[0].message
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="w/c.0.*not the chunk its commit records"):
        zarrckpt.load_checkpoint(str(tmp_path), 3)
