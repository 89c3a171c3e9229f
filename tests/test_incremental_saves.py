"""Writing only what changed: a leaf a manager saved (or restored) and finds unchanged is
neither copied off the devices nor written; its chunks are made from the step that
holds them (a hard link on a local disk, a copy inside S3 or GCS), and every step
stays a complete checkpoint that restores, verifies and opens in zarr-python alone."""

from __future__ import annotations

import os
import shutil
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

import crc32c
import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zarr
import zygote
from builders import mesh
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import zarrckpt
import zarrckpt._commit
import zarrckpt._run.checkpoints
import zarrckpt._storage.local
from zarrckpt._run import lineage as _unchanged
from zarrckpt._util import stats as _stats
from zarrckpt._util.programs import Programs


def fsdp(array: jax.Array) -> jax.Array:
    return jax.device_put(array, NamedSharding(mesh((8,), ("fsdp",)), P("fsdp")))


def lora_state() -> tuple[dict, optax.GradientTransformation]:
    """A bf16 base sharded over 8 devices (each matrix 4 MiB: large enough to be
    fingerprinted) and rank-4 adapters, with an optimizer that trains the adapters
    alone (the base's updates are zeros, as optax's masked fine-tunes make them)."""
    params = {"base": {"w": fsdp(jax.random.normal(jax.random.key(0), (1024, 2048), jnp.bfloat16)),
                       "embed": fsdp(jax.random.normal(jax.random.key(1), (512, 2048), jnp.float32))},
              "lora": {"a": jnp.zeros((2048, 4)), "b": jax.random.normal(jax.random.key(2), (4, 2048)) * 0.01}}
    labels = {"base": {"w": "frozen", "embed": "frozen"}, "lora": {"a": "train", "b": "train"}}
    optimizer = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)
    return {"params": params, "opt_state": optimizer.init(params), "step": jnp.array(0)}, optimizer


def train(state: dict, optimizer: optax.GradientTransformation, *, frozen_as_given: bool) -> dict:
    """One step; the base comes back as the same arrays, or rebuilt by `apply_updates`
    (base + 0: new arrays, the same values)."""
    @jax.jit
    def step(state):
        grads = jax.tree.map(jnp.ones_like, state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                "step": state["step"] + 1}

    new = step(state)
    if frozen_as_given:
        new["params"]["base"] = state["params"]["base"]
    return new


def chunk_files(step_dir: Path, leaf: str) -> dict[str, os.stat_result]:
    array = step_dir / leaf
    return {str(p.relative_to(array)): p.stat() for p in sorted(array.rglob("*")) if p.is_file()
            and p.name != "zarr.json"}


def fingerprints_now(leaves, *, sample, keys):
    """`_fingerprints` with its programs compiled first (a save compiles them after it)."""
    programs = Programs()
    _unchanged._fingerprints(leaves, sample=sample, keys=keys, programs=programs)
    programs.compile_pending()
    return _unchanged._fingerprints(leaves, sample=sample, keys=keys, programs=programs)


def as_numpy(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize("frozen_as_given", [True, False], ids=["same arrays", "rebuilt arrays"])
def test_a_frozen_base_is_linked_not_written_and_every_step_restores_alone(tmp_path, frozen_as_given):
    state, optimizer = lora_state()
    saved, written = {}, {}
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        for step in range(1, 5):
            state = train(state, optimizer, frozen_as_given=frozen_as_given)
            _stats.reset()
            mgr.save(step, state)
            mgr.wait()
            written[step] = _stats.snapshot().get("store_bytes_written", 0)
            saved[step] = as_numpy(state)
    base_bytes = 1024 * 2048 * 2 + 512 * 2048 * 4
    # Rebuilt arrays are fingerprinted at step 2 (samples) and 3 (whole), once the first
    # save's programs are compiled; their chunks are linked by their bytes from step 2.
    first_linked = 2 if frozen_as_given else 3
    for leaf in ("params.base.w", "params.base.embed"):
        newest = chunk_files(tmp_path / "0000000004", leaf)
        assert newest
        for step in range(first_linked, 5):
            assert {k: s.st_ino for k, s in chunk_files(tmp_path / f"{step:010d}", leaf).items()} == \
                {k: s.st_ino for k, s in chunk_files(tmp_path / f"{first_linked - 1:010d}", leaf).items()}
    for leaf in ("params.lora.a", "params.lora.b"):  # changed at every step: written every time
        assert all(s.st_nlink == 1 for s in chunk_files(tmp_path / "0000000004", leaf).values())
    assert written[4] < 0.2 * base_bytes, written  # the adapters, their moments, metadata
    assert written[1] > base_bytes
    for step in (1, 2, 3):  # every step complete on its own
        shutil.rmtree(tmp_path / f"{step:010d}")
    restored = zarrckpt.load_checkpoint(str(tmp_path), 4, as_numpy(lora_state()[0]))
    jax.tree.map(np.testing.assert_array_equal, as_numpy(restored), saved[4])
    assert zarrckpt.verify(str(tmp_path / "0000000004")).ok
    group = zarr.open_group(str(tmp_path / "0000000004"), mode="r")
    np.testing.assert_array_equal(np.asarray(group["params.base.embed"][...]), saved[4]["params"]["base"]["embed"])


CHANGES = {
    "one element by one unit in the last place": lambda a: a.at[123].set(jnp.nextafter(a[123], jnp.inf))
    if jnp.issubdtype(a.dtype, jnp.floating) else a.at[123].add(1),
    "the signs of two elements": lambda a: a.at[3].multiply(-1).at[1000].multiply(-1),
    "two elements swapped": lambda a: a.at[7].set(a[9]).at[9].set(a[7]),
    "the last element": lambda a: a.at[-1].add(1),
}
# The same changes to booleans: one flipped, two flipped, two unequal ones swapped, the last.
BOOL_CHANGES = {
    "one element by one unit in the last place": lambda a: a.at[123].set(~a[123]),
    "the signs of two elements": lambda a: a.at[3].set(~a[3]).at[1000].set(~a[1000]),
    "two elements swapped": lambda a: a.at[7].set(True).at[9].set(False),
    "the last element": lambda a: a.at[-1].set(~a[-1]),
}


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "bool"])
def test_a_leaf_changed_anywhere_is_written_again(tmp_path, change, dtype):
    """Leaves of 4 MiB, large enough to be fingerprinted."""
    values = jax.random.normal(jax.random.key(3), (4 * 2**20 // np.dtype(jnp.dtype(dtype)).itemsize,)) * 50
    if dtype == "bool":
        values = (values > 0).at[7].set(False).at[9].set(True)
        changed = BOOL_CHANGES[change](values)
    else:
        values = values.astype(dtype)
        changed = CHANGES[change](values)
    assert not np.array_equal(np.asarray(changed), np.asarray(values))
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        for step in (1, 2, 3):  # the same values as new arrays: both fingerprints known after step 3
            mgr.save(step, {"x": fsdp(jnp.array(values, copy=True))})
        mgr.save(4, {"x": fsdp(changed)})
    np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), 4)["x"]), np.asarray(changed))
    np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), 3)["x"]), np.asarray(values))


