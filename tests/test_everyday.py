"""Everyday workflows: safe defaults, options checked at the call, partial restore, str and
bytes and per-process leaves, and an evaluator following a training run."""

import json
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zarrckpt
from zarrckpt import _storage


def state(value=1.0):
    return {"params": {"w": jnp.full((4, 3), value), "b": jnp.zeros(3)},
            "opt_state": {"mu": jnp.ones((4, 3))}, "step": jnp.array(int(value))}


# -- safe, conventional defaults -------------------------------------------------


def test_metrics_straight_from_a_jitted_step(tmp_path):
    loss = jax.jit(lambda x: (x ** 2).mean())(jnp.arange(3.0))  # a jax scalar, as every loop has
    with zarrckpt.CheckpointManager(str(tmp_path), keep_best=1, best_metric="loss") as mgr:
        assert mgr.save(1, state(), metrics={"loss": loss, "acc": np.float32(0.5), "n": 3, "lr": np.array(1e-3),
                                             "nan": float("nan")})
        mgr.wait()
    meta = json.loads((tmp_path / "0000000001" / "zarr.json").read_text())["attributes"]["zarrckpt"]["metrics"]
    assert meta == {"loss": pytest.approx(5 / 3), "acc": 0.5, "n": 3, "lr": pytest.approx(1e-3), "nan": "NaN"}


@pytest.mark.parametrize("metric, message", [
    (jnp.ones(3), "metric 'loss' must be a real number"),
    ("0.5", "metric 'loss' must be a real number .* got str '0.5'"),
    (1 + 2j, "got complex"),
    (True, "got bool"),
])
def test_a_bad_metric_is_refused_by_save_and_the_next_save_works(tmp_path, metric, message):
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(TypeError, match=message):
            mgr.save(1, state(), metrics={"loss": metric})
        assert mgr.save(2, state(), metrics={"loss": 0.25})
    assert zarrckpt.all_steps(str(tmp_path)) == [2]


def test_no_policy_saves_at_every_call(tmp_path):
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert all(mgr.save(step, state(step)) for step in (1, 2, 3))
    assert zarrckpt.all_steps(str(tmp_path)) == [1, 2, 3]


@pytest.mark.parametrize("options, error, message", [
    ({"max_inflight_bytes": 2**20}, TypeError, "unexpected keyword argument 'max_inflight_bytes'"),
    ({"keep_last": 0}, ValueError, "option keep_last must be positive"),
    ({"keep_last": "3"}, TypeError, "option keep_last must be an int"),
    ({"async_save": "yes"}, TypeError, "option async_save must be True or False"),
    ({"max_staged_bytes": -1}, ValueError, "option max_staged_bytes must be positive"),
    ({"timeout_s": "60"}, TypeError, "option timeout_s must be a number"),
    ({"save_interval_steps": 2.5}, TypeError, "option save_interval_steps must be an int"),
    ({"storage_options": "anon"}, TypeError, "storage_options must be a dict"),
    ({"best_mode": "lowest"}, ValueError, "best_mode must be 'min' or 'max'"),
    ({"keep_best": 2}, ValueError, "keep_best needs best_metric"),
])
def test_manager_options_are_checked_at_construction(tmp_path, options, error, message):
    with pytest.raises(error, match=message):
        zarrckpt.CheckpointManager(str(tmp_path), **options)
    assert not any(tmp_path.iterdir())  # nothing was written, no lease left


def test_function_options_are_checked_at_the_call(tmp_path):
    url = str(tmp_path)
    with pytest.raises(TypeError, match=r"save_checkpoint\(\) got an unexpected keyword argument 'max_inflight_byte'"):
        zarrckpt.save_checkpoint(url, 1, state(), max_inflight_byte=10)
    with pytest.raises(TypeError, match="option max_chunk_bytes must be an int"):
        zarrckpt.save_checkpoint(url, 1, state(), max_chunk_bytes="64MiB")
    zarrckpt.save_checkpoint(url, 1, state())
    with pytest.raises(TypeError, match=r"load_checkpoint_if_it_exists\(\) got an unexpected keyword argument 'donate'"):
        zarrckpt.load_checkpoint_if_it_exists(url, state(), donate=True)
    with pytest.raises(TypeError, match="option partial must be True or False"):
        zarrckpt.load_checkpoint_if_it_exists(url, state(), partial="yes")
    with pytest.raises(TypeError, match="unexpected keyword argument 'partial_restore'"):
        zarrckpt.load_pytree(f"{url}/0000000001", state(), partial_restore=True)
    with zarrckpt.CheckpointManager(url) as mgr:
        with pytest.raises(TypeError, match=r"restore\(\) got an unexpected keyword argument 'strict'"):
            mgr.restore(state(), strict=False)
        with pytest.raises(ValueError, match="step must be a non-negative int, got -3"):
            mgr.save(-3, state())


