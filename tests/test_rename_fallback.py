"""Restoring across model versions: `rename=` maps a newer model's leaf names onto an
older checkpoint's, `fallback=True` keeps what the checkpoint lacks as the target has
it, and the mismatch report says which `rename=` would fix names that differ by a
renamed path component. Real flax (linen and NNX) models and optax states."""

from __future__ import annotations

import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import zarrckpt

RENAME_V2 = [(r"(^|\.)backbone\.", r"\1encoder."), (r"\.fc_in\.", ".Dense_0."), (r"\.fc_out\.", ".Dense_1.")]


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.Dense(16, name="proj")(x))


class Mlp(nn.Module):
    names: tuple[str, str] | None = None  # None: flax's own names, Dense_0 and Dense_1

    @nn.compact
    def __call__(self, x):
        first, second = self.names or (None, None)
        hidden = nn.relu(nn.Dense(32, name=first)(x))
        return nn.Dense(4, name=second)(hidden)


class Model(nn.Module):
    encoder: str = "encoder"
    layers: tuple[str, str] | None = None

    @nn.compact
    def __call__(self, x):
        return Mlp(self.layers, name="mlp")(Encoder(name=self.encoder)(x))


V1 = Model()
V2 = Model(encoder="backbone", layers=("fc_in", "fc_out"))
X = jnp.linspace(-1, 1, 16).reshape(2, 8)


def mesh(shape: tuple[int, int]) -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("x", "y"))


def shardings(tree, m: Mesh):
    return jax.tree_util.tree_map(lambda a: NamedSharding(m, P("x", "y") if a.ndim == 2 else P()), tree)


def save_v1(url: str) -> dict:
    """v1 trained a step with adam on a (2, 4) mesh, saved at `url`; returns its state."""
    params = V1.init(jax.random.key(0), X)["params"]
    params = jax.device_put(params, shardings(params, mesh((2, 4))))
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    grads = jax.grad(lambda p: jnp.sum(V1.apply({"params": p}, X) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    state = {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "step": 1}
    zarrckpt.save_pytree(url, state)
    return state


def v2_target(dtype=jnp.bfloat16) -> dict:
    """v2's state as ShapeDtypeStructs on a (4, 2) mesh, params in `dtype`."""
    m = mesh((4, 2))
    params = jax.eval_shape(lambda: V2.init(jax.random.key(1), X)["params"])
    params = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype, sharding=s), params,
                                    shardings(params, m))
    opt_state = jax.eval_shape(optax.adam(1e-2).init, params)
    opt_state = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32 if a.ndim else a.dtype,
                                       sharding=NamedSharding(m, P("x", "y") if a.ndim == 2 else P())), opt_state)
    return {"params": params, "opt_state": opt_state, "step": 0}


def v1_names(name: str) -> str:
    return name.replace("backbone", "encoder").replace("fc_in", "Dense_0").replace("fc_out", "Dense_1")


def assert_v2_holds_v1(restored: dict, saved: dict, target: dict) -> None:
    renamed = {v1_names(jax.tree_util.keystr(path)): leaf
               for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]}
    for path, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]:
        got = renamed[jax.tree_util.keystr(path)]
        want = np.asarray(leaf).astype(np.asarray(got).dtype)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=jax.tree_util.keystr(path))
    for got, wanted in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(target), strict=True):
        if isinstance(wanted, jax.ShapeDtypeStruct):
            assert got.dtype == wanted.dtype and got.sharding == wanted.sharding


@pytest.mark.parametrize("how", ["pairs", "function"])
def test_v2_with_renamed_modules_restores_v1_exactly_onto_another_mesh_in_bf16(tmp_path, how):
    saved = save_v1(str(tmp_path / "v1"))
    target = v2_target()
    rename = RENAME_V2 if how == "pairs" else v1_names
    restored = zarrckpt.load_pytree(str(tmp_path / "v1"), target, rename=rename, allow_dtype_cast=True)
    assert_v2_holds_v1(restored, saved, target)
    assert restored["params"]["backbone"]["proj"]["kernel"].dtype == jnp.bfloat16
    out = V2.apply({"params": restored["params"]}, X)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(V1.apply({"params": saved["params"]}, X)), rtol=0.1, atol=0.05)


