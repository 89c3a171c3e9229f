"""`import_checkpoint` / `zarrckpt import`: Orbax runs (written by orbax-checkpoint
itself) and Hugging Face safetensors sets become committed zarrckpt checkpoints that a
manager resumes from, read a chunk at a time; sources that are neither, or damaged,
are refused naming what is wrong."""

from __future__ import annotations

import itertools
import json
import logging
import sys
import tracemalloc
from pathlib import Path

import fsspec
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
from zarrckpt import _storage
from zarrckpt._foreign import orbax as _orbax
from zarrckpt._format import naming as _naming, tree as _tree
from zarrckpt._run import retention as _retention


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
    # Orbax's chunks (shards of 1 KiB and less) are put together, whole: one object per leaf.
    assert {leaf.chunks == leaf.shape for leaf in zarrckpt.metadata(result.url).leaves} == {True}


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


@pytest.mark.parametrize("items", [("params", "extra", "notes"), ("state", "notes")])
def test_a_step_of_named_items_is_a_dict_of_them_and_json_items_are_their_text(tmp_path, items):
    saved = {"params": ocp.args.StandardSave({"w": jnp.arange(4.0)}),
             "extra": ocp.args.StandardSave({"n": jnp.ones(2)}),
             "state": ocp.args.StandardSave({"s": jnp.zeros(3)}), "notes": ocp.args.JsonSave({"run": "a"})}
    with ocp.CheckpointManager(str(tmp_path / "orbax"), item_names=items) as mgr:
        mgr.save(5, args=ocp.args.Composite(**{name: saved[name] for name in items}))
        mgr.wait_until_finished()
    result = zarrckpt.import_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "run"))
    assert result.skipped == {}
    back = zarrckpt.load_pytree(result.url)
    assert sorted(back) == sorted(items)  # by name, even where one item is left
    assert json.loads(back["notes"]) == {"run": "a"}
    assert back["params"]["w"].tolist() == [0, 1, 2, 3] if "params" in items else back["state"]["s"].tolist() == [0] * 3


def test_a_step_orbax_is_still_writing_on_an_object_store_is_not_taken_for_finished(tmp_path):
    orbax_run(tmp_path / "orbax", [100, 200])
    fs = fsspec.filesystem("memory")
    url = f"memory://zarrckpt-tests/{tmp_path.name}/orbax"
    for path in (tmp_path / "orbax").rglob("*"):
        if path.is_file() and not (path.name == "commit_success.txt" and path.parent.name == "200"):
            fs.pipe_file(f"{url}/{path.relative_to(tmp_path / 'orbax')}", path.read_bytes())
    # Step 200 as Orbax leaves it on GCS until its last write: _CHECKPOINT_METADATA but
    # no commit_success.txt. Its newest finished step is 100.
    assert _orbax.find(zarrckpt._storage.resolve(url)).newest == 100
    assert _orbax.find(zarrckpt._storage.resolve(str(tmp_path / "orbax"))).newest == 200


def test_ls_of_a_directory_of_plain_numbered_directories_is_no_error(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    listed = run("ls", str(tmp_path))
    assert listed.returncode == 0 and "no step directories" in listed.stdout


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


def damaged_item(tmp_path: Path, damage: str, ocdbt: bool = True) -> None:
    """An Orbax item of `{"a": {"w": ...}, "b": ..., "l": [...], "key": typed keys}`, then
    `damage` done to its metadata."""
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)
    ocp.Checkpointer(handler).save(str(tmp_path / "item"), {"a": {"w": jnp.arange(4.0)}, "b": jnp.ones(2),
                                                           "l": [jnp.ones(1), jnp.ones(1)], "key": jax.random.key(1)})
    meta_path, impls_path = tmp_path / "item" / "_METADATA", tmp_path / "item" / "array_metadatas" / "process_0"
    meta, impls = json.loads(meta_path.read_text()), json.loads(impls_path.read_text())
    entry = meta["tree_metadata"]["('a', 'w')"]
    key_impl = next(e["array_metadata"] for e in impls["array_metadatas"] if e["array_metadata"]["param_name"] == "key")
    if damage == "not json":
        meta_path.write_text("{")
        return
    if damage == "no tree":
        meta["tree_metadata"] = []
    elif damage == "bad key":
        entry["key_metadata"][0] = {"key": 5, "key_type": 9}
    elif damage == "deep":
        entry["key_metadata"] = [{"key": "x", "key_type": 2}] * 10_000
    elif damage == "index 01":
        meta["tree_metadata"]["('l', '1')"]["key_metadata"][1]["key"] = "01"
    elif damage == "a path outside":
        entry["key_metadata"][-1]["key"] = ".."
    elif damage == "missing array":
        entry["key_metadata"][-1]["key"] = "absent"
    elif damage == "unknown PRNG":
        key_impl["ext_metadata"]["random_key_impl"] = "bogus"
    elif damage == "PRNG on floats":
        next(e["array_metadata"] for e in impls["array_metadatas"]
             if e["array_metadata"]["param_name"] == "b")["ext_metadata"] = {"random_key_impl": "threefry2x32"}
    meta_path.write_text(json.dumps(meta))
    impls_path.write_text(json.dumps(impls))


