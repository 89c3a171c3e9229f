"""Step directories: committed-only listing, the seqax resume contract, overwrite rules."""

import json

import numpy as np
import pytest

import zarrckpt
from zarrckpt import _commit, _storage


def test_resume_contract(store):
    url, opts = store.url, store.options
    target = {"w": np.zeros(3), "step": 0}
    state, step = zarrckpt.load_checkpoint_if_it_exists(url, target, storage_options=opts)
    assert state is target and step == 0
    assert zarrckpt.all_steps(url, storage_options=opts) == []
    assert zarrckpt.latest_step(url, storage_options=opts) is None
    for s in (5, 10, 15):
        zarrckpt.save_checkpoint(url, s, {"w": np.full(3, float(s)), "step": s}, storage_options=opts)
    state, step = zarrckpt.load_checkpoint_if_it_exists(url, target, storage_options=opts)
    assert step == 15 and state["step"] == 15 and np.array_equal(state["w"], np.full(3, 15.0))
    assert zarrckpt.all_steps(url, storage_options=opts) == [5, 10, 15]


def test_uncommitted_steps_are_never_selected(store):
    url, opts = store.url, store.options
    zarrckpt.save_checkpoint(url, 1, {"w": np.ones(2)}, storage_options=opts)
    zarrckpt.save_checkpoint(url, 2, {"w": np.ones(2) * 2}, storage_options=opts)
    newest = _storage.resolve(url, opts).step(2)
    # Take the commit away, as a crash between writing data and committing would leave it.
    _commit.remove(newest.child("w"))
    group = json.loads(newest.read("zarr.json"))
    del group["attributes"]["write_completed"]
    newest.write("zarr.json", json.dumps(group).encode())
    assert zarrckpt.all_steps(url, storage_options=opts) == [1]
    assert zarrckpt.latest_step(url, storage_options=opts) == 1
    state, step = zarrckpt.load_checkpoint_if_it_exists(url, {"w": np.zeros(2)}, storage_options=opts)
    assert step == 1 and np.array_equal(state["w"], np.ones(2))
    zarrckpt.save_checkpoint(url, 2, {"w": np.ones(2) * 3}, storage_options=opts)  # the leftover is replaced
    assert zarrckpt.latest_step(url, storage_options=opts) == 2


def test_other_entries_are_ignored(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "12").mkdir()  # too short to be a step directory
    (tmp_path / "0000000007").mkdir()  # a step directory with nothing in it
    zarrckpt.save_checkpoint(str(tmp_path), 3, {"a": 1})
    assert zarrckpt.all_steps(str(tmp_path)) == [3]


def test_committed_step_is_not_overwritten_unless_asked(tmp_path):
    zarrckpt.save_checkpoint(str(tmp_path), 4, {"a": 1})
    with pytest.raises(zarrckpt.CheckpointExistsError, match="0000000004 already holds a committed checkpoint"):
        zarrckpt.save_checkpoint(str(tmp_path), 4, {"a": 2})
    assert zarrckpt.load_pytree(str(tmp_path / "0000000004"))["a"] == 1
    zarrckpt.save_checkpoint(str(tmp_path), 4, {"a": 2}, overwrite=True)
    assert zarrckpt.load_pytree(str(tmp_path / "0000000004"))["a"] == 2


def test_step_dir_names():
    assert _storage.resolve("/x").step(12).url == "/x/0000000012"
    assert _storage.resolve("memory://b/run/").step(10**11).url == "memory://b/run/100000000000"


def test_a_run_pointed_at_a_step_is_an_error_saying_what_to_pass(tmp_path):
    run = tmp_path / "run"
    zarrckpt.save_checkpoint(str(run), 60, {"w": np.ones(2)})
    step_url = str(run / "0000000060")
    calls = [lambda: zarrckpt.load_checkpoint_if_it_exists(step_url, {"w": np.zeros(2)}),
             lambda: zarrckpt.latest_step(step_url), lambda: zarrckpt.all_steps(step_url),
             lambda: zarrckpt.CheckpointManager(step_url)]
    for call in calls:
        with pytest.raises(zarrckpt.CheckpointLocationError,
                           match=f"{step_url} is a checkpoint itself \\(step 60 of {run}\\): pass the directory "
                                 f"that holds step directories \\({run}\\)"):
            call()


def test_a_run_pointed_at_orbax_checkpoints_is_an_error(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    import jax.numpy as jnp

    with ocp.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(60, args=ocp.args.StandardSave({"w": jnp.ones(2)}))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(str(tmp_path / "single"), {"w": jnp.ones(2)})
    checkpointer.wait_until_finished()
    with pytest.raises(zarrckpt.CheckpointLocationError, match="holds Orbax's checkpoints \\(steps 60\\), not "
                                                              "zarrckpt's .*0000000060"):
        zarrckpt.load_checkpoint_if_it_exists(str(tmp_path / "run"), {"w": np.zeros(2)})
    with pytest.raises(zarrckpt.CheckpointLocationError,
                       match="is a checkpoint of Orbax, not a directory of zarrckpt steps"):
        zarrckpt.CheckpointManager(str(tmp_path / "single"))


def test_starting_fresh_is_logged_and_visible(tmp_path, caplog):
    target = {"w": np.zeros(2), "step": 0}
    with caplog.at_level("WARNING", logger="zarrckpt"):
        state, step = zarrckpt.load_checkpoint_if_it_exists(str(tmp_path / "misspelled"), target)
        assert state is target and step == 0
        with zarrckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
            assert mgr.restored_step is None
            assert mgr.restore(target) == (target, 0) and mgr.restored_step is None
            mgr.save(0, target)  # step 0 saved: restoring it now is told apart from starting fresh
            mgr.wait()
            assert mgr.restore(target)[1] == 0 and mgr.restored_step == 0
    messages = [r.getMessage() for r in caplog.records]
    assert f"nothing to restore: {tmp_path}/misspelled does not exist; starting from the state given" in messages
    assert f"no committed checkpoint under {tmp_path}/run: starting from the state given" in messages


def test_a_restore_reads_the_group_metadata_once(tmp_path, monkeypatch):
    """At 10,000 leaves the group's zarr.json is about 5 MB: choosing the step, opening
    it and the final identity check read it whole once, and only its first bytes
    otherwise; so do listing and following the steps."""
    run = str(tmp_path / "run")
    leaves = {f"layer{i:04d}": np.full(4, float(i), np.float32) for i in range(1000)}
    for step in (1, 2):
        zarrckpt.save_checkpoint(run, step, leaves)
    reads = []
    original = _storage.Location.read

    def reading(loc, key, **options):
        if key == "zarr.json" and loc.path.endswith("0000000002"):
            reads.append(options.get("limit"))
        return original(loc, key, **options)

    monkeypatch.setattr(_storage.Location, "read", reading)
    restored, step = zarrckpt.load_checkpoint_if_it_exists(run, leaves)
    assert step == 2 and reads.count(None) == 1 and reads[-1] is not None  # the identity check: first bytes
    reads.clear()
    zarrckpt.load_checkpoint(run, 2, leaves)
    assert reads.count(None) == 1
    reads.clear()
    assert zarrckpt.all_steps(run) == [1, 2] and next(zarrckpt.checkpoints_iterator(run, timeout_s=0.01)) == 2
    assert reads and None not in reads  # listing and following read first bytes only
