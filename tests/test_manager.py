"""CheckpointManager: save policies, async snapshots, background errors, retention."""

import functools
import json
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import mesh, train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import zarrckpt
import zarrckpt._util.concurrency
import zarrckpt._util.progress
from zarrckpt import _commit, _manager, _storage
from zarrckpt._run import retention as _retention
from zarrckpt._save import plan as _planning, transfer as _transfer


def small_state(value=0.0):
    value = float(value)
    return {"w": jax.device_put(jnp.full((8, 16), value), NamedSharding(mesh(names=("a", "b")), P("a", "b"))),
            "step": jnp.array(int(value), jnp.int32), "host": np.full(3, value)}


def test_interval_steps_and_force(tmp_path):
    with zarrckpt.CheckpointManager(str(tmp_path), save_interval_steps=5) as mgr:
        saved = [s for s in range(1, 13) if mgr.save(s, small_state(s))]
        assert mgr.save(13, small_state(13), force=True)
        assert not mgr.save(10, small_state(10))  # already committed: never saved twice
    assert saved == [5, 10]
    assert zarrckpt.all_steps(str(tmp_path)) == [5, 10, 13]


def test_interval_seconds(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(_manager.time, "monotonic", lambda: clock[0])
    with zarrckpt.CheckpointManager(str(tmp_path), save_interval_seconds=60) as mgr:
        assert not mgr.save(1, small_state())
        clock[0] += 61
        assert mgr.save(2, small_state())
        clock[0] += 30
        assert not mgr.save(3, small_state())
        clock[0] += 31
        assert mgr.save(4, small_state())


def test_async_save_is_a_true_snapshot_under_donation(tmp_path):
    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state):
        return {"w": state["w"] * 2 + 1, "step": state["step"] + 1, "host": state["host"]}

    state = small_state(1.0)
    state["host"] = np.arange(3.0)
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=True) as mgr:
        expected = jax.tree_util.tree_map(lambda x: np.array(x, copy=True), state)
        assert mgr.save(1, state, force=True)
        state["host"][:] = -1  # host leaves are snapshotted too
        for _ in range(5):
            state = train_step(state)
        jax.block_until_ready(state)
        mgr.wait()
        restored, step = mgr.restore(jax.tree_util.tree_map(
            lambda x: x.sharding if isinstance(x, jax.Array) else x, state))
    assert step == 1
    for key in expected:
        np.testing.assert_array_equal(np.asarray(restored[key]), expected[key], err_msg=key)


class StagedBytes:
    """Bytes of chunks copied to the host and not yet written: from the start of their
    copies (`_transfer.start`) to their release once written (`WriteUnit.release`)."""

    def __init__(self, monkeypatch):
        self.now = self.peak = self.total = 0
        self._lock = threading.Lock()
        start, release = _transfer.start, _planning.WriteUnit.release

        def counted_start(batch, **kwargs):
            with self._lock:
                self.now += sum(unit.nbytes for _, unit in batch)
                self.total += sum(unit.nbytes for _, unit in batch)
                self.peak = max(self.peak, self.now)
            return start(batch, **kwargs)

        def counted_release(unit):
            if unit.copies is not None:  # once per unit: release empties it
                with self._lock:
                    self.now -= unit.nbytes
            release(unit)  # after counting: the budget it gives back may admit the next copies

        monkeypatch.setattr(_transfer, "start", counted_start)
        monkeypatch.setattr(_planning.WriteUnit, "release", counted_release)


def test_staging_is_bounded_by_max_inflight_bytes(tmp_path, monkeypatch):
    state = {f"l{i}": jnp.full((256, 256), float(i)) for i in range(8)}  # 256 KiB each, a chunk each
    staged = StagedBytes(monkeypatch)
    with zarrckpt.CheckpointManager(str(tmp_path), max_inflight_bytes=300 * 1024) as mgr:
        mgr.save(1, state, force=True)
        mgr.wait()
        restored, _ = mgr.restore(jax.tree_util.tree_map(lambda x: x.sharding, state))
    assert staged.total == 8 * 256 * 1024 and staged.peak <= 300 * 1024, (staged.total, staged.peak)
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(v))


