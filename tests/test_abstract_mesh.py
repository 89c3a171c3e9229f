"""Targets whose shardings live on an `AbstractMesh`, as `nnx.eval_shape` and
`jax.eval_shape` under `jax.set_mesh` make them, restore onto the concrete mesh of the
same axes: the current one (`jax.set_mesh`), else one of all of `jax.devices()`; where
neither exists, the error names the leaf, the axes and the fix."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

import zarrckpt


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc_in = nnx.Linear(
            8, 16, rngs=rngs,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", "model")),
            bias_init=nnx.with_partitioning(nnx.initializers.normal(), ("model",)))
        self.fc_out = nnx.Linear(
            16, 4, rngs=rngs, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc_out(nnx.relu(self.fc_in(x)))


def mesh_2x4() -> Mesh:
    return jax.make_mesh((2, 4), ("data", "model"))


def restore(entry: str, tmp_path: Any, state: Any, target: Any) -> Any:
    """Saves `state` and restores it onto `target` through one of the public restore calls."""
    if entry == "load_pytree":
        zarrckpt.save_pytree(str(tmp_path / "ckpt"), state)
        return zarrckpt.load_pytree(str(tmp_path / "ckpt"), target)
    if entry == "load_checkpoint":
        zarrckpt.save_checkpoint(str(tmp_path / "run"), 3, state)
        return zarrckpt.load_checkpoint(str(tmp_path / "run"), 3, target)
    with zarrckpt.CheckpointManager(str(tmp_path / "mgr")) as mgr:
        mgr.save(3, state, force=True)
        mgr.wait()
        restored, step = mgr.restore(target)
    assert step == 3
    return restored


def assert_exact_on(restored: Any, expected: Any, mesh: Mesh) -> None:
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree_util.tree_leaves(expected)):
        assert got.sharding == NamedSharding(mesh, want.sharding.spec), jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("entry", ["load_pytree", "load_checkpoint", "CheckpointManager.restore"])
def test_nnx_eval_shape_state_under_set_mesh_restores_exactly_onto_that_mesh(tmp_path, entry):
    mesh = mesh_2x4()
    with jax.set_mesh(mesh):
        state = nnx.state(Model(nnx.Rngs(0)))
        abs_state = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(1))))
        assert isinstance(jax.tree.leaves(abs_state)[0].sharding.mesh, AbstractMesh)
        restored = restore(entry, tmp_path, state, abs_state)
        model = nnx.eval_shape(lambda: Model(nnx.Rngs(1)))
        nnx.update(model, restored)
        assert model(jnp.ones((2, 8))).shape == (2, 4)  # the restored model runs under the mesh
    assert_exact_on(restored, state, mesh)
    assert restored["fc_in"]["kernel"].sharding.spec == P("data", "model")


def test_abstract_target_restores_onto_the_current_mesh_rather_than_one_of_all_devices(tmp_path):
    reversed_mesh = Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("data", "model"))
    state = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh_2x4(), P("data", "model")))}
    target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32,
                                        sharding=NamedSharding(reversed_mesh.abstract_mesh, P("data", "model")))}
    with jax.set_mesh(reversed_mesh):
        restored = restore("load_pytree", tmp_path, state, target)
    assert_exact_on(restored, state, reversed_mesh)


def test_jax_eval_shape_of_a_jitted_init_restores_without_a_current_mesh(tmp_path):
    mesh = mesh_2x4()
    shardings = {"embed": NamedSharding(mesh.abstract_mesh, P("model", None)),
                 "mu": NamedSharding(mesh.abstract_mesh, P(None, "data"))}

    def init() -> dict:
        return {"embed": jnp.arange(128.0).reshape(16, 8), "mu": jnp.ones((4, 6), jnp.bfloat16)}

    state = jax.jit(init, out_shardings={k: NamedSharding(mesh, s.spec) for k, s in shardings.items()})()
    abstract = jax.eval_shape(jax.jit(init, out_shardings=shardings))
    assert isinstance(abstract["embed"].sharding.mesh, AbstractMesh)
    assert jax.sharding.get_mesh().empty
    restored = restore("load_checkpoint", tmp_path, state, abstract)
    assert_exact_on(restored, state, mesh)
    assert restored["mu"].dtype == jnp.bfloat16


def test_bare_shardings_on_an_abstract_mesh_restore_without_a_current_mesh(tmp_path):
    mesh = mesh_2x4()
    state = {"w": jax.device_put(jnp.arange(32).reshape(4, 8), NamedSharding(mesh, P(None, "model"))),
             "key": jax.random.key(7)}
    target = jax.tree.map(lambda _: NamedSharding(mesh.abstract_mesh, P()), state)
    restored = restore("CheckpointManager.restore", tmp_path, state, target)
    assert restored["w"].sharding == NamedSharding(mesh, P())
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
    assert jnp.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))


def test_abstract_mesh_no_device_layout_matches_is_an_error_naming_leaf_axes_and_fix(tmp_path):
    zarrckpt.save_pytree(str(tmp_path / "ckpt"), {"params": {"w": jnp.zeros((8, 8))}})
    too_big = AbstractMesh((4, 4), ("data", "model"))
    target = {"params": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(too_big, P("data")))}}
    with pytest.raises(zarrckpt.UnsupportedLeafError) as raised:
        zarrckpt.load_pytree(str(tmp_path / "ckpt"), target)
    message = str(raised.value)
    assert "['params']['w']" in message and "'data': 4, 'model': 4" in message
    assert "no mesh is current" in message and "jax.set_mesh(mesh)" in message and "concrete Mesh" in message

    with jax.set_mesh(jax.make_mesh((8,), ("batch",))), pytest.raises(zarrckpt.UnsupportedLeafError) as raised:
        zarrckpt.load_pytree(str(tmp_path / "ckpt"), target)
    assert "the current mesh (jax.set_mesh) has axes 'batch': 8" in str(raised.value)


def test_abstract_target_restores_from_the_local_tier_and_an_unplaceable_one_keeps_the_copy(tmp_path):
    mesh = mesh_2x4()
    persistent, local = str(tmp_path / "run"), str(tmp_path / "local")
    state = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model")))}
    with zarrckpt.CheckpointManager(persistent, save_interval_steps=4, local_directory=local,
                                    local_save_interval_steps=3) as mgr:
        assert mgr.save(3, state)  # the local tier's alone
    target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32,
                                        sharding=NamedSharding(mesh.abstract_mesh, P("data", "model")))}
    unplaceable = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32,
                                             sharding=NamedSharding(AbstractMesh((4, 4), ("data", "model")), P()))}
    with zarrckpt.CheckpointManager(persistent, local_directory=local, local_save_interval_steps=3) as mgr:
        with pytest.raises(zarrckpt.UnsupportedLeafError, match=r"target leaf \['w'\]"):
            mgr.restore(unplaceable)  # the target's fault: the copy is kept, not set aside as damaged
        restored, step = mgr.restore(target)
        assert (step, mgr.restored_tier) == (3, "local")
    assert_exact_on(restored, state, mesh)