def test_a_rename_reads_the_same_bytes_as_a_restore_without_it(tmp_path, caplog):
    saved = save_v1(str(tmp_path / "v1"))
    caplog.set_level(logging.INFO, logger="zarrckpt")
    v1_target = jax.tree_util.tree_map(lambda a: np.zeros_like(np.asarray(a)) if np.ndim(a) else a, saved)
    zarrckpt.load_pytree(str(tmp_path / "v1"), v1_target)
    zarrckpt.load_pytree(str(tmp_path / "v1"), v2_target(jnp.float32), rename=RENAME_V2)
    plain, renamed = [re.search(r"(\d+ leaves, [\d.]+ \S+)", r.getMessage()).group(1)
                      for r in caplog.records if r.getMessage().startswith("restored")]
    assert plain == renamed


def test_a_fresh_optimizer_state_falls_back_to_the_target_and_the_next_jitted_step_trains(tmp_path, caplog):
    saved = save_v1(str(tmp_path / "v1"))
    m = mesh((4, 2))
    params = V2.init(jax.random.key(1), X)["params"]
    params = jax.device_put(params, shardings(params, m))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2, momentum=0.9))  # not v1's adam
    fresh = tx.init(params)
    caplog.set_level(logging.INFO, logger="zarrckpt")
    restored = zarrckpt.load_pytree(str(tmp_path / "v1"), {"params": params, "opt_state": fresh, "step": 0},
                                    rename=RENAME_V2, partial=True, fallback=True)
    for kept, own in zip(jax.tree_util.tree_leaves(restored["opt_state"]), jax.tree_util.tree_leaves(fresh),
                         strict=True):
        assert kept is own
    np.testing.assert_array_equal(np.asarray(restored["params"]["mlp"]["fc_in"]["kernel"]),
                                  np.asarray(saved["params"]["mlp"]["Dense_0"]["kernel"]))
    assert restored["step"] == 1
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restored")]
    kept_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(fresh))
    assert f"; {len(jax.tree_util.tree_leaves(fresh))} leaves (" in line and "fell back" in line, line
    assert kept_bytes > 0

    @jax.jit
    def train_step(p, o):
        grads = jax.grad(lambda q: jnp.sum(V2.apply({"params": q}, X) ** 2))(p)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o

    new_params, _ = train_step(restored["params"], restored["opt_state"])
    assert not np.array_equal(np.asarray(new_params["mlp"]["fc_in"]["kernel"]),
                              np.asarray(restored["params"]["mlp"]["fc_in"]["kernel"]))


def test_fallback_needs_concrete_values_and_names_the_leaf_that_is_not(tmp_path):
    save_v1(str(tmp_path / "v1"))
    target = {"params": v2_target(jnp.float32)["params"], "head": jax.ShapeDtypeStruct((4,), jnp.float32)}
    with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"\['head'\]: in the target but not in the "
                       r"checkpoint, and fallback=True keeps only a concrete target value .* not a ShapeDtypeStruct"):
        zarrckpt.load_pytree(str(tmp_path / "v1"), target, rename=RENAME_V2, partial=True, fallback=True)


def test_without_fallback_the_mismatch_says_fallback_would_keep_concrete_leaves(tmp_path):
    save_v1(str(tmp_path / "v1"))
    target = {"params": v2_target(jnp.float32)["params"], "head": np.zeros(4, np.float32)}
    with pytest.raises(zarrckpt.CheckpointMismatchError, match="pass fallback=True to keep the target's own values"):
        zarrckpt.load_pytree(str(tmp_path / "v1"), target, rename=RENAME_V2, partial=True)
    target["head"] = jax.ShapeDtypeStruct((4,), jnp.float32)
    with pytest.raises(zarrckpt.CheckpointMismatchError) as info:
        zarrckpt.load_pytree(str(tmp_path / "v1"), target, rename=RENAME_V2, partial=True)
    assert "fallback=True" not in str(info.value)


