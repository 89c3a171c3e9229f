"""`import_checkpoint` / `zarrckpt import`: Orbax runs (written by orbax-checkpoint
itself) and Hugging Face safetensors sets become committed zarrckpt checkpoints that a
manager resumes from, read a chunk at a time; sources that are neither, or damaged,
are refused naming what is wrong."""

from __future__ import annotations

import json
import sys
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from builders import mesh
from jax.sharding import NamedSharding, PartitionSpec as P
from test_cli import run
from test_safetensors import assert_exact, at, sharded_set, tensors

import zarrckpt
from zarrckpt._format import naming as _naming


def train_state(step: int) -> dict:
    """A training state as an optax loop keeps it, sharded over a 2x4 mesh, with values
    that differ per step and per element."""
    m = mesh()
    params = {"dense": {"kernel": jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) / 7 + step,
                        "bias": (jnp.arange(32) * step).astype(jnp.bfloat16)},
              "embed": jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) - step}
    params = {"dense": {"kernel": jax.device_put(params["dense"]["kernel"], NamedSharding(m, P("data", "model"))),
                        "bias": jax.device_put(params["dense"]["bias"], NamedSharding(m, P("model")))},
              "embed": jax.device_put(params["embed"], NamedSharding(m, P(None, "model")))}
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda x: x * 0.5, params)
    _, opt_state = opt.update(grads, opt_state, params)
    return {"params": params, "opt_state": opt_state, "step": step, "rng": jax.random.key(step),
            "legacy_rng": jax.random.PRNGKey(step), "lr": 0.5 / (step + 1)}


def zeros_like(state: dict) -> dict:
    """A restore target: the state's structure and shardings, other values."""
    return jax.tree.map(lambda x: jnp.zeros_like(x) if isinstance(x, jax.Array) and x.dtype != jax.random.key(0).dtype
                        else x, state) | {"step": 0, "lr": 0.0, "rng": jax.random.key(99)}


def orbax_run(path: Path, steps: list[int]) -> dict[int, dict]:
    """An Orbax CheckpointManager run with `steps`; the states saved, by step."""
    states = {}
    with ocp.CheckpointManager(str(path)) as mgr:
        for step in steps:
            states[step] = train_state(step)
            mgr.save(step, args=ocp.args.StandardSave(states[step]))
        mgr.wait_until_finished()
    return states


def assert_same_state(got: dict, want: dict) -> None:
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    assert got_def == want_def
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        where = jax.tree_util.keystr(path)
        assert type(g) is type(w), where
        if isinstance(w, jax.Array):
            if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
                assert g.dtype == w.dtype, where
                g, w = jax.random.key_data(g), jax.random.key_data(w)
            assert g.sharding == w.sharding, where
            assert g.dtype == w.dtype and np.asarray(g).tobytes() == np.asarray(w).tobytes(), where
        else:
            assert g == w, where


def test_an_orbax_run_is_resumed_by_a_manager_at_its_newest_step_with_orbaxs_values(tmp_path):
    states = orbax_run(tmp_path / "orbax", [100, 200])
    with ocp.CheckpointManager(str(tmp_path / "orbax")) as mgr:
        orbax_restored = mgr.restore(200, args=ocp.args.StandardRestore(zeros_like(states[200])))

    result = zarrckpt.import_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "run"))
    assert (result.step, result.format, result.url) == (200, "orbax", str(tmp_path / "run" / "0000000200"))
    with zarrckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        state, step = mgr.restore(zeros_like(states[200]))
        assert step == 200 and mgr.restored_step == 200
    assert_same_state(state, states[200])
    assert_same_state(orbax_restored, states[200])  # the values are Orbax's own
    # The chunks are Orbax's (a shard, or a replica's slice of one): each is read once.
    chunks = {leaf.name: leaf.chunks for leaf in zarrckpt.metadata(result.url).leaves}
    assert chunks["params.dense.kernel"] == (32, 8) and chunks["params.embed"] == (8, 2)