@pytest.mark.parametrize("memory_gib, budget_gib", [(128, 32), (2048, 512), (24, 8), (0, 8)])
def test_a_managers_default_byte_budget_is_a_quarter_of_the_memory_and_at_least_8_gib(
        tmp_path, monkeypatch, memory_gib, budget_gib):
    # A fixed 8 GiB made an async save of a state just over it wait for a write.
    monkeypatch.setattr(zarrckpt._util.concurrency, "memory_bytes", lambda: memory_gib * 2**30)
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr._save_options.max_inflight_bytes == budget_gib * 2**30


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_memory_a_process_may_use_is_the_lowest_limit_of_its_cgroup_and_those_above(tmp_path, version):
    """A Slurm job or systemd slice sets its limit on a cgroup below the root, and a
    cgroup above may set a lower one; the root says unlimited ("max" in v2, about 2**63
    in v1)."""
    top = tmp_path / "sys" / ("memory" if version == "v1" else "")
    name, unlimited = ("memory.limit_in_bytes", str(2**63 - 4096)) if version == "v1" else ("memory.max", "max")
    for path, value in (("", unlimited), ("slurm", str(3 * 2**30)), ("slurm/job_7", str(5 * 2**30))):
        (top / path).mkdir(parents=True, exist_ok=True)
        (top / path / name).write_text(value + "\n")
    cgroups = tmp_path / "cgroup"
    cgroups.write_text("4:memory:/slurm/job_7\n1:cpu:/\n" if version == "v1" else "0::/slurm/job_7\n")
    assert zarrckpt._util.concurrency.memory_bytes(str(cgroups), str(tmp_path / "sys")) == 3 * 2**30


def test_background_errors_are_raised_never_lost(tmp_path, monkeypatch):
    original = _storage.Location.write

    def failing(self, key, *parts, **kwargs):
        if "/c." in key:
            raise OSError("disk on fire")
        return original(self, key, *parts, **kwargs)

    mgr = zarrckpt.CheckpointManager(str(tmp_path))
    monkeypatch.setattr(_storage.Location, "write", failing)
    assert mgr.save(1, small_state(), force=True)  # the failure happens in the background
    with pytest.raises(zarrckpt.CheckpointWriteError, match="disk on fire"):
        mgr.wait()
    mgr.wait()  # raised once, not forever
    assert mgr.save(2, small_state(), force=True)
    with pytest.raises(zarrckpt.CheckpointWriteError, match="disk on fire"):
        mgr.save(3, small_state(), force=True)  # the next save raises the earlier failure
    assert mgr.save(4, small_state(), force=True)
    with pytest.raises(zarrckpt.CheckpointWriteError, match="disk on fire"):
        mgr.close()  # and close raises what is left
    assert zarrckpt.all_steps(str(tmp_path)) == []
    with pytest.raises(RuntimeError, match="is closed"):
        mgr.save(4, small_state(), force=True)


def test_sync_save_and_restore_of_given_step(tmp_path):
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=False) as mgr:
        template = small_state()
        assert mgr.restore(template) == (template, 0)
        for s in (10, 20):
            mgr.save(s, small_state(s), force=True)
        assert mgr.all_steps() == [10, 20] and mgr.latest_step() == 20
        state, step = mgr.restore(small_state(), step=10)
        assert step == 10 and float(state["w"][0, 0]) == 10.0
        with pytest.raises(zarrckpt.CheckpointNotFoundError,
                           match=r"step 15 is not a committed checkpoint in .*; committed steps: \[10, 20\]"):
            mgr.restore(small_state(), step=15)


def test_a_save_and_a_restore_each_log_one_line_in_binary_units(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="zarrckpt")
    state = {"w": jnp.zeros((64, 64)), "step": 3}
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(3, state, force=True)
        mgr.wait()
        saved = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        caplog.clear()
        mgr.restore(state)
        restored = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    shown = zarrckpt._util.progress.size(64 * 64 * 4 + 8)
    assert shown == "16.0 KiB"  # as `zarrckpt ls` and `info` show sizes
    (line,) = saved
    assert line.startswith(f"checkpoint step 3 committed to {tmp_path}: {shown} in ") and "training blocked" in line
    (line,) = restored
    assert line.startswith(f"restored {tmp_path}/0000000003: 2 leaves, {shown} in ") and "iB/s)" in line


# -- retention -------------------------------------------------------------------------


