"""Checkpoints written by seqax's own algorithm (zarr v2, keystr names) load unchanged."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zarr
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import zarrckpt
from zarrckpt import _storage


def seqax_save_zarr(checkpoint_dir: str, step: int, state, *, commit: bool = True) -> None:
    """seqax's training_io.save_zarr, single process: v2 group, keystr names, chunk = shard shape;
    without `commit`, as a save cut short before its marker leaves it."""
    group = zarr.open_group(f"{checkpoint_dir}/{str(step).zfill(10)}", mode="w-", zarr_format=2)
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    for path, arr in flat:
        z = group.create_array(jax.tree_util.keystr(path), shape=arr.shape, dtype=arr.dtype,
                               chunks=arr.sharding.shard_shape(arr.shape),
                               compressors=None if arr.dtype == jnp.bfloat16 else "auto")
        for shard in arr.addressable_shards:
            if shard.replica_id == 0:
                z[shard.index] = np.asarray(shard.data)
    if commit:
        group.attrs["write_completed"] = True


def state():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    return {
        "params": {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model"))),
                   "emb": jax.device_put(jnp.ones((4, 8), jnp.bfloat16), NamedSharding(mesh, P()))},
        "opt": [jax.device_put(jnp.full((8,), 2.0), NamedSharding(mesh, P("model")))],
        "step": jax.device_put(jnp.array(11, jnp.uint32), NamedSharding(mesh, P())),
    }


def test_seqax_checkpoints_load(tmp_path):
    saved = state()
    seqax_save_zarr(str(tmp_path), 11, saved)
    seqax_save_zarr(str(tmp_path), 12, saved)
    # An incomplete seqax step (no write_completed) is skipped.
    zarr.open_group(f"{tmp_path}/0000000013", mode="w-", zarr_format=2)
    assert zarrckpt.all_steps(str(tmp_path)) == [11, 12]

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(4), ("x",))
    target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                   sharding=NamedSharding(mesh, P())), saved)
    restored, step = zarrckpt.load_checkpoint_if_it_exists(str(tmp_path), target)
    assert step == 12
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(saved)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))

    plain = zarrckpt.load_pytree(f"{tmp_path}/0000000012")
    assert set(plain) == {"params", "opt", "step"} and isinstance(plain["opt"], list)
    np.testing.assert_array_equal(plain["params"]["w"], np.arange(64.0).reshape(8, 8))
    meta = zarrckpt.metadata(f"{tmp_path}/0000000012")
    assert meta.layout == "seqax" and meta.committed and meta.format_version is None
    assert {leaf.key_path for leaf in meta.leaves} == {"['params']['w']", "['params']['emb']", "['opt'][0]", "['step']"}


def test_a_manager_resuming_a_seqax_run_replaces_seqax_s_save_cut_short_and_retention_deletes_its_steps(tmp_path):
    saved = state()
    seqax_save_zarr(str(tmp_path), 12, saved)
    seqax_save_zarr(str(tmp_path), 13, saved, commit=False)  # seqax stopped while saving step 13
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=1, async_save=False) as mgr:
        restored, step = mgr.restore(saved)
        assert step == 12
        for new in (13, 14):
            mgr.save(new, {**restored, "step": jnp.array(new, jnp.uint32)})
    assert zarrckpt.all_steps(str(tmp_path)) == [14]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["0000000014"]


def test_a_copy_cut_short_on_s3_leaves_no_chunk_without_its_array_s_metadata_and_is_replaced(tmp_path, s3_server,
                                                                                              monkeypatch):
    """On S3 a copy writes no group metadata before its commit, and zarr v2 chunk keys
    count as a leftover's only beside their array's metadata (a folder of someone's
    numbered files has none): a copy whose array metadata fails has written no chunk,
    and the next copy replaces what it left."""
    seqax_save_zarr(str(tmp_path / "run"), 12, state())
    src, dst, options = f"{tmp_path}/run/0000000012", f"s3://{s3_server.new_bucket()}/copy", s3_server.options()
    original = _storage.Location.create

    def failing_array_metadata(self, key, *parts):
        if key.endswith("/.zarray"):
            time.sleep(0.2)  # as a store slow to refuse: any chunk sent meanwhile would land
            raise OSError("injected failure")
        return original(self, key, *parts)

    monkeypatch.setattr(_storage.Location, "create", failing_array_metadata)
    with pytest.raises(zarrckpt.CheckpointWriteError, match="injected failure"):
        zarrckpt.copy_checkpoint(src, dst, dst_storage_options=options)
    left = [entry.name for entry in _storage.resolve(dst, options).walk()]
    assert not [key for key in left if key.rsplit("/", 1)[-1][0].isdigit()], left  # no chunk
    monkeypatch.undo()
    zarrckpt.copy_checkpoint(src, dst, dst_storage_options=options)  # replaces the partial copy
    assert zarrckpt.verify(dst, storage_options=options).ok


def test_a_seqax_checkpoint_copied_to_s3_and_back_is_the_same_checkpoint(tmp_path, s3_server):
    saved = state()
    seqax_save_zarr(str(tmp_path / "run"), 12, saved)
    there, options = f"s3://{s3_server.new_bucket()}/0000000012", s3_server.options()
    zarrckpt.copy_checkpoint(f"{tmp_path}/run/0000000012", there, dst_storage_options=options)
    zarrckpt.copy_checkpoint(there, str(tmp_path / "back"), src_storage_options=options)
    assert zarrckpt.verify(str(tmp_path / "back")).ok
    back = zarrckpt.load_pytree(str(tmp_path / "back"))
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