def test_the_cli_imports_a_chosen_step_and_refuses_to_replace_one(tmp_path):
    states = orbax_run(tmp_path / "orbax", [100, 200])
    imported = run("import", str(tmp_path / "orbax"), str(tmp_path / "run"), "--step", "100")
    assert imported.returncode == 0, imported.stderr
    assert str(tmp_path / "run" / "0000000100") in imported.stdout
    assert zarrckpt.all_steps(str(tmp_path / "run")) == [100]
    state, step = zarrckpt.load_checkpoint_if_it_exists(str(tmp_path / "run"), zeros_like(states[100]))
    assert step == 100
    assert_same_state(state, states[100])

    again = run("import", str(tmp_path / "orbax"), str(tmp_path / "run"), "--step", "100")
    assert again.returncode == 1 and "--overwrite" in again.stderr
    missing = run("import", str(tmp_path / "orbax"), str(tmp_path / "run"), "--step", "150")
    assert missing.returncode == 1 and "no finished step 150" in missing.stderr and "100, 200" in missing.stderr


def test_an_orbax_directory_is_an_error_naming_import(tmp_path):
    orbax_run(tmp_path / "orbax", [7])
    listed = run("ls", str(tmp_path / "orbax"))
    assert listed.returncode == 1 and f"zarrckpt import {tmp_path / 'orbax'}" in listed.stderr
    for url in (tmp_path / "orbax", tmp_path / "orbax" / "7"):
        with pytest.raises(zarrckpt.CheckpointLocationError, match="zarrckpt import"):
            zarrckpt.CheckpointManager(str(url))


def test_an_orbax_item_keeps_scalars_strings_empty_nodes_and_keys(tmp_path):
    tree = {"b": True, "i": 3, "f": 1.5, "np32": np.float32(2.5), "s": "hello", "none": None, "empty": {},
            "nothing": [], "pair": (jnp.ones(3), jnp.arange(4)), "key": jax.random.key(3),
            "half": jnp.arange(6, dtype=jnp.bfloat16)}
    checkpointer = ocp.PyTreeCheckpointer()
    checkpointer.save(str(tmp_path / "item"), tree)
    result = zarrckpt.import_checkpoint(str(tmp_path / "item"), str(tmp_path / "imported"))
    assert result.step is None and result.url == str(tmp_path / "imported")
    back = zarrckpt.load_pytree(str(tmp_path / "imported"))
    assert {k: back[k] for k in ("b", "i", "f", "s", "none", "empty", "nothing")} == {
        "b": True, "i": 3, "f": 1.5, "s": "hello", "none": None, "empty": {}, "nothing": []}
    assert type(back["i"]) is int and type(back["b"]) is bool and type(back["f"]) is float
    assert back["np32"] == np.float32(2.5) and back["np32"].dtype == np.float32
    assert jax.random.key_impl(back["key"]) == jax.random.key_impl(tree["key"])
    assert np.array_equal(jax.random.key_data(back["key"]), jax.random.key_data(tree["key"]))
    assert [np.asarray(x).tolist() for x in back["pair"]] == [[1, 1, 1], [0, 1, 2, 3]]
    assert back["half"].dtype == ml_dtypes.bfloat16 and back["half"].tolist() == list(range(6))


def test_a_step_of_several_items_is_a_dict_of_them_and_other_items_are_left_out(tmp_path):
    with ocp.CheckpointManager(str(tmp_path / "orbax"), item_names=("params", "extra", "notes")) as mgr:
        mgr.save(5, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": jnp.arange(4.0)}),
                                            extra=ocp.args.StandardSave({"n": jnp.ones(2)}),
                                            notes=ocp.args.JsonSave({"run": "a"})))
        mgr.wait_until_finished()
    result = zarrckpt.import_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "run"))
    assert result.skipped.keys() == {"notes"}
    back = zarrckpt.load_pytree(result.url)
    assert sorted(back) == ["extra", "params"] and back["params"]["w"].tolist() == [0, 1, 2, 3]