def test_steps_to_keep_rules():
    policy = _retention.Policy(keep_last=2, keep_every=100)
    assert _retention.steps_to_keep(policy, [50, 100, 150, 200, 250, 300], {}) == {100, 200, 250, 300}
    best = _retention.Policy(keep_best=2, best_metric="loss")
    metrics = {1: {"loss": 0.5}, 2: {"loss": 0.1}, 3: {"loss": 0.3}, 4: {"loss": 0.9}, 5: {}}
    assert _retention.steps_to_keep(best, [1, 2, 3, 4, 5], metrics) == {2, 3, 5}  # newest always kept
    most = _retention.Policy(keep_best=1, best_metric="acc", best_mode="max")
    assert _retention.steps_to_keep(most, [1, 2, 3], {1: {"acc": 0.9}, 2: {"acc": 0.2}, 3: {"acc": 0.1}}) == {1, 3}
    assert _retention.steps_to_keep(_retention.Policy(keep_every=10), [1, 2, 3], {}) == {1, 2, 3}


def test_a_leaf_named_like_the_pin_file_neither_pins_its_step_nor_stops_retention(tmp_path):
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=1, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"PINNED": np.full(3, step)})
        assert mgr.all_steps() == [3]
        with pytest.raises(ValueError, match="step 3 cannot be pinned"):
            mgr.pin(3)
        mgr.unpin(3)  # no pin to remove
        np.testing.assert_array_equal(mgr.restore({"PINNED": np.zeros(3, np.int64)})[0]["PINNED"], np.full(3, 3))


def test_manager_retention_keeps_newest_best_and_pinned(tmp_path):
    losses = {1: 0.9, 2: 0.1, 3: 0.8, 4: 0.7, 5: 0.6, 6: 0.95}
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=1, keep_best=1, best_metric="loss") as mgr:
        for step, loss in losses.items():
            mgr.save(step, small_state(step), metrics={"loss": loss}, force=True)
            if step == 3:
                mgr.wait()
                mgr.pin(3)
    assert zarrckpt.all_steps(str(tmp_path)) == [2, 3, 6]
    # A new manager learns the metrics of earlier runs from the checkpoints.
    with zarrckpt.CheckpointManager(str(tmp_path), keep_best=1, best_metric="loss") as mgr:
        mgr.save(7, small_state(7), metrics={"loss": 0.5}, force=True)
    assert zarrckpt.all_steps(str(tmp_path)) == [2, 3, 7]


@pytest.mark.parametrize("callers_mesh", [False, True], ids=["no mesh set", "under jax.set_mesh"])
def test_a_diverged_run_never_rotates_out_its_last_finite_step(tmp_path, caplog, request, callers_mesh):
    """Steps holding NaN or infinities are saved, logged with their leaves, and marked;
    retention keeps the newest step without them until a newer one commits, also for a
    manager opened later. The check runs on the devices, each set of devices apart (a
    leaf on one device beside leaves on the mesh), also in a program that set a mesh of
    its own (`jax.set_mesh`), which the check's programs are not held to."""
    if callers_mesh:
        jax.set_mesh(mesh(names=("x", "y")))  # for the whole program, as a script may
        request.addfinalizer(lambda: jax.set_mesh(None))

    def state(w, single):
        return {"w": jax.device_put(jnp.full((8, 16), w), NamedSharding(mesh(names=("a", "b")), P("a", "b"))),
                "single": jax.device_put(jnp.full(3, single), jax.devices()[1]),
                "count": jnp.array(1, jnp.int32), "host": np.full(2, np.nan)}  # host leaves are not looked at

    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        with zarrckpt.CheckpointManager(str(tmp_path), keep_last=1) as mgr:
            mgr.save(1, state(1.0, 1.0))
            mgr.save(2, state(np.nan, 1.0))
            mgr.save(3, state(1.0, -np.inf))
            mgr.wait()
            assert mgr.all_steps() == [1, 3]
    warned = [r.getMessage() for r in caplog.records if "NaN or infinities" in r.getMessage()]
    assert len(warned) == 2 and "['w']" in warned[0] and "['single']" in warned[1], warned
    assert "['host']" not in " ".join(warned)
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=1) as mgr:
        mgr.save(4, state(np.nan, np.nan))
        mgr.wait()
        assert mgr.all_steps() == [1, 4]
        mgr.save(5, state(2.0, 2.0))
        mgr.wait()
        assert mgr.all_steps() == [5]  # a newer finite step: the old one may go
    restored, step = zarrckpt.load_checkpoint_if_it_exists(str(tmp_path), state(0.0, 0.0))
    assert step == 5 and float(restored["w"][0, 0]) == 2.0