def test_a_rebuilt_frozen_leaf_costs_one_wait_a_save_and_is_linked_again_after_it_changes(tmp_path, monkeypatch):
    """A leaf whose sample was unchanged at the last save is fingerprinted whole at once;
    a change found so is written, and the leaf is linked again once it holds still: at
    the next save after a change here and there (its sample unchanged), and, after a
    change all over, once its sample, then all of it, have been seen unchanged."""
    waits = []
    fingerprints = _unchanged._fingerprints

    def counted(leaves, *, sample, keys, programs):
        if leaves:
            waits[-1].append(sample)
        return fingerprints(leaves, sample=sample, keys=keys, programs=programs)

    monkeypatch.setattr(_unchanged, "_fingerprints", counted)
    first = jax.random.normal(jax.random.key(5), (2**21,))
    here_and_there = first.at[1].add(1)  # not in a sample of each 64th element of a shard
    all_over = here_and_there + 1
    values = {1: first, 2: first, 3: first, 4: first, 5: here_and_there, 6: here_and_there, 7: all_over,
              8: all_over, 9: all_over, 10: all_over}
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        for step, value in values.items():
            waits.append([])
            mgr.save(step, {"x": fsdp(jnp.array(value, copy=True))})
    inodes = {step: {k: s.st_ino for k, s in chunk_files(tmp_path / f"{step:010d}", "x").items()} for step in values}
    assert all(len(inodes[step]) == 8 for step in values)
    linked = {step: sum(inodes[step][k] == inodes[step - 1][k] for k in inodes[step]) for step in values if step > 1}
    # Every chunk that holds still is linked: by the fingerprints, without a copy off the
    # devices (4, 6, 10), else by its bytes once copied (2, 3, 8, 9, and 5's unchanged ones).
    assert linked == {2: 8, 3: 8, 4: 8, 5: 7, 6: 8, 7: 0, 8: 8, 9: 8, 10: 8}, linked
    # Per save, each wait for the devices: a sample (True) or all of it (False). The
    # first save's programs are compiled after it (its call computes nothing), the
    # second's sample is the first seen, the third's is seen again and all of it
    # fingerprinted. Held still (4, 6, 10): all of it at once. Changed (5, 7): all of
    # it, then the sample, unchanged here and there, changed all over (8 is written
    # without a look, 9 samples).
    assert waits == [[[True]], [[True]], [[True], [False]], [[False]], [[False], [True]], [[False]],
                     [[False], [True]], [], [[True], [False]], [[False]]]
    for step, value in values.items():
        np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), step)["x"]),
                                      np.asarray(value))


def test_without_reuse_every_chunk_is_written(tmp_path):
    state = {"w": fsdp(jnp.arange(4096.0))}
    with zarrckpt.CheckpointManager(str(tmp_path), reuse_unchanged=False) as mgr:
        for step in (1, 2):
            mgr.save(step, state)
    assert all(s.st_nlink == 1 for s in chunk_files(tmp_path / "0000000002", "w").values())


def test_a_restored_state_saved_again_links_what_training_left_as_it_was(tmp_path):
    state, optimizer = lora_state()
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        state, step = mgr.restore(state)
        state = train(state, optimizer, frozen_as_given=True)
        mgr.save(2, state)
    before = chunk_files(tmp_path / "0000000001", "params.base.w")
    assert {k: s.st_ino for k, s in chunk_files(tmp_path / "0000000002", "params.base.w").items()} == \
        {k: s.st_ino for k, s in before.items()}
    assert all(s.st_nlink == 1 for s in chunk_files(tmp_path / "0000000002", "params.lora.b").values())


def test_a_rollback_saves_from_the_step_it_restored(tmp_path):
    """Restored to step 1 after step 2: what step 2 held is no longer what the state
    holds, and nothing is taken from it."""
    one, two = {"w": fsdp(jnp.arange(4096.0))}, {"w": fsdp(jnp.arange(4096.0) + 1)}
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, one)
        mgr.save(2, two)
        state, _ = mgr.restore(one, step=1)
        mgr.save(3, state)
    np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), 3)["w"]), np.arange(4096.0))
    assert {s.st_ino for s in chunk_files(tmp_path / "0000000003", "w").values()} == \
        {s.st_ino for s in chunk_files(tmp_path / "0000000001", "w").values()}


def test_a_step_that_retention_deletes_is_never_linked_from(tmp_path):
    """Rolled back to step 1 while step 5 is the newest, a manager keeping one step
    deletes each step it saves on from there (step 5 stays the newest): the next save
    writes its chunks, instead of linking them from a deleted step."""
    state = {"w": fsdp(jnp.arange(4096.0))}
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
        mgr.save(5, {"w": fsdp(jnp.arange(4096.0) + 5)})
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=1) as mgr:
        state, _ = mgr.restore(state, step=1)
        for step in (2, 3):
            mgr.save(step, state)
            mgr.wait()
        assert mgr.all_steps() == [5]


def test_a_step_removed_behind_the_managers_back_fails_the_save_and_the_next_writes_everything(tmp_path):
    state = {"w": fsdp(jnp.arange(4096.0)), "step": jnp.array(1)}
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
        mgr.wait()
        for chunk in chunk_files(tmp_path / "0000000001", "w"):
            (tmp_path / "0000000001" / "w" / chunk).unlink()
        mgr.save(2, {**state, "step": jnp.array(2)})
        with pytest.raises(zarrckpt.CheckpointWriteError, match=r"0000000001/w/c\."):  # the chunk gone
            mgr.wait()
        mgr.save(3, {**state, "step": jnp.array(3)})
    assert zarrckpt.all_steps(str(tmp_path)) == [1, 3]
    restored = zarrckpt.load_checkpoint(str(tmp_path), 3)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(4096.0))
    assert zarrckpt.verify(str(tmp_path / "0000000003")).ok


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_on_an_object_store_unchanged_chunks_are_copied_inside_it(new_store, kind):
    store = new_store(kind)
    state, optimizer = lora_state()
    with zarrckpt.CheckpointManager(store.url, storage_options=store.options) as mgr:
        for step in (1, 2, 3):
            state = train(state, optimizer, frozen_as_given=True)
            store.server.recorder.reset()
            mgr.save(step, state)
            mgr.wait()
            received = store.server.recorder.bytes_received
        mgr.delete(1)
        mgr.delete(2)
    base_bytes = 1024 * 2048 * 2 + 512 * 2048 * 4
    assert received < 0.2 * base_bytes  # the server received the adapters and metadata, no base
    if kind == "s3":  # each chunk of the base one CopyObject, its source asked nothing first (no HEAD)
        fs = fsspec.filesystem("s3", **store.options)
        chunks = sorted(path.rpartition("0000000003/")[2] for leaf in ("w", "embed")
                        for path in fs.ls(f"{store.url}/0000000003/params.base.{leaf}", detail=False)
                        if not path.endswith("zarr.json"))
        assert sorted(source.rpartition("0000000002/")[2] for source, _ in store.server.recorder.copies) == chunks
        assert [target for method, target in store.server.recorder.requests
                if method == "HEAD" and "/0000000002/params.base." in target] == []
    restored = zarrckpt.load_checkpoint(store.url, 3, as_numpy(lora_state()[0]), storage_options=store.options)
    jax.tree.map(np.testing.assert_array_equal, as_numpy(restored), as_numpy(state))