def test_restore_with_a_step_where_the_target_goes_says_how(tmp_path):
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(5, state())
        with pytest.raises(TypeError, match=r"to restore step 5, call mgr.restore\(state, step=5\)"):
            mgr.restore(5)
        assert mgr.restore(state(0.0), step=5)[1] == 5


def test_restoring_into_aliases_of_live_arrays_keeps_them_alive(tmp_path):
    """eqx.filter(model, eqx.is_array) shares its arrays with the model: a restore into it
    must not free them unless asked."""
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, state(2.0))
    model = state(1.0)
    alias = jax.tree.map(lambda x: x, model)  # the same array objects
    back = zarrckpt.load_pytree(url, alias)
    assert float(back["params"]["w"][0, 0]) == 2.0
    assert float(model["params"]["w"][0, 0]) == 1.0  # still usable


def damage_one_chunk(url: str, name: str = "params.w") -> None:
    loc = _storage.resolve(url)
    key = next(k for k in (e.name for e in loc.walk()) if k.startswith(f"{name}/c"))
    data = bytearray(loc.read(key))
    data[0] ^= 0xFF
    loc.write(key, bytes(data))


def test_a_failed_restore_leaves_the_target_untouched_unless_donated(tmp_path):
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, state(2.0))
    damage_one_chunk(url)
    target = state(1.0)
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="fails its CRC-32C checksum"):
        zarrckpt.load_pytree(url, target)
    assert not any(x.is_deleted() for x in jax.tree.leaves(target))
    np.testing.assert_array_equal(target["params"]["w"], np.ones((4, 3)))
    # With donation the arrays read before the failure are gone, as documented.
    donated = state(1.0)
    with pytest.raises(zarrckpt.CheckpointCorruptError):
        zarrckpt.load_pytree(url, donated, donate_target=True)
    assert any(x.is_deleted() for x in jax.tree.leaves(donated))


@pytest.mark.parametrize("async_save", [True, False])
def test_wait_and_sync_saves_cover_retention(tmp_path, async_save):
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=2, async_save=async_save) as mgr:
        for step in range(1, 6):
            mgr.save(step, state(step))
            if not async_save:
                assert mgr.all_steps() == list(range(max(1, step - 1), step + 1))
        mgr.wait()
        assert mgr.all_steps() == [4, 5]


# -- partial restore --------------------------------------------------------------


def test_partial_restore_of_the_params_of_a_train_state(tmp_path):
    url = str(tmp_path)
    zarrckpt.save_checkpoint(url, 10, state(3.0))
    abstract = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state()["params"])}
    with pytest.raises(zarrckpt.CheckpointMismatchError) as info:
        zarrckpt.load_checkpoint_if_it_exists(url, abstract)
    assert "['opt_state']['mu']: in the checkpoint but not in the target" in str(info.value)
    assert "['step']: in the checkpoint but not in the target" in str(info.value)
    assert "pass partial=True" in str(info.value)
    reads = []
    original = _storage.Location.read_into
    try:
        _storage.Location.read_into = lambda self, key, *b: reads.append(key) or original(self, key, *b)
        params, step = zarrckpt.load_checkpoint_if_it_exists(url, abstract, partial=True)
    finally:
        _storage.Location.read_into = original
    assert step == 10 and set(params) == {"params"}
    assert float(params["params"]["w"][0, 0]) == 3.0
    assert all(key.startswith("params.") for key in reads), reads  # the rest is never read
    with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"\['params'\]\['extra'\]: in the target but not"):
        zarrckpt.load_checkpoint_if_it_exists(url, {"params": {**abstract["params"], "extra": jnp.ones(2)}},
                                              partial=True)