def test_tied_weights_renamed_onto_one_saved_leaf_each_get_its_values_on_their_own_sharding(tmp_path, caplog):
    saved = save_v1(str(tmp_path / "v1"))
    kernel = np.asarray(saved["params"]["encoder"]["proj"]["kernel"])
    a, b = NamedSharding(mesh((2, 4)), P("x", "y")), NamedSharding(mesh((4, 2)), P(None, "x"))
    target = {"embed": jax.ShapeDtypeStruct(kernel.shape, jnp.float32, sharding=a),
              "unembed": jax.ShapeDtypeStruct(kernel.shape, jnp.bfloat16, sharding=b), "host": np.zeros_like(kernel)}
    caplog.set_level(logging.INFO, logger="zarrckpt")
    restored = zarrckpt.load_pytree(str(tmp_path / "v1"), target, rename=[(r"^\w+$", "params.encoder.proj.kernel")],
                                    partial=True, allow_dtype_cast=True)
    np.testing.assert_array_equal(np.asarray(restored["embed"]), kernel)
    np.testing.assert_array_equal(np.asarray(restored["unembed"]), kernel.astype(jnp.bfloat16))
    np.testing.assert_array_equal(restored["host"], kernel)
    assert restored["embed"].sharding == a and restored["unembed"].sharding == b
    assert restored["unembed"].dtype == jnp.bfloat16
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restored")]
    assert ": 1 leaves, " in line, line  # read once


def test_a_tied_leaf_in_the_saved_dtype_gets_the_saved_values_after_one_cast_to_bf16(tmp_path):
    saved = save_v1(str(tmp_path / "v1"))
    kernel = np.asarray(saved["params"]["encoder"]["proj"]["kernel"])
    target = {"a_bf16": jax.ShapeDtypeStruct(kernel.shape, jnp.bfloat16),
              "b_f32": jax.ShapeDtypeStruct(kernel.shape, jnp.float32), "c_host": np.zeros_like(kernel)}
    restored = zarrckpt.load_pytree(str(tmp_path / "v1"), target, rename=[(r"^\w+$", "params.encoder.proj.kernel")],
                                    partial=True, allow_dtype_cast=True)
    np.testing.assert_array_equal(np.asarray(restored["b_f32"]), kernel)
    np.testing.assert_array_equal(restored["c_host"], kernel)
    np.testing.assert_array_equal(np.asarray(restored["a_bf16"]), kernel.astype(jnp.bfloat16))


def _buffers(array: jax.Array) -> set[int]:
    return {shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards}


def test_tied_weights_on_one_sharding_get_buffers_of_their_own_so_a_donating_step_runs(tmp_path):
    saved = save_v1(str(tmp_path / "v1"))
    kernel = saved["params"]["encoder"]["proj"]["kernel"]
    sharding = NamedSharding(mesh((2, 4)), P("x", "y"))
    target = {"embed": jax.ShapeDtypeStruct(kernel.shape, jnp.float32, sharding=sharding),
              "unembed": jax.ShapeDtypeStruct(kernel.shape, jnp.float32, sharding=sharding)}
    restored = zarrckpt.load_pytree(str(tmp_path / "v1"), target, rename=[(r"^\w+$", "params.encoder.proj.kernel")],
                                    partial=True)
    assert not _buffers(restored["embed"]) & _buffers(restored["unembed"])
    step = jax.jit(lambda s: jax.tree_util.tree_map(lambda a: a + 1, s), donate_argnums=0)
    stepped = step(restored)
    np.testing.assert_array_equal(np.asarray(stepped["unembed"]), np.asarray(kernel) + 1)