@pytest.mark.parametrize("kind", ["memory", "s3", "gcs"])
def test_a_save_that_reuses_chunks_lists_no_step(new_store, kind, monkeypatch):
    """Each unchanged chunk is made only from the version this process knows, checked by
    the copy itself (S3's x-amz-copy-source-if-match and answered ETag, GCS's
    ifSourceGenerationMatch; memory:// is looked at once the copy is made), so a save
    with reuse lists no step (a run's own listings, the lease's, are another matter):
    before, each process listed the step it made from twice a save (once in a job of
    several processes on a local disk: see test_multihost), which at thousands of hosts
    is a listing of the whole step by each. Seen from zarrckpt's side and, on S3 and
    GCS, from the server's."""
    store = new_store(kind)
    walked, walk = [], zarrckpt._storage.Location.walk

    def recorded(self, **kwargs):
        walked.append(self.url)
        return walk(self, **kwargs)

    state, optimizer = lora_state()
    with zarrckpt.CheckpointManager(store.url, storage_options=store.options, async_save=False) as mgr:
        for step in (1, 2, 3):
            state = train(state, optimizer, frozen_as_given=True)
            if step == 3:
                monkeypatch.setattr(zarrckpt._storage.Location, "walk", recorded)
                _stats.reset()
                if store.server is not None:
                    store.server.recorder.reset()
            mgr.save(step, state)
        monkeypatch.undo()
        assert mgr.all_steps() == [1, 2, 3] and _stats.snapshot().get("store_bytes_copied", 0) > 0
    listed = [] if store.server is None else [
        urllib.parse.unquote(target) for method, target in store.server.recorder.requests
        if store.server.kind(method, target) == "list" and "/0000000002" in urllib.parse.unquote(target)]
    assert walked == [] and listed == [], (walked, listed)
    restored = zarrckpt.load_checkpoint(store.url, 3, as_numpy(lora_state()[0]), storage_options=store.options)
    jax.tree.map(np.testing.assert_array_equal, as_numpy(restored), as_numpy(state))


@pytest.mark.parametrize("kind", ["local", "memory", "s3", "gcs"])
def test_a_chunk_copied_from_a_copy_has_the_version_a_listing_gives_it(new_store, kind):
    """The version a copy returns is what a listing says of the object made (its size
    the object's, not the chunk's data size), so that a later copy from it, or a check
    of it, finds it as it is."""
    store = new_store(kind)
    loc = zarrckpt._storage.resolve(store.url, store.options)
    made = {1: loc.write("1/c", b"a chunk and its checksum", durable=True)}
    for step in (2, 3):  # the data is 20 bytes of the 24 (zarrckpt's copies are asked for by the data's size)
        made[step] = loc.child(str(step)).copy_new("c", loc.child(str(step - 1)), nbytes=20, expect=made[step - 1])
    listed = {step: {entry.name: entry.version for entry in loc.child(str(step)).walk()}["c"] for step in made}
    assert made == listed and None not in made.values(), (made, listed)


@pytest.mark.parametrize("kind, mib", [("gcs", 51), ("s3", 101)])
def test_a_large_chunk_is_one_request_whose_answer_names_its_version(new_store, kind, mib):
    """gcsfs sends an object of 50 MiB or more as a resumable upload, s3fs one of 100 MiB
    or more as a multipart one, and neither says the version made; zarrckpt sends each
    chunk (up to 5 GiB) in one request, whose answer does, so that a later save can
    make an unchanged chunk from it without listing the step."""
    store = new_store(kind)
    loc = zarrckpt._storage.resolve(store.url, store.options)
    store.server.recorder.reset()
    version = loc.child("1").write_new("c", np.zeros(mib * 2**20, np.uint8))
    writes = [target for method, target in store.server.recorder.answered if method in ("PUT", "POST")]
    assert version is not None and len(writes) == 1, (version, writes)
    assert version == {entry.name: entry.version for entry in loc.child("1").walk()}["c"]