def test_a_save_inside_jax_set_mesh_of_a_leaf_larger_than_its_byte_budget_commits(tmp_path):
    """A leaf larger than `max_inflight_bytes` is copied chunk by chunk, each sliced
    from its shard on the device by a program of zarrckpt's own: under a mesh the
    caller set, that program is not held to it (the save failed)."""
    data = mesh((8,), ("data",))
    x = np.arange(2**20, dtype=np.float32).reshape(1024, 1024)
    with jax.set_mesh(data):
        state = {"w": jax.device_put(x, NamedSharding(data, P("data")))}
        with zarrckpt.CheckpointManager(str(tmp_path), max_chunk_bytes=2**16, min_chunk_bytes=2**12,
                                        max_inflight_bytes=2**19) as mgr:
            mgr.save(1, state)
    np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), 1)["w"]), x)


def test_a_diverged_adapter_is_found_behind_a_frozen_base_of_more_leaves_than_the_check_looks_at(tmp_path):
    """The NaN check looks at the largest leaves (`_finite.MAX_CHECKED`); leaves made
    from the step before are not looked at again, so that a frozen base larger than
    the adapters does not crowd them out of it."""
    from zarrckpt import _finite

    base = [jnp.full(1024, float(i)) for i in range(_finite.MAX_CHECKED + 2)]  # frozen: the same arrays

    def state(adapter):
        return {"base": base, "adapter": jnp.full(8, adapter)}

    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=1) as mgr:
        mgr.save(1, state(1.0))
        mgr.save(2, state(np.nan))
        mgr.wait()
        assert mgr.all_steps() == [1, 2]  # step 2 is marked: step 1 stays, the newest without NaN


def test_a_frozen_leaf_holding_nan_marks_every_step_made_from_it(tmp_path):
    """A leaf unchanged since the step before holds NaN in every step made from it,
    though the check does not look at it again."""
    leaves = [jnp.full(1024, float(i)) for i in range(3)]

    def state(bad):
        return {"w": leaves, "bad": bad}

    nan = jnp.full(16, np.nan)
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=1) as mgr:
        mgr.save(1, state(jnp.zeros(16)))
        mgr.save(2, state(nan))
        mgr.save(3, state(nan))  # the same array: made from step 2
        mgr.wait()
        assert mgr.all_steps() == [1, 3]
        nan_again = jnp.full(16, np.nan)  # a new array, checked again
        mgr.save(4, state(nan_again))
        mgr.save(5, state(jnp.ones(16)))
        mgr.wait()
        assert mgr.all_steps() == [5]


def test_delete_and_unpin_by_hand(tmp_path):
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=2, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, small_state(step))
            if step == 1:
                mgr.pin(1)
        assert mgr.all_steps() == [1, 2, 3]  # 1 pinned
        mgr.unpin(1)
        mgr.save(4, small_state(4))
        assert mgr.all_steps() == [3, 4]  # unpinned, retention took it
        mgr.pin(3)
        mgr.delete(3)  # pinned or not, by hand
        assert mgr.all_steps() == [4] and zarrckpt.all_steps(str(tmp_path)) == [4]
        with pytest.raises(zarrckpt.CheckpointNotFoundError, match="step 3 is not a committed checkpoint"):
            mgr.delete(3)
        with pytest.raises(zarrckpt.CheckpointNotFoundError, match="step 9 is not a committed checkpoint"):
            mgr.unpin(9)
        mgr.delete(4)  # the newest too: the run is then empty
        assert mgr.latest_step() is None
        mgr.save(5, small_state(5))
        (tmp_path / "0000000005" / "notes.txt").write_text("mine")
        with pytest.raises(zarrckpt.CheckpointWriteError, match="not the checkpoint's"):
            mgr.delete(5)  # nothing outside a checkpoint is ever deleted
    assert (tmp_path / "0000000005" / "notes.txt").read_text() == "mine"
    assert zarrckpt.all_steps(str(tmp_path)) == [5]


def test_retention_cleans_old_leftovers_but_not_newer_ones(tmp_path):
    root = str(tmp_path)
    for step in (1, 2):
        zarrckpt.save_checkpoint(root, step, small_state(step))
    (tmp_path / "0000000001" / "zarr.json").unlink()  # step 1 is now an uncommitted leftover
    (tmp_path / "0000000009").mkdir()  # a newer save in progress
    with zarrckpt.CheckpointManager(root, keep_last=5) as mgr:
        mgr.save(3, small_state(3), force=True)
    assert not (tmp_path / "0000000001").exists() and (tmp_path / "0000000009").exists()
    assert zarrckpt.all_steps(root) == [2, 3]