def test_fine_tuning_with_a_new_head(tmp_path):
    """Restore the backbone of a pretrained model, initialize a head of another shape."""
    pretrained = {"backbone": {"w": jnp.full((8, 8), 0.5)}, "head": {"w": jnp.ones((8, 10))}}
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(100, pretrained)
        fresh = {"backbone": {"w": jnp.zeros((8, 8))}, "head": {"w": jnp.zeros((8, 3))}}  # 3 classes now
        with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"shape \(8, 10\) in the checkpoint, \(8, 3\)"):
            mgr.restore(fresh)
        backbone, step = mgr.restore({"backbone": fresh["backbone"]}, partial=True)
    model = {**backbone, "head": fresh["head"]}
    assert step == 100 and float(model["backbone"]["w"][0, 0]) == 0.5 and model["head"]["w"].shape == (8, 3)


# -- more than arrays -------------------------------------------------------------


def test_str_and_bytes_leaves_round_trip(tmp_path):
    url = str(tmp_path / "c")
    tree = {"config": "model: tiny\nlr: 3e-4 ✓", "tokenizer": "", "blob": b"\x00\xffraw", "w": np.arange(3.0)}
    zarrckpt.save_pytree(url, tree)
    back = zarrckpt.load_pytree(url)
    assert back["config"] == tree["config"] and back["tokenizer"] == "" and back["blob"] == tree["blob"]
    target = {"config": "", "tokenizer": "", "blob": b"", "w": np.zeros(3)}
    back = zarrckpt.load_pytree(url, target)
    assert back["config"] == tree["config"] and back["blob"] == tree["blob"]
    described = zarrckpt.metadata(url)
    kinds = {leaf.key_path: leaf.kind for leaf in described.leaves}
    assert kinds["['config']"] == "str" and kinds["['blob']"] == "bytes"
    assert described.tree["config"] == "" and described.tree["blob"] == b""  # usable as a restore target
    with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"\['blob'\]: a str in the target, saved as bytes"):
        zarrckpt.load_pytree(url, {**target, "blob": ""})
    assert zarrckpt.verify(url).ok
    assert zarrckpt.metadata(url).format_version == 3  # older zarrckpt refuses it rather than misread it


def test_per_process_leaf_on_one_process(tmp_path):
    url = str(tmp_path)
    loader = {"epoch": 2, "next_index": 17, "seed": None}
    zarrckpt.save_checkpoint(url, 1, {"w": jnp.ones(2), "data": zarrckpt.PerProcess(loader),
                                      "raw": zarrckpt.PerProcess(b"\x01\x02"), "name": zarrckpt.PerProcess("h0")})
    back, _ = zarrckpt.load_checkpoint_if_it_exists(
        url, {"w": jnp.zeros(2), "data": zarrckpt.PerProcess(None), "raw": zarrckpt.PerProcess(None),
              "name": zarrckpt.PerProcess(None)})
    assert back["data"] == zarrckpt.PerProcess(loader)
    assert back["raw"].value == b"\x01\x02" and back["name"].value == "h0"
    assert zarrckpt.load_pytree(f"{url}/0000000001")["data"].value == loader
    assert zarrckpt.verify(f"{url}/0000000001").ok
    with pytest.raises(zarrckpt.UnsupportedLeafError, match=r"PerProcess leaf \['data'\]: its value must be JSON"):
        zarrckpt.save_checkpoint(url, 2, {"data": zarrckpt.PerProcess({"f": object()})})