def test_a_chunk_rewritten_while_a_store_without_copy_conditions_copies_it_fails_the_save(tmp_path):
    """A store of no known kind copies a chunk by reading it and writing it: another
    program's write landing just as the chunk is read is found once the copy is made
    (the source is no longer the version known), the save fails naming the chunk, and
    nothing of it is committed; the next saves commit what was saved."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class Rewritten(MemoryFileSystem):
        protocol = "rewrittenwhilecopied"
        store, pseudo_dirs = {}, [""]
        armed: tuple[str, bytes] | None = None

        def cat_file(self, path, *args, **kwargs):
            if Rewritten.armed is not None and path.endswith(Rewritten.armed[0]):  # the other program's write lands
                self.pipe_file(path, Rewritten.armed[1])
                Rewritten.armed = None
            return super().cat_file(path, *args, **kwargs)

    fsspec.register_implementation(Rewritten.protocol, Rewritten, clobber=True)
    base = fsdp(jnp.arange(2.0**20, dtype=jnp.float32))
    zarrckpt.save_pytree(f"{Rewritten.protocol}://other", {"base": base + 1})
    other = Rewritten().cat_file(f"{Rewritten.protocol}://other/base/c.0")  # a valid chunk of other values
    url = f"{Rewritten.protocol}://run"
    with zarrckpt.CheckpointManager(url, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"base": base, "step": jnp.array(step)})
        Rewritten.armed = ("0000000002/base/c.0", other)
        with pytest.raises(zarrckpt.CheckpointWriteError, match=r"0000000002/base/c\.0"):
            mgr.save(3, {"base": base, "step": jnp.array(3)})
        assert Rewritten.armed is None and mgr.all_steps() == [1, 2]
        for step in (4, 5):
            mgr.save(step, {"base": base, "step": jnp.array(step)})
    for step in (4, 5):
        np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(url, step)["base"]), np.asarray(base))


@pytest.mark.parametrize("found", ["another writer's", "its own"])
def test_a_copy_that_finds_an_object_where_it_lands_takes_its_own_and_never_deletes_another_s(new_store, found):
    """Requests land late on S3: a copy finds an object at its key, its own earlier
    attempt's (taken as made) or another writer's. Where a lease guards the place (a
    manager's run), that may be a live job's (one that took the run over while this one
    was paused): it stays, and the copy fails naming it. Where none does (save_pytree,
    copy_checkpoint), it is a late request of an earlier save there: deleted, and the
    copy made."""
    store = new_store("s3")
    unguarded = zarrckpt._storage.resolve(store.url, store.options)
    version = unguarded.write("1/c", b"committed chunk")
    there = b"another writer's chunk" if found == "another writer's" else b"committed chunk"
    for loc in (unguarded.keeping_found(), unguarded):
        unguarded.write("2/c", there)
        if found == "another writer's" and loc.keep_found:
            with pytest.raises(FileExistsError, match="2/c: another writer made it meanwhile"):
                loc.child("2").copy_new("c", loc.child("1"), nbytes=15, expect=version)
            assert loc.read("2/c") == there
        else:
            loc.child("2").copy_new("c", loc.child("1"), nbytes=15, expect=version)
            assert loc.read("2/c") == b"committed chunk"
        assert loc.read("1/c") == b"committed chunk"


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(["float32", "bfloat16", "int8", "uint16", "int32"]),
       place=st.integers(0, 5000 - 1), bit=st.integers(0, 31), sample=st.booleans())
def test_fingerprints_tell_a_single_flipped_bit_apart(dtype, place, bit, sample):
    """Any one bit of any element, in the whole fingerprint (and in the sample where it
    covers the element)."""
    values = np.random.default_rng(0).integers(0, 2**31, 5000, dtype=np.int64).astype(np.uint32)
    raw = values.view(np.uint8)[: 5000 * np.dtype(jnp.dtype(dtype)).itemsize]
    flipped = raw.copy()
    itemsize = np.dtype(jnp.dtype(dtype)).itemsize
    flipped[place * itemsize + (bit // 8) % itemsize] ^= 1 << (bit % 8)
    keys = np.array([12345, 67890], np.uint32)
    a, b = (jnp.asarray(np.frombuffer(x.tobytes(), jnp.dtype(dtype))) for x in (raw, flipped))
    stride = max(1, 5000 // _unchanged._SAMPLE)
    fa, fb = (fingerprints_now([{((0, 5000),): x}], sample=[sample], keys=keys)[0] for x in (a, b))
    if not sample or place % stride == 0:
        assert fa != fb


def _documented_fingerprint(values: np.ndarray, keys: np.ndarray, stride: int) -> tuple[int, int]:
    """docs/pytree-zarr-checkpoint.md's fingerprint, in numpy, of `values` taken every
    `stride` elements: per word, MurmurHash3's finalizer of (word XOR (mixed place +
    key)), summed modulo 2**32, for each key."""
    def mix(h: np.ndarray) -> np.ndarray:
        h = h ^ (h >> 16)
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h = h ^ (h >> 13)
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    taken = values.reshape(-1)[::stride]
    if taken.dtype == np.bool_:
        taken = taken.astype(np.uint8)
    raw = np.ascontiguousarray(taken).view(np.uint8)
    size = taken.dtype.itemsize
    if size in (1, 2) and taken.size % (4 // size):  # widened one to a word
        words = taken.view({1: np.uint8, 2: np.uint16}[size]).astype(np.uint64)
    else:
        words = raw.view(np.uint32).astype(np.uint64)
    place = mix((np.arange(words.size, dtype=np.uint64) * stride * 0x9E3779B9) & 0xFFFFFFFF)
    return tuple(int(mix(words ^ ((place + int(k)) & 0xFFFFFFFF)).sum() & 0xFFFFFFFF) for k in keys)


@pytest.mark.parametrize("sample", [False, True], ids=["whole", "sample"])
@pytest.mark.parametrize(("dtype", "size"), [("bfloat16", 3 * 2**20), ("float32", 1000 * 1001), ("int8", 4099),
                                             ("uint8", 4096), ("uint16", 6), ("bool", 10_000), ("int32", 4096),
                                             ("complex64", 5000), ("int64", 5000), ("float64", 33),
                                             ("complex128", 4097)])
def test_the_fingerprint_is_the_function_the_format_states(dtype, size, sample):
    values = np.random.default_rng(1).integers(0, 2**32, 4 * size, dtype=np.uint64).astype(np.uint32)
    array = (np.frombuffer(values.tobytes(), np.dtype(jnp.dtype(dtype))) if dtype != "bool" else values % 2 == 1)[:size]
    keys = np.array([0x9E3779B9, 7], np.uint32)
    with jax.enable_x64(np.dtype(jnp.dtype(dtype)).itemsize >= 8):  # 8-byte elements, two words each
        (found,) = fingerprints_now([{((0, size),): jnp.asarray(array)}], sample=[sample], keys=keys)
    stride = max(1, size // _unchanged._SAMPLE) if sample else 1
    assert found == {((0, size),): _documented_fingerprint(array, keys, stride)}


@pytest.mark.parametrize("sample", [False, True], ids=["whole", "sample"])
def test_leaves_fingerprinted_in_one_call_each_get_their_own_shards_fingerprints(sample):
    """Leaves of several shapes and types, on all devices, on some of them, and one of
    uneven shards, asked for in one call: every shard's fingerprint is the documented
    function of its own bytes, in the order asked."""
    rng = np.random.default_rng(2)
    keys = np.array([3, 0xDEADBEEF], np.uint32)
    eight, four = mesh((8,), ("d",)), mesh((4,), ("d",))
    values = [rng.standard_normal((64, 40)).astype(np.float32), rng.standard_normal((8, 3000)).astype(jnp.bfloat16),
              rng.integers(0, 100, (16,), dtype=np.int8), rng.standard_normal((24, 5)).astype(np.float32)]
    arrays = [jax.device_put(v, NamedSharding(eight, P("d"))) for v in values[:3]]
    arrays.append(jax.device_put(values[3], NamedSharding(four, P("d"))))
    uneven = {((0, 3),): jnp.arange(3.0), ((3, 10),): jax.device_put(jnp.arange(3.0, 10.0), jax.devices()[1])}
    leaves = [{(i, j): shard.data for j, shard in enumerate(a.addressable_shards)} for i, a in enumerate(arrays)]
    found = fingerprints_now([*leaves, uneven], sample=[sample] * (len(leaves) + 1), keys=keys)
    for leaf, fingerprints in zip([*leaves, uneven], found):
        assert fingerprints is not None and list(fingerprints) == list(leaf)
        for region, shard in leaf.items():
            part = np.asarray(shard)
            stride = max(1, part.size // _unchanged._SAMPLE) if sample else 1
            assert fingerprints[region] == _documented_fingerprint(part, keys, stride)


def test_saves_inside_jax_set_mesh_link_a_rebuilt_frozen_leaf(tmp_path):
    """A training loop run under `jax.set_mesh` (jax's idiom for a default mesh): the
    fingerprints still run (outside that mesh: their programs name their own), so a frozen
    leaf rebuilt at every step is linked from the third save, and leaves of uneven
    shards are fingerprinted too."""
    data = mesh((8,), ("data",))
    frozen = np.random.default_rng(4).standard_normal((1024, 1024)).astype(np.float32)
    uneven = {((0, 3),): jnp.arange(3.0), ((3, 10),): jax.device_put(jnp.arange(3.0, 10.0), jax.devices()[1])}
    with jax.set_mesh(data):
        assert fingerprints_now([uneven], sample=[False], keys=np.array([1, 2], np.uint32))[0] is not None
        with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, {"frozen": jax.device_put(frozen, NamedSharding(data, P("data"))) + 0,
                                "step": jnp.int32(step)})
    inodes = [{k: s.st_ino for k, s in chunk_files(tmp_path / f"{step:010d}", "frozen").items()} for step in (2, 3)]
    assert inodes[0] and inodes[0] == inodes[1]
    np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), 3)["frozen"]), frozen)


def test_leaves_no_fingerprint_can_be_taken_of_are_saved_and_restored_whole(tmp_path, monkeypatch):
    """int4 weights (narrower than a byte), a state offloaded to host memory, and a leaf
    whose fingerprints fail to compute (the device out of memory): each is written
    at every save as it is, unless it is the very same array, and restores exactly."""
    from zarrckpt._run import lineage as unchanged

    host = NamedSharding(mesh((8,), ("fsdp",)), P("fsdp"), memory_kind="pinned_host")
    made = {"int4": lambda i: fsdp(jnp.full((2**23,), i % 7, jnp.int4)),
            "offloaded": lambda i: jax.device_put(np.full(2**20 * 2, i, np.float32), host),
            "failing": lambda i: fsdp(jnp.full((2**20,), float(i)))}
    real = unchanged._dispatch

    def failing(arrays, sample, keys):
        if arrays[0].size * len(arrays) == 2**20:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return real(arrays, sample, keys)

    monkeypatch.setattr(unchanged, "_dispatch", failing)
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {name: make(step) for name, make in made.items()})
    for step in (1, 2, 3):
        restored = zarrckpt.load_checkpoint(str(tmp_path), step)
        for name, make in made.items():
            np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(make(step)))


def test_a_store_with_no_copy_of_its_own_gets_the_bytes_of_an_unchanged_chunk(tmp_path):
    """A file system that cannot copy an object itself (as sftp, ftp, smb): the chunk's
    bytes are read and written through the process, and every save commits."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class NoCopy(MemoryFileSystem):
        protocol = "nocopy"
        store, pseudo_dirs = {}, [""]

        def cp_file(self, path1, path2, **kwargs):
            raise NotImplementedError

    fsspec.register_implementation("nocopy", NoCopy, clobber=True)
    state = {"w": fsdp(jnp.arange(2.0**20))}
    with zarrckpt.CheckpointManager("nocopy://run") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state)
        mgr.wait()
        assert mgr.all_steps() == [1, 2, 3]
    np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint("nocopy://run", 3)["w"]), np.arange(2.0**20))