@pytest.mark.parametrize("damage, where", [
    ("not json", "_METADATA"), ("no tree", "_METADATA"), ("bad key", "_METADATA"), ("deep", "_METADATA"),
    ("index 01", "_METADATA"), ("missing array", "array a.absent"), ("unknown PRNG", "array_metadatas/process_0"),
    ("PRNG on floats", "array_metadatas/process_0")])
def test_damaged_orbax_metadata_is_refused_naming_the_file_before_anything_is_written(tmp_path, damage, where):
    damaged_item(tmp_path, damage)
    with pytest.raises(zarrckpt.CheckpointCorruptError, match=where):
        zarrckpt.import_checkpoint(str(tmp_path / "item"), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_without_ocdbt_a_key_never_names_a_path_outside_the_item(tmp_path):
    damaged_item(tmp_path, "none", ocdbt=False)
    back = zarrckpt.load_pytree(zarrckpt.import_checkpoint(str(tmp_path / "item"), str(tmp_path / "ok")).url)
    assert back["a"]["w"].tolist() == [0, 1, 2, 3]  # one directory per array, read as well
    damaged_item(tmp_path / "bad", "a path outside", ocdbt=False)
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="malformed key"):
        zarrckpt.import_checkpoint(str(tmp_path / "bad" / "item"), str(tmp_path / "run"))


def test_an_unknown_kind_of_leaf_is_unsupported_and_rich_empty_nodes_are_none(tmp_path):
    damaged_item(tmp_path, "none")
    meta_path = tmp_path / "item" / "_METADATA"
    meta = json.loads(meta_path.read_text())
    meta["tree_metadata"]["('e',)"] = {"key_metadata": [{"key": "e", "key_type": 2}],
                                       "value_metadata": {"value_type": "NamedTuple", "skip_deserialize": True}}
    meta_path.write_text(json.dumps(meta))
    assert zarrckpt.load_pytree(zarrckpt.import_checkpoint(str(tmp_path / "item"), str(tmp_path / "ok")).url)["e"] \
        is None  # optax's EmptyState, as Orbax's rich metadata names it
    meta["tree_metadata"]["('e',)"]["value_metadata"]["value_type"] = "custom.Thing"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(zarrckpt.UnsupportedLeafError, match="'custom.Thing'"):
        zarrckpt.import_checkpoint(str(tmp_path / "item"), str(tmp_path / "run"))


def test_each_source_chunk_is_read_once_whether_cut_up_or_put_together(tmp_path):
    source = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    for chunks, max_bytes, min_bytes, stored in [((16, 8), 128, 1, (4, 8)),  # each source chunk cut in 4
                                                 ((4, 4), 2**20, 256, (8, 8))]:  # 4 source chunks together
        reads = []

        def read(box, reads=reads):
            reads.append(box)
            return source[tuple(slice(a, b) for a, b in box)]

        leaf = _tree.Deferred(source.shape, source.dtype, read, chunks=chunks)
        url = str(tmp_path / f"{chunks}")
        zarrckpt.save_pytree(url, {"a": leaf}, max_chunk_bytes=max_bytes, min_chunk_bytes=min_bytes)
        assert zarrckpt.metadata(url).leaves[0].chunks == stored
        assert np.array_equal(zarrckpt.load_pytree(url)["a"], source)
        covered = np.zeros(source.shape, int)
        for box in reads:
            covered[tuple(slice(a, b) for a, b in box)] += 1
        assert (covered == 1).all(), covered  # every element read once
        assert all(all(a % c == 0 for (a, _), c in zip(box, chunks)) for box in reads)  # whole source chunks