def test_per_process_leaf_saved_by_another_process_count(tmp_path):
    url = tmp_path / "c"
    zarrckpt.save_pytree(str(url), {"data": zarrckpt.PerProcess([1, 2])})
    doc = json.loads((url / "zarr.json").read_text())  # as if saved by 4 processes
    doc["attributes"]["zarrckpt"]["tree"]["children"][0]["processes"] = 4
    (url / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(zarrckpt.CheckpointMismatchError,
                       match=re.escape("['data']: saved by 4 process(es), restored by 1")):
        zarrckpt.load_pytree(str(url), {"data": zarrckpt.PerProcess(None)})
    relaxed = zarrckpt.PerProcess({"start": 0}, strict=False)
    assert zarrckpt.load_pytree(str(url), {"data": relaxed})["data"] is relaxed


# -- an evaluator that follows training ---------------------------------------------


def test_checkpoints_iterator_follows_a_training_run(tmp_path):
    run = str(tmp_path)
    zarrckpt.save_checkpoint(run, 1, state(1.0))
    zarrckpt.save_checkpoint(run, 2, state(2.0))
    seen, values = [], []
    writer_may_go = threading.Event()

    def train():
        writer_may_go.wait(10)
        with zarrckpt.CheckpointManager(run, keep_last=2) as mgr:
            for step in (3, 4, 5, 6):
                mgr.save(step, state(float(step)))

    trainer = threading.Thread(target=train)
    trainer.start()
    for step in zarrckpt.checkpoints_iterator(run, timeout_s=3, poll_interval_s=0.05):
        seen.append(step)
        writer_may_go.set()
        try:
            back = zarrckpt.load_checkpoint(run, step, {"params": state()["params"]}, partial=True)
            values.append((step, float(back["params"]["w"][0, 0])))
        except zarrckpt.CheckpointNotFoundError:
            pass  # deleted by retention while being read: never a false alarm of damage
    trainer.join()
    assert seen[0] == 2  # the newest step at the start, then every later one still there
    assert seen == sorted(set(seen)) and set(seen) <= {2, 3, 4, 5, 6} and seen[-1] == 6
    assert all(step == value for step, value in values)


def test_checkpoints_iterator_start_after_and_timeout(tmp_path):
    run = str(tmp_path)
    for step in (1, 2, 3):
        zarrckpt.save_checkpoint(run, step, {"x": np.ones(1)})
    assert list(zarrckpt.checkpoints_iterator(run, start_after=1, timeout_s=0.1, poll_interval_s=0.02)) == [2, 3]
    assert list(zarrckpt.checkpoints_iterator(str(tmp_path / "none"), timeout_s=0.05, poll_interval_s=0.01)) == []
    with pytest.raises(ValueError, match="option poll_interval_s must be positive"):
        next(zarrckpt.checkpoints_iterator(run, poll_interval_s=0))


def test_a_read_that_loses_the_race_with_retention_is_not_found_not_corrupt(tmp_path, monkeypatch):
    run = str(tmp_path)
    zarrckpt.save_checkpoint(run, 1, state())
    original = _storage.Location.read_into
    step_dir = _storage.resolve(run).step(1)

    def delete_then_read(self, key, *buffers):
        if key.startswith("params.w/"):  # retention deletes the step, marker first, mid-read
            zarrckpt._commit.remove(step_dir)
        return original(self, key, *buffers)

    monkeypatch.setattr(_storage.Location, "read_into", delete_then_read)
    with pytest.raises(zarrckpt.CheckpointNotFoundError, match="was deleted while it was being read"):
        zarrckpt.load_checkpoint(run, 1, state())


def test_an_evaluator_needs_no_manager(tmp_path):
    run = str(tmp_path)
    with zarrckpt.CheckpointManager(run, heartbeat_s=0.05) as mgr:
        mgr.save(1, state(4.0))
        mgr.wait()
        # While training holds the directory, readers use the functions.
        assert zarrckpt.latest_step(run) == 1
        back, step = zarrckpt.load_checkpoint_if_it_exists(run, state())
        assert step == 1 and float(back["params"]["w"][0, 0]) == 4.0
        with pytest.raises(zarrckpt.DirectoryInUseError):
            zarrckpt.CheckpointManager(run, heartbeat_s=0.05)


def test_every_public_call_spells_out_its_options():
    """What help() and an IDE show: no **options anywhere in the public API."""
    import inspect

    calls = [getattr(zarrckpt, name) for name in zarrckpt.__all__ if callable(getattr(zarrckpt, name))]
    calls += [getattr(zarrckpt.CheckpointManager, name) for name in dir(zarrckpt.CheckpointManager)
              if not name.startswith("_") and callable(getattr(zarrckpt.CheckpointManager, name))]
    for call in calls:
        if inspect.isclass(call) and issubclass(call, BaseException):
            continue
        kinds = {p.kind for p in inspect.signature(call).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, call