def test_tensorstore_reads_a_step_of_linked_chunks_as_zarrckpt_restores_it(tmp_path):
    """A step whose frozen base is hard links to the step before (deleted here, so the
    links are all that is left) is a zarr v3 group another reader opens as it is:
    TensorStore reads every array of it, checksums checked, bit for bit as zarrckpt
    restores it."""
    ts = pytest.importorskip("tensorstore")
    from zarrckpt._format import tree as _tree

    state, optimizer = lora_state()
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        for step in (1, 2):
            state = train(state, optimizer, frozen_as_given=True)
            mgr.save(step, state)
    for leaf in ("params.base.w", "params.base.embed"):  # linked, not written
        assert {k: s.st_ino for k, s in chunk_files(tmp_path / "0000000002", leaf).items()} == \
            {k: s.st_ino for k, s in chunk_files(tmp_path / "0000000001", leaf).items()}
    shutil.rmtree(tmp_path / "0000000001")
    restored = zarrckpt.load_checkpoint(str(tmp_path), 2, as_numpy(lora_state()[0]))
    leaves = {_tree.name_of(path): np.asarray(value)
              for path, value in jax.tree_util.tree_flatten_with_path(restored)[0]}
    step = tmp_path / "0000000002"
    arrays = sorted(p.parent.name for p in step.glob("*/zarr.json"))
    assert arrays == sorted(leaves)
    for name in arrays:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(step / name)}}
        got = ts.open(spec, open=True, read=True).result().read().result()
        assert (got.dtype, got.shape) == (leaves[name].dtype, leaves[name].shape), name
        assert got.tobytes() == leaves[name].tobytes(), name
    jax.tree.map(np.testing.assert_array_equal, as_numpy(restored), as_numpy(state))


def test_with_a_local_tier_persistent_steps_link_the_frozen_base_and_every_step_restores_from_either_tier(
        tmp_path):
    """Persistent steps every 2 steps, a local copy at every step: the persistent steps
    link the frozen base from the one before (also after a restore from the local tier,
    from the first persistent step after it), every local copy and every persistent step
    restores exactly, and deleting every persistent step but the newest leaves it
    complete."""
    from builders import copies

    persistent, local = str(tmp_path / "run"), str(tmp_path / "local")
    tiers = {"save_interval_steps": 2, "local_directory": local, "local_save_interval_steps": 1,
             "local_keep_last": 8}
    target = as_numpy(lora_state()[0])
    state, optimizer = lora_state()
    saved = {}
    with zarrckpt.CheckpointManager(persistent, **tiers) as mgr:
        for step in range(1, 6):
            state = train(state, optimizer, frozen_as_given=True)
            mgr.save(step, state)
            mgr.wait()
            saved[step] = as_numpy(state)
    with zarrckpt.CheckpointManager(persistent, **tiers) as mgr:
        state, step = mgr.restore(lora_state()[0])
        assert (step, mgr.restored_tier) == (5, "local")
        jax.tree.map(np.testing.assert_array_equal, as_numpy(state), saved[5])
        for step in range(6, 9):  # training goes on from the local copy
            state = train(state, optimizer, frozen_as_given=True)
            mgr.save(step, state)
            mgr.wait()
            saved[step] = as_numpy(state)
    run, mine = Path(persistent), copies(persistent, local)
    assert zarrckpt.all_steps(persistent) == [2, 4, 6, 8]
    assert zarrckpt.all_steps(str(mine)) == list(range(1, 9))
    for leaf in ("params.base.w", "params.base.embed"):
        for newer, older in ((4, 2), (8, 6)):
            assert {k: s.st_ino for k, s in chunk_files(run / f"{newer:010d}", leaf).items()} == \
                {k: s.st_ino for k, s in chunk_files(run / f"{older:010d}", leaf).items()}, (leaf, newer)
    for step in range(1, 9):  # every local copy holds its step
        jax.tree.map(np.testing.assert_array_equal, as_numpy(zarrckpt.load_checkpoint(str(mine), step, target)),
                     saved[step])
    shutil.rmtree(local)  # the host's disk lost: the persistent tier alone
    with zarrckpt.CheckpointManager(persistent, **tiers) as mgr:
        state, step = mgr.restore(lora_state()[0])
        assert (step, mgr.restored_tier) == (8, "persistent")
        jax.tree.map(np.testing.assert_array_equal, as_numpy(state), saved[8])
        for step in (2, 4, 6):
            state, _ = mgr.restore(lora_state()[0], step=step)
            jax.tree.map(np.testing.assert_array_equal, as_numpy(state), saved[step])
        for step in (2, 4, 6):
            mgr.delete(step)
    assert zarrckpt.all_steps(persistent) == [8]
    jax.tree.map(np.testing.assert_array_equal, as_numpy(zarrckpt.load_checkpoint(persistent, 8, target)), saved[8])
    assert zarrckpt.verify(str(run / "0000000008")).ok