def test_a_sharded_safetensors_set_is_imported_and_lands_on_a_mesh(tmp_path):
    every = tensors()
    sharded_set(tmp_path / "hf", every)
    result = zarrckpt.import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "run"), step=0)
    assert (result.format, result.step, result.leaves) == ("safetensors", 0, len(every))
    back = zarrckpt.load_pytree(result.url)
    for name, want in every.items():
        assert_exact(at(back, name), want, name)
    sharding = NamedSharding(mesh(), P("data", "model"))
    target = {"model": {"embed_tokens": {"weight": jax.ShapeDtypeStruct((64, 16), ml_dtypes.bfloat16,
                                                                         sharding=sharding)}}}
    state, step = zarrckpt.load_checkpoint_if_it_exists(str(tmp_path / "run"), target, partial=True)
    assert step == 0 and state["model"]["embed_tokens"]["weight"].sharding == sharding
    assert_exact(state["model"]["embed_tokens"]["weight"], every["model.embed_tokens.weight"], "embed")


def test_an_import_holds_about_its_byte_budget_not_the_whole_state(tmp_path):
    rng = np.random.default_rng(1)
    every = {f"layers.{i}.weight": rng.standard_normal((512, 1024), np.float32) for i in range(32)}  # 64 MiB
    safetensors.numpy.save_file(every, str(tmp_path / "model.safetensors"))
    del every
    budget = 4 * 2**20  # two tensors
    tracemalloc.start()
    try:
        zarrckpt.import_checkpoint(str(tmp_path / "model.safetensors"), str(tmp_path / "run"),
                                           max_inflight_bytes=budget)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The budget's chunks (measured: 1.09x it), never the 64 MiB.
    assert peak < 1.5 * budget, peak
    back = zarrckpt.load_pytree(str(tmp_path / "run"))
    assert back["layers"]["31"]["weight"].shape == (512, 1024)


def test_what_is_no_checkpoint_of_either_format_is_refused_naming_it(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="neither an Orbax checkpoint nor a safetensors"):
        zarrckpt.import_checkpoint(str(tmp_path / "notes"), str(tmp_path / "run"))
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="does not exist"):
        zarrckpt.import_checkpoint(str(tmp_path / "nowhere"), str(tmp_path / "run"))
    with pytest.raises(ValueError, match="step"):
        zarrckpt.import_checkpoint(str(tmp_path / "notes"), str(tmp_path / "run"), step=-1)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("damage", ["not json", "no tree", "bad key", "unknown kind", "deep", "missing array"])
def test_damaged_orbax_metadata_is_refused_naming_the_file(tmp_path, damage):
    checkpointer = ocp.PyTreeCheckpointer()
    checkpointer.save(str(tmp_path / "item"), {"a": {"w": jnp.arange(4.0)}, "b": jnp.ones(2)})
    meta_path = tmp_path / "item" / "_METADATA"
    meta = json.loads(meta_path.read_text())
    entries = meta["tree_metadata"]
    entry = entries["('a', 'w')"]
    if damage == "not json":
        meta_path.write_text("{")
    else:
        if damage == "no tree":
            meta["tree_metadata"] = []
        elif damage == "bad key":
            entry["key_metadata"][0] = {"key": 5, "key_type": 9}
        elif damage == "unknown kind":
            entry["value_metadata"]["value_type"] = "custom.Thing"
        elif damage == "deep":
            entry["key_metadata"] = [{"key": "x", "key_type": 2}] * 10_000
        elif damage == "missing array":
            entry["key_metadata"][-1]["key"] = "absent"
        meta_path.write_text(json.dumps(meta))
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="_METADATA|array a.absent"):
        zarrckpt.import_checkpoint(str(tmp_path / "item"), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_without_tensorstore_an_orbax_import_says_which_extra_to_install(tmp_path, monkeypatch):
    ocp.PyTreeCheckpointer().save(str(tmp_path / "item"), {"w": jnp.ones(2)})
    monkeypatch.setitem(sys.modules, "tensorstore", None)
    with pytest.raises(ModuleNotFoundError, match=r"zarrckpt\[orbax\]"):
        zarrckpt.import_checkpoint(str(tmp_path / "item"), str(tmp_path / "run"))


def test_the_step_directory_name_is_the_managers(tmp_path):
    orbax_run(tmp_path / "orbax", [3])
    result = zarrckpt.import_checkpoint(str(tmp_path / "orbax" / "3"), str(tmp_path / "run"))
    assert Path(result.url).name == _naming.step_dir_name(3) and result.step == 3