def test_a_tied_leaf_comes_back_on_its_own_sharding_when_the_leaf_read_is_shared_by_processes(tmp_path, monkeypatch):
    from zarrckpt._restore import plan
    # As on several processes: the leaf read is staged on a sharding cut at chunk
    # boundaries, then shared onto its target's; a leaf tied to it takes its target's.
    monkeypatch.setattr(plan, "held_by_several_processes", lambda sharding, shape: True)
    saved = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    zarrckpt.save_pytree(str(tmp_path / "c"), {"w": saved}, max_chunk_bytes=256, min_chunk_bytes=64)
    m = mesh((2, 4))
    replicated, rows = NamedSharding(m, P()), NamedSharding(m, P("x"))
    target = {"a": jax.ShapeDtypeStruct(saved.shape, jnp.float32, sharding=replicated),
              "b": jax.ShapeDtypeStruct(saved.shape, jnp.float32, sharding=rows)}
    restored = zarrckpt.load_pytree(str(tmp_path / "c"), target, rename=lambda name: "w")
    assert restored["a"].sharding == replicated and restored["b"].sharding == rows
    np.testing.assert_array_equal(np.asarray(restored["b"]), saved)


def test_a_fallback_leaf_that_is_a_donated_target_array_comes_back_alive(tmp_path):
    saved = save_v1(str(tmp_path / "v1"))
    m = mesh((2, 4))
    params = V1.init(jax.random.key(1), X)["params"]
    params = jax.device_put(params, shardings(params, m))
    own = jax.tree_util.tree_map(np.asarray, params)
    # v2 adds an EMA of the params, started as the params themselves (the same arrays)
    restored = zarrckpt.load_pytree(str(tmp_path / "v1"), {"params": params, "ema": params}, partial=True,
                                    fallback=True, donate_target=True)
    for kept, value in zip(jax.tree_util.tree_leaves(restored["ema"]), jax.tree_util.tree_leaves(own), strict=True):
        assert not kept.is_deleted()
        np.testing.assert_array_equal(np.asarray(kept), value)
    np.testing.assert_array_equal(np.asarray(restored["params"]["mlp"]["Dense_0"]["kernel"]),
                                  np.asarray(saved["params"]["mlp"]["Dense_0"]["kernel"]))


def test_a_rename_to_a_name_the_checkpoint_lacks_is_reported_in_the_targets_names(tmp_path):
    save_v1(str(tmp_path / "v1"))
    target = jax.eval_shape(lambda: {"params": V1.init(jax.random.key(0), X)["params"]})
    with pytest.raises(zarrckpt.CheckpointMismatchError) as info:
        zarrckpt.load_pytree(str(tmp_path / "v1"), target, rename=[(r"^params\.encoder\.", "params.enc.")],
                             partial=True)
    message = str(info.value)
    assert "params.encoder.proj.kernel (renamed to params.enc.proj.kernel): not in the checkpoint" in message
    with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"\['params'\]\['encoder'\]\['proj'\]\['bias'\]: "
                       r"not from the checkpoint \(rename gave None for it\)"):
        zarrckpt.load_pytree(str(tmp_path / "v1"), target, rename=lambda n: None if "encoder" in n else n,
                             partial=True)


def test_the_mismatch_report_shows_the_rename_that_maps_a_renamed_prefix_and_layers(tmp_path):
    saved = save_v1(str(tmp_path / "v1"))
    target = v2_target()
    with pytest.raises(zarrckpt.CheckpointMismatchError) as info:
        zarrckpt.load_pytree(str(tmp_path / "v1"), target, allow_dtype_cast=True)
    message = str(info.value)
    assert "differ by renamed path components: rename=[" in message
    assert r'(r"(^|\.)backbone\.", r"\1encoder.")' in message, message
    suggested = re.search(r"rename=(\[.*\]) finds (\d+) of the (\d+) target leaves", message)
    assert suggested.group(2) == suggested.group(3)
    restored = zarrckpt.load_pytree(str(tmp_path / "v1"), target, rename=eval(suggested.group(1)),
                                    allow_dtype_cast=True)
    assert_v2_holds_v1(restored, saved, target)