def test_a_step_replaced_by_save_checkpoint_while_a_manager_holds_the_run_is_refused(tmp_path):
    """Replaced, step 1 would hold other values than the manager's record of it, and
    its next save would link them in."""
    base = fsdp(jnp.arange(2.0**20))
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"w": base, "s": jnp.array(1)})
        mgr.wait()
        with pytest.raises(zarrckpt.DirectoryInUseError):
            zarrckpt.save_checkpoint(str(tmp_path), 1, {"w": fsdp(jnp.zeros(2**20)), "s": jnp.array(1)},
                                     overwrite=True)
        mgr.save(2, {"w": base, "s": jnp.array(2)})
    for step in (1, 2):
        np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), step)["w"]),
                                      np.arange(2.0**20))
    zarrckpt.save_checkpoint(str(tmp_path), 1, {"w": np.zeros(4), "s": 1}, overwrite=True)  # released: allowed


def test_save_pytree_over_a_step_of_a_run_a_manager_holds_is_refused(tmp_path):
    base = fsdp(jnp.arange(2.0**20))
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"w": base})
        mgr.wait()
        with pytest.raises(zarrckpt.DirectoryInUseError):
            zarrckpt.save_pytree(str(tmp_path / "0000000001"), {"w": fsdp(jnp.zeros(2**20))}, overwrite=True)
        mgr.save(2, {"w": base})
    np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), 2)["w"]), np.arange(2.0**20))
    zarrckpt.save_pytree(str(tmp_path / "0000000001"), {"w": np.zeros(4)}, overwrite=True)  # released: allowed


def replace_from_outside(step_dir: Path, state) -> None:
    """Another program replaces a step: a checkpoint made elsewhere, moved into place."""
    made = step_dir.with_name(step_dir.name + ".new")
    zarrckpt.save_pytree(str(made), state)
    shutil.rmtree(step_dir)
    made.rename(step_dir)


# -- save_checkpoint(unchanged_since=...): the same without a manager --------------------


def inodes(step_dir: Path, leaf: str) -> dict[str, int]:
    return {k: s.st_ino for k, s in chunk_files(step_dir, leaf).items()}


@pytest.mark.parametrize("frozen_as_given", [True, False], ids=["same arrays", "rebuilt arrays"])
def test_save_checkpoint_unchanged_since_links_the_base_it_saved_and_every_step_restores_alone(
        tmp_path, frozen_as_given):
    state, optimizer = lora_state()
    saved = {}
    for step in range(1, 5):
        state = train(state, optimizer, frozen_as_given=frozen_as_given)
        zarrckpt.save_checkpoint(str(tmp_path), step, state, unchanged_since=step - 1 if step > 1 else None)
        saved[step] = as_numpy(state)
    for leaf in ("params.base.w", "params.base.embed"):
        for step in range(2, 5):
            assert inodes(tmp_path / f"{step:010d}", leaf) == inodes(tmp_path / "0000000001", leaf)
    assert all(s.st_nlink == 1 for s in chunk_files(tmp_path / "0000000004", "params.lora.b").values())
    for step in (1, 2, 3):
        shutil.rmtree(tmp_path / f"{step:010d}")
    restored = zarrckpt.load_checkpoint(str(tmp_path), 4, as_numpy(lora_state()[0]))
    jax.tree.map(np.testing.assert_array_equal, as_numpy(restored), saved[4])
    assert zarrckpt.verify(str(tmp_path / "0000000004")).ok


@pytest.mark.parametrize("start", ["load_checkpoint", "load_checkpoint_if_it_exists", "nothing restored"])
def test_save_checkpoint_unchanged_since_needs_only_the_step_s_commit_not_this_process_s_memory(tmp_path, start):
    """Step 1 saved by another process (a run before a restart): this one restores it,
    or only rebuilds the same values, and its save links what training left as it was."""
    state, optimizer = lora_state()
    script = tmp_path / "first_run.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      "import test_incremental_saves as t, zarrckpt\n"
                      f"zarrckpt.save_checkpoint({str(tmp_path / 'run')!r}, 1, t.lora_state()[0])\n")
    first = zygote.spawn([str(script)], env=dict(os.environ), stdout=tmp_path / "first_run.out")
    assert first.wait(timeout=120) == 0, (tmp_path / "first_run.out").read_text()
    tmp_path = tmp_path / "run"
    if start == "load_checkpoint":
        state = zarrckpt.load_checkpoint(str(tmp_path), 1, state)
    elif start == "load_checkpoint_if_it_exists":
        state, _ = zarrckpt.load_checkpoint_if_it_exists(str(tmp_path), state)
    state = train(state, optimizer, frozen_as_given=True)
    zarrckpt.save_checkpoint(str(tmp_path), 2, state, unchanged_since=1)
    assert inodes(tmp_path / "0000000002", "params.base.w") == inodes(tmp_path / "0000000001", "params.base.w")
    assert all(s.st_nlink == 1 for s in chunk_files(tmp_path / "0000000002", "params.lora.b").values())
    shutil.rmtree(tmp_path / "0000000001")
    restored = zarrckpt.load_checkpoint(str(tmp_path), 2, as_numpy(lora_state()[0]))
    jax.tree.map(np.testing.assert_array_equal, as_numpy(restored), as_numpy(state))


def test_save_checkpoint_unchanged_since_links_only_chunks_that_step_holds_byte_for_byte(tmp_path):
    """Any committed step may be named: what links is each chunk whose bytes that step's
    commit records (CRC-32C and size), whatever was saved in between."""
    values = np.arange(2**20, dtype=np.float32)
    a, b = {"w": fsdp(jnp.asarray(values))}, {"w": fsdp(jnp.asarray(values[::-1].copy()))}
    zarrckpt.save_checkpoint(str(tmp_path), 1, a)
    zarrckpt.save_checkpoint(str(tmp_path), 2, b)
    zarrckpt.save_checkpoint(str(tmp_path), 3, a, unchanged_since=1)  # step 2 was saved last: no matter
    assert inodes(tmp_path / "0000000003", "w") == inodes(tmp_path / "0000000001", "w")
    zarrckpt.save_checkpoint(str(tmp_path), 4, a, unchanged_since=2)  # other values there: every chunk written
    assert all(s.st_nlink == 1 for s in chunk_files(tmp_path / "0000000004", "w").values())
    half = {"w": fsdp(jnp.asarray(np.concatenate([values[: 2**19], values[::-1][2**19:]])))}
    zarrckpt.save_checkpoint(str(tmp_path), 5, half, unchanged_since=1)  # chunk by chunk: the first half links
    linked = {name for name, ino in inodes(tmp_path / "0000000005", "w").items()
              if ino == inodes(tmp_path / "0000000001", "w")[name]}
    names = sorted(inodes(tmp_path / "0000000001", "w"))
    assert len(names) > 1 and linked == set(names[: len(names) // 2]), linked
    for step, expected in ((3, a), (4, a), (5, half)):
        np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), step)["w"]),
                                      np.asarray(expected["w"]))