def test_a_source_that_cannot_be_read_is_that_error_and_nothing_is_committed(tmp_path):
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False)  # one file per chunk: a chunk alone can be cut
    ocp.Checkpointer(handler).save(str(tmp_path / "item"), {"w": jnp.arange(1024.0 * 64).reshape(64, 1024)})
    chunk = next(p for p in (tmp_path / "item" / "w").iterdir() if not p.name.startswith("."))
    chunk.write_bytes(chunk.read_bytes()[:100])
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="nothing was committed"):
        zarrckpt.import_checkpoint(str(tmp_path / "item"), str(tmp_path / "run"))
    assert zarrckpt.latest_step(str(tmp_path)) is None and not zarrckpt.all_steps(str(tmp_path))
    with pytest.raises(zarrckpt.CheckpointNotFoundError):
        zarrckpt.load_pytree(str(tmp_path / "run"))


def test_without_tensorstore_an_orbax_import_says_which_extra_to_install(tmp_path, monkeypatch):
    ocp.PyTreeCheckpointer().save(str(tmp_path / "item"), {"w": jnp.ones(2)})
    monkeypatch.setitem(sys.modules, "tensorstore", None)
    with pytest.raises(ModuleNotFoundError, match=r"zarrckpt\[orbax\]"):
        zarrckpt.import_checkpoint(str(tmp_path / "item"), str(tmp_path / "run"))


def test_the_step_directory_name_is_the_managers(tmp_path):
    orbax_run(tmp_path / "orbax", [3])
    result = zarrckpt.import_checkpoint(str(tmp_path / "orbax" / "3"), str(tmp_path / "run"))
    assert Path(result.url).name == _naming.step_dir_name(3) and result.step == 3


def test_weights_imported_as_step_0_under_a_prefix_survive_a_fine_tunes_retention(tmp_path):
    """The README's recipe: `--step 0 --prefix params` puts the weights where a training
    state keeps them, pinned, so keep_last never deletes what the run started from."""
    src = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"model.w": np.arange(6, dtype=np.float32)}, str(src))
    result = zarrckpt.import_checkpoint(str(src), str(tmp_path / "ft"), step=0, prefix="params")
    assert result.step == 0
    with zarrckpt.CheckpointManager(str(tmp_path / "ft"), keep_last=1) as mgr:
        weights, _ = mgr.restore({"params": {"model": {"w": np.zeros(6, np.float32)}}})
        for step in (1, 2):
            mgr.save(step, {"params": weights["params"], "opt_state": {"count": np.int32(step)}})
    assert zarrckpt.all_steps(str(tmp_path / "ft")) == [0, 2]
    assert weights["params"]["model"]["w"].tolist() == list(range(6))
    for bad in ("", "params.", ".params", 3):
        with pytest.raises(ValueError, match="prefix must be a dotted key path"):
            zarrckpt.import_checkpoint(str(src), str(tmp_path / "bad"), prefix=bad)


def test_safetensors_with_a_tensor_named_like_the_pin_file_import_unpinned_with_a_warning(tmp_path, caplog):
    """A top-level tensor named PINNED takes the pin file's place in the step: the import
    commits, says the step is not pinned (result, log) rather than failing after its
    commit, and the step restores exactly."""
    src = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"PINNED": np.arange(4, dtype=np.float32), "w": np.ones(2, np.float32)}, str(src))
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        result = zarrckpt.import_checkpoint(str(src), str(tmp_path / "ft"), step=0)
    assert not result.pinned
    assert any(record.levelno == logging.WARNING and result.url in record.getMessage()
               and _retention.PIN_FILE in record.getMessage() for record in caplog.records)
    restored = zarrckpt.load_pytree(str(tmp_path / "ft" / _naming.step_dir_name(0)))
    np.testing.assert_array_equal(restored["PINNED"], np.arange(4, dtype=np.float32))
    assert not _retention.is_pinned(_storage.resolve(str(tmp_path / "ft")).step(0))
    pinned = zarrckpt.import_checkpoint(str(src), str(tmp_path / "ft2"), step=0, prefix="params")
    assert pinned.pinned