def test_the_rename_suggested_past_a_rename_given_is_said_to_apply_after_it(tmp_path):
    saved = save_v1(str(tmp_path / "v1"))
    target = v2_target()
    given = [(r"(^|\.)backbone\.", r"\1encoder."), (r"\.fc_in\.", ".Dense0."), (r"\.fc_out\.", ".Dense_1.")]
    with pytest.raises(zarrckpt.CheckpointMismatchError) as info:
        zarrckpt.load_pytree(str(tmp_path / "v1"), target, rename=given, allow_dtype_cast=True)
    message = str(info.value)
    assert "rename=[" not in message  # alone, the pairs suggested would undo the given ones
    suggested = re.search(r"the pairs (\[.*\]) applied after it find (\d+) of the (\d+) target leaves", message)
    assert suggested is not None, message
    assert suggested.group(2) == suggested.group(3)
    restored = zarrckpt.load_pytree(str(tmp_path / "v1"), target, rename=given + eval(suggested.group(1)),
                                    allow_dtype_cast=True)
    assert_v2_holds_v1(restored, saved, target)


def test_rename_is_checked_at_the_call_naming_the_bad_pair(tmp_path):
    save_v1(str(tmp_path / "v1"))
    url = str(tmp_path / "v1")
    with pytest.raises(TypeError, match=r"one pair \('a', 'b'\): put it in a list"):
        zarrckpt.load_pytree(url, None, rename=("a", "b"))
    with pytest.raises(ValueError, match=r"rename pair 1 \('\(', 'x'\): regex '\(' does not compile"):
        zarrckpt.load_pytree(url, None, rename=[("a", "b"), ("(", "x")])
    with pytest.raises(ValueError, match=r"rename pair 0 .*replacement '\\\\2' is invalid"):
        zarrckpt.load_pytree(url, None, rename=[("(a)", r"\2")])
    with pytest.raises(TypeError, match="rename pair 0 must be a"):
        zarrckpt.load_pytree(url, None, rename=[("a", 3)])
    with pytest.raises(TypeError, match="option fallback must be True or False"):
        zarrckpt.load_pytree(url, None, fallback=1)
    with pytest.raises(TypeError, match=r"rename returned 3 for step"):
        zarrckpt.load_pytree(url, {"step": 0}, rename=lambda name: 3, partial=True)


class NnxEncoder(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(8, 16, rngs=rngs)


class NnxV1(nnx.Module):
    def __init__(self, rngs):
        self.encoder = NnxEncoder(rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.encoder.proj(x)))


class NnxV2(nnx.Module):
    def __init__(self, rngs):
        self.backbone = NnxEncoder(rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.backbone.proj(x)))


def test_an_nnx_model_with_renamed_attributes_restores_through_rename(tmp_path):
    _, state = nnx.split(NnxV1(nnx.Rngs(0)))
    zarrckpt.save_pytree(str(tmp_path / "v1"), state)
    graphdef, fresh = nnx.split(NnxV2(nnx.Rngs(1)))
    m = mesh((4, 2))
    target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        m, P("x", "y") if a.ndim == 2 else P())), fresh)
    restored = zarrckpt.load_pytree(str(tmp_path / "v1"), target,
                                    rename=[(r"^backbone\.", "encoder."), (r"^out\.", "head.")])
    v2 = nnx.merge(graphdef, restored)
    v1 = NnxV1(nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(v2.backbone.proj.kernel[...]), np.asarray(v1.encoder.proj.kernel[...]))
    np.testing.assert_array_equal(np.asarray(v2.out.bias[...]), np.asarray(v1.head.bias[...]))
    assert v2.out.kernel[...].sharding == NamedSharding(m, P("x", "y"))
    np.testing.assert_allclose(np.asarray(v2(X)), np.asarray(v1(X)), rtol=1e-5)


