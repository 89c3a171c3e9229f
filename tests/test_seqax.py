"""Checkpoints written by seqax's own algorithm (zarr v2, keystr names) load unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import zarr
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import zarrckpt


def seqax_save_zarr(checkpoint_dir: str, step: int, state) -> None:
    """seqax's training_io.save_zarr, single process: v2 group, keystr names, chunk = shard shape."""
    group = zarr.open_group(f"{checkpoint_dir}/{str(step).zfill(10)}", mode="w-", zarr_format=2)
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    for path, arr in flat:
        z = group.create_array(jax.tree_util.keystr(path), shape=arr.shape, dtype=arr.dtype,
                               chunks=arr.sharding.shard_shape(arr.shape),
                               compressors=None if arr.dtype == jnp.bfloat16 else "auto")
        for shard in arr.addressable_shards:
            if shard.replica_id == 0:
                z[shard.index] = np.asarray(shard.data)
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
