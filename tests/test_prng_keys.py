"""Typed PRNG keys: the saved kind decides. Keys come back as keys on any target that does
not say otherwise (a Sharding, `zarrckpt.metadata(url).tree`, no target at all), onto
another device count or spec; a target that contradicts the saved kind is a mismatch
that says how to convert. Written as flax NNX users write their code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import zarrckpt


def is_key(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def keys_over(devices: int) -> jax.Array:
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    return jax.device_put(jax.random.split(jax.random.key(3), 8), NamedSharding(mesh, P("x")))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.rngs = rngs


def test_a_shardings_target_keeps_nnx_rngs_typed(tmp_path):
    """The README's recipe for another mesh (a tree of Shardings) on an NNX model with
    Rngs: the keys stay keys, so the model runs and its next checkpoint restores too."""
    model = Model(nnx.Rngs(0, dropout=1))
    state = nnx.state(model)
    zarrckpt.save_pytree(str(tmp_path / "a"), state)
    restored = zarrckpt.load_pytree(str(tmp_path / "a"), jax.tree.map(lambda x: x.sharding, state))
    keys = [x for x in jax.tree.leaves(restored) if is_key(x)]
    assert len(keys) == len([x for x in jax.tree.leaves(state) if is_key(x)]) > 0
    nnx.update(model, restored)
    model.dropout(jnp.ones((2, 4)))  # uses the restored key
    zarrckpt.save_pytree(str(tmp_path / "b"), nnx.state(model))
    fresh = Model(nnx.Rngs(5, dropout=6))
    nnx.update(fresh, zarrckpt.load_pytree(str(tmp_path / "b"), nnx.state(fresh)))
    for a, b in zip(jax.tree.leaves(nnx.state(fresh)), jax.tree.leaves(nnx.state(model))):
        if is_key(a):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("devices,spec", [(4, P("x")), (2, P()), (8, P("x"))],
                         ids=["8 to 4 devices", "onto 2, replicated", "8 to 8"])
def test_keys_restore_onto_another_device_count_and_spec(tmp_path, devices, spec):
    saved = keys_over(8)
    zarrckpt.save_pytree(str(tmp_path), {"rng": saved})
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    for target in (NamedSharding(mesh, spec),
                   jax.ShapeDtypeStruct(saved.shape, saved.dtype, sharding=NamedSharding(mesh, spec))):
        got = zarrckpt.load_pytree(str(tmp_path), {"rng": target})["rng"]
        assert is_key(got) and got.sharding.is_equivalent_to(NamedSharding(mesh, spec), got.ndim)
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(saved))


def test_metadata_tree_as_a_target_keeps_keys_typed(tmp_path):
    zarrckpt.save_pytree(str(tmp_path), {"rng": jax.random.key(7), "w": jnp.ones(3)})
    tree = zarrckpt.metadata(str(tmp_path)).tree
    assert jnp.issubdtype(tree["rng"].dtype, jax.dtypes.prng_key) and tree["rng"].shape == ()
    assert is_key(zarrckpt.load_pytree(str(tmp_path), tree)["rng"])
    assert is_key(zarrckpt.load_pytree(str(tmp_path))["rng"])  # no target: keys too


def test_raw_key_data_targets_for_typed_keys_are_a_mismatch_saying_how(tmp_path):
    zarrckpt.save_pytree(str(tmp_path / "typed"), {"rng": jax.random.key(7)})
    for target in (jax.ShapeDtypeStruct((2,), jnp.uint32), np.zeros(2, np.uint32)):
        with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"\['rng'\]: typed PRNG keys \(threefry2x32\) "
                           r"in the checkpoint.*jax.random.key_data"):
            zarrckpt.load_pytree(str(tmp_path / "typed"), {"rng": target})
    zarrckpt.save_pytree(str(tmp_path / "raw"), {"rng": jax.random.key_data(jax.random.key(7))})
    with pytest.raises(zarrckpt.CheckpointMismatchError, match="jax.random.wrap_key_data"):
        zarrckpt.load_pytree(str(tmp_path / "raw"), {"rng": jax.random.key(0)})