def test_save_checkpoint_unchanged_since_a_step_another_save_replaced_writes_every_chunk(tmp_path):
    """Another job's save replaced step 1 with other values: no chunk of it is the one
    this save writes, and nothing is made from it."""
    state = {"w": fsdp(jnp.arange(2**20, dtype=jnp.float32))}
    zarrckpt.save_checkpoint(str(tmp_path), 1, state)
    zarrckpt.save_pytree(str(tmp_path / "0000000001"), {"w": np.zeros(2**20, np.float32)}, overwrite=True)
    zarrckpt.save_checkpoint(str(tmp_path), 2, state, unchanged_since=1)
    assert all(s.st_nlink == 1 for s in chunk_files(tmp_path / "0000000002", "w").values())
    np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), 2)["w"]), np.arange(2**20))


@pytest.mark.parametrize("change", ["replaced", "deleted", "rewritten in place"])
def test_a_step_changed_while_save_checkpoint_links_from_it_never_gives_a_link_to_the_change(
        tmp_path, monkeypatch, change):
    """One writer, so that the links after the change see it: a chunk replaced, deleted
    or rewritten with other bytes since step 1's commit is not the version the commit
    records, so it is never linked: the save writes the bytes it holds and commits the
    values it was given."""
    state = {"w": fsdp(jnp.arange(2**21, dtype=jnp.float32)), "step": jnp.array(1)}
    zarrckpt.save_checkpoint(str(tmp_path), 1, state)
    chunks = chunk_files(tmp_path / "0000000001", "w")
    assert len(chunks) == 8
    copy, done = zarrckpt._storage.local.LocalDisk.copy, []

    def copy_then_change(self, key, source, **kwargs):
        made = copy(self, key, source, **kwargs)
        if not done:  # another job's save replaces step 1 (or its retention deletes it) mid-links
            done.append(True)
            if change == "replaced":
                # Chunked as step 1 was: the links after this one find the replacement's chunks.
                zarrckpt.save_pytree(str(tmp_path / "0000000001"), {"w": fsdp(jnp.zeros(2**21)), "step": 9},
                                     overwrite=True)
            elif change == "deleted":
                zarrckpt._commit.remove(zarrckpt._storage.resolve(str(tmp_path / "0000000001")))
            else:  # the bytes of another chunk, in place, into every chunk not linked yet
                other = chunk_files(tmp_path / "0000000001", "w")
                names = sorted(other)
                for name in names[2:]:
                    with open(tmp_path / "0000000001" / "w" / name, "r+b") as f:
                        f.write((tmp_path / "0000000001" / "w" / names[0]).read_bytes())
        return made

    monkeypatch.setattr(zarrckpt._storage.local.LocalDisk, "copy", copy_then_change)
    zarrckpt.save_checkpoint(str(tmp_path), 2, {**state, "step": jnp.array(2)}, unchanged_since=1, max_workers=1)
    assert done
    monkeypatch.undo()
    restored = zarrckpt.load_checkpoint(str(tmp_path), 2)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(2**21))
    assert zarrckpt.verify(str(tmp_path / "0000000002")).ok


def test_a_step_replaced_behind_a_managers_back_fails_its_next_save_instead_of_linking_the_replacement(tmp_path):
    """Another program replaces a step (no lease asked): the manager's save that links
    from that step finds it replaced after its links, and commits nothing."""
    state = {"w": fsdp(jnp.arange(2**20, dtype=jnp.float32)), "step": jnp.array(1)}
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
        mgr.wait()
        # Chunked as step 1 was: the links find the replacement's chunks.
        replace_from_outside(tmp_path / "0000000001", {"w": fsdp(jnp.zeros(2**20)), "step": 9})
        mgr.save(2, {**state, "step": jnp.array(2)})
        with pytest.raises(zarrckpt.CheckpointWriteError, match="reuse_unchanged"):
            mgr.wait()
        mgr.save(3, {**state, "step": jnp.array(3)})
    assert zarrckpt.all_steps(str(tmp_path)) == [1, 3]
    np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), 3)["w"]), np.arange(2**20))


def test_save_checkpoint_whose_step_cannot_be_read_writes_every_chunk(tmp_path, monkeypatch, caplog):
    state = {"w": fsdp(jnp.arange(2**20, dtype=jnp.float32))}
    zarrckpt.save_checkpoint(str(tmp_path), 1, state)
    read_group = zarrckpt._commit.read_group

    def failing(loc):
        if loc.url.endswith("0000000001"):
            raise PermissionError("access denied")
        return read_group(loc)

    monkeypatch.setattr(zarrckpt._commit, "read_group", failing)
    with caplog.at_level("WARNING", logger="zarrckpt"):
        zarrckpt.save_checkpoint(str(tmp_path), 2, state, unchanged_since=1)
    assert any("0000000001" in r.getMessage() and "access denied" in r.getMessage() for r in caplog.records)
    assert all(s.st_nlink == 1 for s in chunk_files(tmp_path / "0000000002", "w").values())


def test_the_log_line_of_a_save_says_what_it_made_from_a_step_and_only_then(tmp_path, caplog):
    state = {"w": fsdp(jnp.arange(2**20, dtype=jnp.float32))}
    with caplog.at_level("INFO", logger="zarrckpt"):
        with zarrckpt.CheckpointManager(str(tmp_path / "managed")) as mgr:
            for step in (1, 2):
                mgr.save(step, state)
        for step in (1, 2):
            zarrckpt.save_checkpoint(str(tmp_path / "by-hand"), step, state,
                                     unchanged_since=1 if step == 2 else None)
    lines = [r.getMessage() for r in caplog.records]
    notes = [line for line in lines if "4.0 MiB unchanged, made from" in line or "4.0 MiB of chunks unchanged" in line]
    assert len(notes) == 2, lines
    assert any("0000000001" in line.split("made from", 1)[1] and "managed" in line for line in notes)
    assert any(line.split("made from", 1)[1].strip().startswith(f"{tmp_path}/by-hand/0000000001") for line in notes)


@pytest.mark.parametrize(("value", "error"), [(3, ValueError), (-1, ValueError), ("2", TypeError), (2.0, TypeError)])
def test_save_checkpoint_refuses_a_bad_unchanged_since_naming_it(tmp_path, value, error):
    with pytest.raises(error, match="unchanged_since"):
        zarrckpt.save_checkpoint(str(tmp_path), 3, {"w": np.arange(4)}, unchanged_since=value)
    assert not tmp_path.joinpath("0000000003").exists()