def test_the_manager_and_load_checkpoint_take_rename_and_fallback(tmp_path):
    params = V1.init(jax.random.key(0), X)["params"]
    zarrckpt.save_checkpoint(str(tmp_path / "run"), 0, {"params": params})  # weights alone, as an import
    v2_params = V2.init(jax.random.key(1), X)["params"]
    target = {"params": v2_params, "opt_state": optax.adam(1e-3).init(v2_params)}
    with zarrckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        state, step = mgr.restore(target, rename=RENAME_V2, fallback=True)
    assert step == 0 and state["opt_state"] is not None
    np.testing.assert_array_equal(np.asarray(state["params"]["backbone"]["proj"]["kernel"]),
                                  np.asarray(params["encoder"]["proj"]["kernel"]))
    state = zarrckpt.load_checkpoint(str(tmp_path / "run"), 0, target, rename=v1_names, fallback=True)
    assert state["opt_state"][0].mu["backbone"]["proj"]["kernel"] is target["opt_state"][0].mu["backbone"]["proj"][
        "kernel"]
    state, step = zarrckpt.load_checkpoint_if_it_exists(str(tmp_path / "run"), target, rename=RENAME_V2,
                                                        fallback=True)
    assert step == 0


def test_a_restore_from_the_local_tier_takes_rename_and_fallback(tmp_path):
    persistent, local = str(tmp_path / "run"), str(tmp_path / "local")
    params = V1.init(jax.random.key(0), X)["params"]
    with zarrckpt.CheckpointManager(persistent, save_interval_steps=4, local_directory=local,
                                    local_save_interval_steps=3) as mgr:
        assert mgr.save(3, {"params": params})  # the local tier's only
    v2_params = V2.init(jax.random.key(1), X)["params"]
    head = jnp.arange(4.0)
    with zarrckpt.CheckpointManager(persistent, local_directory=local, local_save_interval_steps=3) as mgr:
        state, step = mgr.restore({"params": v2_params, "head": head}, rename=RENAME_V2, fallback=True)
        assert (step, mgr.restored_tier) == (3, "local")
    assert state["head"] is head
    np.testing.assert_array_equal(np.asarray(state["params"]["mlp"]["fc_out"]["kernel"]),
                                  np.asarray(params["mlp"]["Dense_1"]["kernel"]))


def test_a_save_after_a_renamed_restore_writes_the_values_restored_not_the_saved_leaf_of_that_name(tmp_path):
    run = str(tmp_path / "run")
    m = mesh((2, 4))
    a = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(m, P("x", "y")))
    b = jax.device_put(-jnp.arange(64.0).reshape(8, 8), NamedSharding(m, P("x", "y")))
    with zarrckpt.CheckpointManager(run) as mgr:
        mgr.save(1, {"a": a, "b": b})
    with zarrckpt.CheckpointManager(run) as mgr:
        swapped, _ = mgr.restore({"a": a, "b": b}, rename=lambda name: {"a": "b", "b": "a"}[name])
        mgr.save(2, swapped)
    again = zarrckpt.load_checkpoint(run, 2)
    np.testing.assert_array_equal(again["a"], np.asarray(b))
    np.testing.assert_array_equal(again["b"], np.asarray(a))


@pytest.mark.parametrize("asked", [{"rename": [(r"^a$", "b")]}, {"fallback": True}], ids=["rename", "fallback"])
def test_rename_and_fallback_without_a_target_are_refused_at_the_call_by_every_restore(tmp_path, asked):
    """Without a target every leaf is read as saved, under its own name: a rename or a
    fallback there would be silently ignored, so each restore refuses it, reading nothing."""
    zarrckpt.save_pytree(str(tmp_path / "one"), {"a": np.arange(3)})
    zarrckpt.save_checkpoint(str(tmp_path / "run"), 1, {"a": np.arange(3)})
    calls = [lambda: zarrckpt.load_pytree(str(tmp_path / "one"), None, **asked),
             lambda: zarrckpt.load_checkpoint(str(tmp_path / "run"), 1, None, **asked),
             lambda: zarrckpt.load_checkpoint_if_it_exists(str(tmp_path / "run"), None, **asked)]
    for call in calls:
        with pytest.raises(ValueError, match="rename= and fallback=True apply to a target's leaves"):
            call()
    with zarrckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        with pytest.raises(ValueError, match="pass a target"):
            mgr.restore(None, **asked)
