"""A new manager takes a directory over from this process's earlier manager left open
(a notebook cell run again, a manager deleted while saving); another process's is refused."""

import gc
import json
import logging
import threading

import numpy as np
import pytest

import zarrckpt
from zarrckpt import _commit
from zarrckpt._run import lease as _lease

BEAT = 60.0  # renewals play no part here: the holder is this very process


def state(value: float) -> dict:
    return {"w": np.full(1024, value), "step": np.int64(value)}


def leases(root) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((root / _lease.LEASES).iterdir())}


@pytest.fixture
def slow_commit(monkeypatch):
    """Every commit waits until `go` is set: a save stays in flight until then."""
    go = threading.Event()
    commit = _commit.commit

    def waiting(*args, **kwargs):
        assert go.wait(60), "the test never let the commit go"
        return commit(*args, **kwargs)

    monkeypatch.setattr(_commit, "commit", waiting)
    yield go
    go.set()


def test_a_notebook_cell_run_again_takes_over_from_the_manager_its_traceback_holds(tmp_path, caplog, slow_commit):
    run = tmp_path / "run"
    traceback = []  # what IPython's traceback keeps of the failed cell: its frame, so its manager

    def cell() -> None:
        mgr = zarrckpt.CheckpointManager(str(run), heartbeat_s=BEAT)
        traceback.append(mgr)
        assert mgr.save(1, state(1.0))
        raise ValueError("the cell's bug")

    with pytest.raises(ValueError, match="the cell's bug"):
        cell()
    (old,) = traceback
    threading.Timer(0.5, slow_commit.set).start()  # step 1 is still being saved when the cell runs again
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        mgr = zarrckpt.CheckpointManager(str(run), heartbeat_s=BEAT)  # the cell run again
    (warned,) = [r.getMessage() for r in caplog.records if "takes it over" in r.getMessage()]
    assert str(run) in warned and "0000000001" in warned, warned
    assert mgr.all_steps() == [1]  # the earlier manager's save committed before the handover

    # A real transfer: the earlier lease given back, the next number claimed by the new manager.
    assert list(leases(run)) == ["0000000002"] and not leases(run)["0000000002"]["released"]
    with pytest.raises(zarrckpt.DirectoryInUseError, match="was taken over by"):
        old._run.lease.check()

    named = r"was taken over by the CheckpointManager made at .*test_takeover\.py:\d+"
    with pytest.raises(zarrckpt.DirectoryInUseError, match=named):
        old.save(2, state(-2.0), force=True)
    with pytest.raises(zarrckpt.DirectoryInUseError, match=named):
        old.delete(1)
    with pytest.raises(zarrckpt.DirectoryInUseError, match=named):
        old.restore(state(0.0))
    old.close()  # nothing left to close

    restored, step = mgr.restore(state(0.0))
    assert step == 1 and restored["w"][0] == 1.0
    assert mgr.save(2, state(2.0))
    mgr.close()
    assert zarrckpt.all_steps(str(run)) == [1, 2]
    np.testing.assert_array_equal(zarrckpt.load_checkpoint(str(run), 2)["w"], np.full(1024, 2.0))
    assert leases(run)["0000000002"]["released"]


def test_the_same_directory_spelled_otherwise_is_taken_over_too(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "run")
    held = [zarrckpt.CheckpointManager(str(tmp_path / "run"), heartbeat_s=BEAT)]
    with zarrckpt.CheckpointManager(f"{tmp_path}/link/", heartbeat_s=BEAT) as mgr:
        assert mgr.save(1, state(1.0), force=True)
    with pytest.raises(zarrckpt.DirectoryInUseError, match="was taken over by"):
        held[0].save(2, state(2.0), force=True)
    assert zarrckpt.all_steps(str(tmp_path / "run")) == [1]


def test_a_manager_deleted_while_saving_is_waited_for_then_taken_over(tmp_path, slow_commit):
    run = str(tmp_path / "run")
    mgr = zarrckpt.CheckpointManager(run, heartbeat_s=BEAT)
    slow_commit.set()
    assert mgr.save(1, state(1.0))
    mgr.wait()
    slow_commit.clear()
    assert mgr.save(2, state(2.0))  # in flight until the timer lets it commit
    del mgr
    gc.collect()
    threading.Timer(0.5, slow_commit.set).start()
    with zarrckpt.CheckpointManager(run, heartbeat_s=BEAT) as mgr:
        assert mgr.all_steps() == [1, 2]  # the orphaned save committed first, then the directory was taken
        restored, step = mgr.restore(state(0.0))
        assert step == 2
        np.testing.assert_array_equal(restored["w"], np.full(1024, 2.0))
        assert mgr.save(3, state(3.0))
    assert zarrckpt.all_steps(run) == [1, 2, 3]
    assert zarrckpt.verify(f"{run}/0000000002").ok


def test_a_save_in_flight_that_outlasts_the_new_managers_timeout_leaves_the_earlier_manager_as_it_was(
        tmp_path, slow_commit):
    run = str(tmp_path / "run")
    held = [zarrckpt.CheckpointManager(run, heartbeat_s=BEAT)]
    assert held[0].save(1, state(1.0))
    with pytest.raises(zarrckpt.DirectoryInUseError, match=r"save of .*0000000001 did not finish within 0\.2s"):
        zarrckpt.CheckpointManager(run, heartbeat_s=BEAT, timeout_s=0.2)
    slow_commit.set()
    assert held[0].save(2, state(2.0))  # still the holder
    held[0].close()
    assert zarrckpt.all_steps(run) == [1, 2]


def test_a_new_manager_with_a_bad_option_leaves_the_earlier_one_as_it_was(tmp_path):
    """Its options are checked before anything is taken over: the earlier manager, still
    held, saves on."""
    held = [zarrckpt.CheckpointManager(str(tmp_path), async_save=False, heartbeat_s=BEAT)]
    held[0].save(1, state(1.0))
    with pytest.raises(ValueError, match="local_directory and local_save_interval_steps"):
        zarrckpt.CheckpointManager(str(tmp_path), local_directory=str(tmp_path / "local"), heartbeat_s=BEAT)
    held[0].save(2, state(2.0))
    assert held[0].all_steps() == [1, 2]
    held[0].close()