def test_interrupted_deletion_never_looks_committed(tmp_path, monkeypatch):
    root = str(tmp_path)
    for step in (1, 2):
        zarrckpt.save_checkpoint(root, step, small_state(step))

    def crash(self):
        raise OSError("killed mid-deletion")

    monkeypatch.setattr(_storage.Location, "remove_tree", crash)
    with pytest.raises(OSError, match="killed mid-deletion"):
        _retention.apply(_storage.resolve(root), _retention.Policy(keep_last=1), {})
    assert (tmp_path / "0000000001").exists()
    assert _commit.head(_storage.resolve(root).step(1)).state is not _commit.State.COMMITTED
    assert zarrckpt.all_steps(root) == [2]
    monkeypatch.undo()
    zarrckpt.save_checkpoint(root, 1, {"fresh": np.ones(2)})  # the leftover is cleared first
    assert sorted(p.name for p in (tmp_path / "0000000001").iterdir()) == ["fresh", "zarr.json"]


def test_progress_bars_can_be_turned_on_and_off(tmp_path, monkeypatch, capsys):
    from zarrckpt._util import progress as _progress

    monkeypatch.setattr(_progress, "_SHOW_AFTER_S", 0)
    with zarrckpt.CheckpointManager(str(tmp_path), progress=True) as mgr:
        mgr.save(1, small_state(), force=True)
        mgr.wait()
        mgr.restore(small_state())
    shown = capsys.readouterr().err
    assert "saving" in shown and "restoring" in shown
    with zarrckpt.CheckpointManager(str(tmp_path), progress=False) as mgr:
        mgr.save(2, small_state(), force=True)
        mgr.wait()
        mgr.restore(small_state(), progress=True)  # the call's own choice wins
        assert "restoring" in capsys.readouterr().err
        mgr.restore(small_state())
    assert capsys.readouterr().err == ""
    zarrckpt.verify(str(tmp_path / "0000000002"), progress=True)
    assert "verifying" in capsys.readouterr().err


def test_metrics_of_a_step_and_the_best_step_read_back(tmp_path):
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=5, best_metric="loss", best_mode="min") as mgr:
        for step, loss in ((1, 0.5), (2, 0.25), (3, float("nan")), (4, 0.4)):
            mgr.save(step, small_state(step), metrics={"loss": loss, "acc": 1 - loss})
        mgr.save(5, small_state(5))  # no metrics
        mgr.wait()
        assert mgr.metrics(2) == {"loss": 0.25, "acc": 0.75}
        assert mgr.metrics(3)["loss"] == "NaN" and mgr.metrics(5) is None
        assert mgr.best_step() == 2
        with pytest.raises(zarrckpt.CheckpointNotFoundError):
            mgr.metrics(9)
    with zarrckpt.CheckpointManager(str(tmp_path), best_metric="loss", best_mode="max") as again:
        assert again.best_step() == 1  # from storage, in a new process's manager
    with zarrckpt.CheckpointManager(str(tmp_path)) as plain, pytest.raises(ValueError, match="needs best_metric"):
        plain.best_step()


# -- everyday use -----------------------------------------------------------------------