def test_the_destinations_storage_options_are_dst_storage_options_and_the_old_name_still_works(tmp_path):
    """`import_checkpoint` names the destination's options as `copy_checkpoint` does;
    `storage_options`, the name before, works with a DeprecationWarning, and both at
    once is an error naming them."""
    import warnings

    from safetensors.numpy import save_file

    save_file({"w": np.arange(6, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    src = str(tmp_path / "model.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zarrckpt.import_checkpoint(src, "memory://imported/new", dst_storage_options={})
    with pytest.warns(DeprecationWarning, match="dst_storage_options"):
        zarrckpt.import_checkpoint(src, "memory://imported/old", storage_options={})
    for url in ("memory://imported/new", "memory://imported/old"):
        np.testing.assert_array_equal(zarrckpt.load_pytree(url)["w"], np.arange(6, dtype=np.float32))
    with pytest.raises(TypeError, match="dst_storage_options.*storage_options"):
        zarrckpt.import_checkpoint(src, "memory://imported/both", storage_options={}, dst_storage_options={})
    with pytest.raises(ValueError, match="dst_storage_options"):
        zarrckpt.import_checkpoint(src, str(tmp_path / "local"), dst_storage_options={"anon": True})


@pytest.mark.parametrize("change", ["cut", "removed"])
def test_a_source_damaged_while_it_is_imported_is_the_sources_error_not_a_write_error(tmp_path, monkeypatch, change):
    """A safetensors file cut short or removed after its header was checked, while its
    tensors are written: the import raises the damage the source read met
    (CheckpointCorruptError naming the file), not a write error, and commits nothing."""
    from zarrckpt import _import

    src = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"a": np.ones(64, np.float32), "b": np.ones(2**16, np.float32)}, str(src))
    checked = _import._check_claims

    def then_damaged(*args, **kwargs):  # every check has passed: the writers read next
        checked(*args, **kwargs)
        if change == "cut":
            src.write_bytes(src.read_bytes()[:-1000])
        else:
            src.unlink()

    monkeypatch.setattr(_import, "_check_claims", then_damaged)
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="model.safetensors") as info:
        zarrckpt.import_checkpoint(str(src), str(tmp_path / "imported"))
    assert not isinstance(info.value, zarrckpt.CheckpointWriteError)
    with pytest.raises(zarrckpt.CheckpointNotFoundError):  # nothing committed there
        zarrckpt.load_pytree(str(tmp_path / "imported"))


def test_a_write_that_fails_while_the_source_is_read_is_the_imports_error(s3_server, monkeypatch):
    """The destination refuses a chunk (a 403 on its first PUT) while other writers'
    reads of the source are waiting to try again after a 503: those reads stop because
    the import already failed, which is no fault of the source; the import raises the
    write error, nothing committed."""
    from fault_proxy import Answer, FaultProxy

    monkeypatch.setattr(zarrckpt._storage.guard, "_FIRST_BACKOFF_S", 0.001)  # the order is tested, not the pace
    monkeypatch.setattr(zarrckpt._storage.guard, "_FIRST_THROTTLED_BACKOFF_S", 0.05)
    proxy = FaultProxy(s3_server.endpoint, "s3")
    try:
        bucket = s3_server.new_bucket()
        options = {**s3_server.options(), "endpoint_url": proxy.endpoint}
        src = f"s3://{bucket}/model.safetensors"
        with fsspec.open(src, "wb", **s3_server.options()) as f:
            f.write(safetensors.numpy.save({f"t{i}": np.full(2**14, i, np.float32) for i in range(32)}))
        refused: list[str] = []  # the first chunk written, refused at every try
        reads = itertools.count()

        def fault(kind, method, target, body):
            if kind == "ranged" and "model.safetensors" in target and next(reads) % 2:
                return Answer(503)  # every other source read: tried again after a wait, then answered
            if kind == "write" and "/imported/" in target and "zarr.json" not in target:
                refused[:] = refused or [target]
                return Answer(403) if target == refused[0] else None
            return None

        proxy.fault = fault
        with pytest.raises(zarrckpt.CheckpointWriteError, match="403|denied"):
            zarrckpt.import_checkpoint(src, f"s3://{bucket}/imported", src_storage_options=options,
                                       dst_storage_options=options, max_inflight_bytes=2**16)
        with pytest.raises(zarrckpt.CheckpointNotFoundError):
            zarrckpt.load_pytree(f"s3://{bucket}/imported", storage_options=s3_server.options())
    finally:
        proxy.stop()