def test_on_s3_save_checkpoint_unchanged_since_copies_inside_the_store(new_store):
    store = new_store("s3")
    state, optimizer = lora_state()
    for step in (1, 2):
        state = train(state, optimizer, frozen_as_given=True)
        store.server.recorder.reset()
        zarrckpt.save_checkpoint(store.url, step, state, storage_options=store.options,
                                 unchanged_since=1 if step == 2 else None)
    base_bytes = 1024 * 2048 * 2 + 512 * 2048 * 4
    assert store.server.recorder.bytes_received < 0.2 * base_bytes
    assert store.server.recorder.copies
    fsspec.filesystem("s3", **store.options).rm(f"{store.url}/0000000001", recursive=True)
    restored = zarrckpt.load_checkpoint(store.url, 2, as_numpy(lora_state()[0]), storage_options=store.options)
    jax.tree.map(np.testing.assert_array_equal, as_numpy(restored), as_numpy(state))


def test_a_numpy_restore_of_a_step_replaced_behind_a_managers_back_makes_the_next_save_write_everything(tmp_path):
    state = {"w": fsdp(jnp.arange(2**20, dtype=jnp.float32))}
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
        mgr.wait()
        replace_from_outside(tmp_path / "0000000001", {"w": fsdp(jnp.zeros(2**20))})
        mgr.restore(None, step=1)  # the replacement's values, as numpy: the step holds what the arrays do not
        mgr.save(2, state)
    assert all(s.st_nlink == 1 for s in chunk_files(tmp_path / "0000000002", "w").values())
    np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), 2)["w"]), np.arange(2**20))


def test_a_write_failing_for_its_own_reason_beside_links_is_raised_as_it_is(tmp_path, monkeypatch):
    """The chunk of leaf `step` cannot be written (a read-only file system) after every
    link is made, and the step linked from is deleted meanwhile: the save raises the
    write's own error, which saving again would meet, not the deletion."""
    state = {"w": fsdp(jnp.arange(2**20, dtype=jnp.float32)), "step": jnp.array(1)}
    zarrckpt.save_checkpoint(str(tmp_path), 1, state)
    write = zarrckpt._storage.local.LocalDisk.write

    def refusing(self, key, parts, **kwargs):
        *_, leaf, name = ["", *key.split("/")]
        if leaf == "step" and name.startswith("c"):  # the chunk of leaf `step`, after the links (one writer)
            zarrckpt._commit.remove(zarrckpt._storage.resolve(str(tmp_path / "0000000001")))
            raise PermissionError(13, "read-only file system", key)
        return write(self, key, parts, **kwargs)

    monkeypatch.setattr(zarrckpt._storage.local.LocalDisk, "write", refusing)
    with pytest.raises(zarrckpt.CheckpointWriteError, match="read-only file system") as raised:
        zarrckpt.save_checkpoint(str(tmp_path), 2, {**state, "step": jnp.array(2)}, unchanged_since=1,
                                 max_workers=1)
    assert "unchanged_since" not in str(raised.value)


def test_save_checkpoint_knows_a_local_directory_however_it_is_spelled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = {"w": fsdp(jnp.arange(2**20, dtype=jnp.float32))}
    zarrckpt.save_checkpoint("run", 1, state)
    zarrckpt.save_checkpoint(f"file://{tmp_path}/run/", 2, state, unchanged_since=1)
    zarrckpt.save_checkpoint(f"{tmp_path}/./run", 3, state, unchanged_since=2)
    assert inodes(tmp_path / "run" / "0000000003", "w") == inodes(tmp_path / "run" / "0000000001", "w")


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse on", "reuse off"])
def test_a_donated_leaf_is_refused_with_reuse_on_as_with_it_off(tmp_path, reuse):
    """A leaf saved, then donated to a jitted step (deleted), then saved again: the
    save raises before anything is committed, reuse on or off (a deleted array is the
    very array last saved, but holds nothing any more)."""
    w = fsdp(jnp.arange(4096.0))
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=False, reuse_unchanged=reuse) as mgr:
        mgr.save(1, {"w": w})
        jax.jit(lambda v: v * 2, donate_argnums=0)(w)
        assert w.is_deleted()
        with pytest.raises(RuntimeError, match="deleted"):
            mgr.save(2, {"w": w})
        mgr.save(3, {"w": fsdp(jnp.arange(4096.0) + 3)})
    assert zarrckpt.all_steps(str(tmp_path)) == [1, 3]
    np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), 3)["w"]), np.arange(4096.0) + 3)


def same_crc32c(data: bytes, positions: Sequence[int]) -> bytes:
    """`data` with some bits of the bytes at `positions` flipped so that its CRC-32C is
    unchanged (CRC is linear over GF(2): 64 bits of freedom against 32 of checksum leave
    a combination of flips whose checksum difference is zero)."""
    zero = crc32c.crc32c(bytes(len(data)))
    basis: dict[int, tuple[int, int]] = {}  # the top bit of a difference -> (difference, flips making it)
    for i in range(8 * len(positions)):
        flip = bytearray(len(data))
        flip[positions[i // 8]] = 1 << (i % 8)
        difference, flips = crc32c.crc32c(bytes(flip)) ^ zero, 1 << i
        while difference:
            top = difference.bit_length() - 1
            if top not in basis:
                basis[top] = (difference, flips)
                break
            difference, flips = difference ^ basis[top][0], flips ^ basis[top][1]
        else:
            out = bytearray(data)
            for j in range(8 * len(positions)):
                if flips >> j & 1:
                    out[positions[j // 8]] ^= 1 << (j % 8)
            return bytes(out)
    raise AssertionError("no combination found")


@pytest.mark.parametrize("saver", ["manager", "unchanged_since"])
def test_a_changed_chunk_of_the_same_crc32c_and_size_is_written_never_made_from_the_step(tmp_path, saver):
    """A chunk's CRC-32C and size are only a first look: a chunk of other bytes with the
    same checksum (one in 2**32 changed chunks, by chance) is read from the step and
    compared byte for byte, and written."""
    values = np.arange(1024, dtype=np.int32)
    forged = np.frombuffer(same_crc32c(values.tobytes(), [100, 101, 102, 103, 2000, 2001, 2002, 2003]), np.int32)
    assert crc32c.crc32c(forged.tobytes()) == crc32c.crc32c(values.tobytes())
    assert not np.array_equal(forged, values)
    states = [{"x": jnp.asarray(values)}, {"x": jnp.asarray(forged)}]
    if saver == "manager":
        with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
            for step, state in enumerate(states, 1):
                mgr.save(step, state)
    else:
        zarrckpt.save_checkpoint(str(tmp_path), 1, states[0])
        zarrckpt.save_checkpoint(str(tmp_path), 2, states[1], unchanged_since=1)
    assert inodes(tmp_path / "0000000002", "x") != inodes(tmp_path / "0000000001", "x")
    np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), 2)["x"]), forged)
    assert zarrckpt.verify(str(tmp_path / "0000000002")).ok