def test_metrics_straight_from_a_jitted_step(tmp_path):
    loss = jax.jit(lambda x: (x ** 2).mean())(jnp.arange(3.0))  # a jax scalar, as every loop has
    with zarrckpt.CheckpointManager(str(tmp_path), keep_best=1, best_metric="loss") as mgr:
        assert mgr.save(1, train_state(), metrics={"loss": loss, "acc": np.float32(0.5), "n": 3, "lr": np.array(1e-3),
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
            mgr.save(1, train_state(), metrics={"loss": metric})
        assert mgr.save(2, train_state(), metrics={"loss": 0.25})
    assert zarrckpt.all_steps(str(tmp_path)) == [2]


def test_no_policy_saves_at_every_call(tmp_path):
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert all(mgr.save(step, train_state(step)) for step in (1, 2, 3))
    assert zarrckpt.all_steps(str(tmp_path)) == [1, 2, 3]


def test_a_flax_train_state_s_step_and_numpy_steps_are_steps(tmp_path):
    """flax's `TrainState.step` is a 0-d int32 jax array, an `np.arange` loop's step a
    numpy integer: each names a step wherever a step is taken (before: "step must be a
    non-negative int"). A bool or a float is a TypeError naming the step."""
    import optax
    from flax.training import train_state as flax_train_state

    params = {"w": jnp.ones((4, 3))}
    state = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    state = jax.jit(lambda s: s.apply_gradients(grads={"w": jnp.full((4, 3), 0.5)}))(state)  # a train step
    assert isinstance(state.step, jax.Array) and state.step.ndim == 0
    run = str(tmp_path / "run")
    with zarrckpt.CheckpointManager(run) as mgr:
        assert mgr.save(state.step, state)
        for step in np.arange(2, 4):
            assert mgr.save(step, state.replace(step=state.step + 1))
        mgr.wait()
        assert mgr.all_steps() == [1, 2, 3] and mgr.metrics(np.int64(2)) is None
        mgr.pin(jnp.int32(3))
        restored, step = mgr.restore(state, step=np.int32(1))
        assert step == 1 and type(step) is int and int(restored.step) == 1
        assert not mgr.reached_preemption(np.int64(3))
        for bad in (True, 2.0, "2"):
            with pytest.raises(TypeError, match="step must be a non-negative int"):
                mgr.save(bad, state)
    zarrckpt.save_checkpoint(run, np.uint16(7), params)
    np.testing.assert_array_equal(zarrckpt.load_checkpoint(run, np.int64(7), params)["w"], params["w"])


def test_a_step_older_than_the_newest_committed_is_not_saved_and_says_why(tmp_path, caplog):
    """A loop whose step counter went back (not restored with the state) would save
    steps a restore never picks: refused, with one warning naming both steps."""
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=False) as mgr:
        assert mgr.save(2, train_state(2))
        with caplog.at_level(logging.WARNING, logger="zarrckpt"):
            assert not mgr.save(1, train_state(1))
            assert not mgr.save(0, train_state(0))
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "step 1 " in warned[0].getMessage() and "step 2," in warned[0].getMessage()
        assert mgr.save(1, train_state(1), force=True)  # on purpose
        assert mgr.save(5, train_state(5))
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=False) as mgr:
        mgr.restore(train_state(0), step=1)  # a rollback, on purpose: the loop saves on from there
        assert mgr.save(3, train_state(3))
    assert zarrckpt.all_steps(str(tmp_path)) == [1, 2, 3, 5]


def test_restore_with_a_step_where_the_target_goes_says_how(tmp_path):
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(5, train_state())
        with pytest.raises(TypeError, match=r"to restore step 5, call mgr.restore\(state, step=5\)"):
            mgr.restore(5)
        assert mgr.restore(train_state(0.0), step=5)[1] == 5


@pytest.mark.parametrize("async_save", [True, False])
def test_wait_and_sync_saves_cover_retention(tmp_path, async_save):
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=2, async_save=async_save) as mgr:
        for step in range(1, 6):
            mgr.save(step, train_state(step))
            if not async_save:
                assert mgr.all_steps() == list(range(max(1, step - 1), step + 1))
        mgr.wait()
        assert mgr.all_steps() == [4, 5]


def test_an_interrupted_wait_names_the_step_and_says_its_save_goes_on(tmp_path, monkeypatch, caplog):
    from zarrckpt import _save

    gate = threading.Event()
    original = _save.SaveJob.run

    def held(job, work):  # the save is still writing when Ctrl-C comes
        gate.wait(60)
        return original(job, work)

    def interrupted(save):
        raise KeyboardInterrupt

    monkeypatch.setattr(_save.SaveJob, "run", held)
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        mgr = zarrckpt.CheckpointManager(str(tmp_path))
        assert mgr.save(5, small_state(5))
        with monkeypatch.context() as patched:
            patched.setattr(_save.BackgroundSave, "join", interrupted)
            with pytest.raises(KeyboardInterrupt):
                mgr.wait()
        gate.set()
        mgr.close()
    (said,) = [r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()]
    assert f"{tmp_path}/0000000005" in said and "goes on" in said
    assert zarrckpt.all_steps(str(tmp_path)) == [5]  # here the save went on, and committed
    # Ctrl-C in the training loop: leaving the `with` block says it waits for the save.
    gate.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zarrckpt"), pytest.raises(KeyboardInterrupt):
        with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
            assert mgr.save(6, small_state(6))
            threading.Timer(0.5, gate.set).start()
            raise KeyboardInterrupt
    assert any(f"waiting for {tmp_path}/0000000006 to commit before leaving" in r.getMessage()
               for r in caplog.records), caplog.text
    assert zarrckpt.all_steps(str(tmp_path)) == [5, 6]
