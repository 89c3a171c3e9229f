"""What an async save leaves to the training thread: no compilation on the first save,
its own threads at a lower priority and fewer of them, the caller's thread as it
was."""

from __future__ import annotations

import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import zarrckpt
from zarrckpt._util import concurrency as _concurrency

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is Linux's")


def sharded_state(value: float):
    data = mesh((8,), ("data",))
    return {"w": jax.device_put(jnp.full((2048, 1024), value), NamedSharding(data, P("data"))),
            "b": jnp.full(16, value), "step": jnp.array(int(value))}


@pytest.fixture
def compiles():
    """The threads that compiled a program for XLA, one entry a compilation."""
    threads: list[threading.Thread] = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            threads.append(threading.current_thread())

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield threads
    jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize("reuse_unchanged", [True, False])
def test_a_runs_first_save_compiles_nothing_on_the_callers_thread(tmp_path, compiles, reuse_unchanged):
    """The NaN check's and the fingerprints' programs are compiled on the save's own
    thread; the saves after it run them, on the caller's thread, compiled."""
    states = [sharded_state(float(i)) for i in range(1, 5)]
    jax.block_until_ready(states)
    main = threading.current_thread()
    with zarrckpt.CheckpointManager(str(tmp_path), reuse_unchanged=reuse_unchanged) as mgr:
        for step, state in enumerate(states, 1):
            compiles.clear()
            mgr.save(step, state)
            assert main not in compiles, f"step {step} compiled on the caller's thread"
            mgr.wait()
    for step, state in enumerate(states, 1):
        np.testing.assert_array_equal(np.asarray(zarrckpt.load_checkpoint(str(tmp_path), step)["w"]),
                                      np.asarray(state["w"]))


def test_a_first_save_checks_for_nan_on_its_own_thread_and_commits_what_the_caller_donated_since(tmp_path):
    """A new manager's first save compiles its NaN check on its own thread and runs it
    there: a leaf still there is checked (a step holding NaN is marked, so retention
    keeps the finite one before it); a leaf the caller donated meanwhile is not looked
    at, and the save commits the values it was given all the same."""
    def state(value):
        return {"w": jnp.full((64, 64), value), "b": jnp.ones(8)}

    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=1) as mgr:
        mgr.save(1, state(1.0))
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=1) as mgr:
        mgr.save(2, state(np.nan))
        mgr.wait()
        assert mgr.all_steps() == [1, 2]  # 2 marked: 1 kept
    train = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    train(state(0.0))  # compiled: the donation follows the save at once
    with zarrckpt.CheckpointManager(str(tmp_path), keep_last=3) as mgr:
        donated = state(5.0)
        mgr.save(3, donated)
        after = train(donated)
        assert all(x.is_deleted() for x in jax.tree.leaves(donated))
        mgr.wait()
        assert 3 in mgr.all_steps()
    restored = zarrckpt.load_checkpoint(str(tmp_path), 3)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((64, 64), 5.0, np.float32))
    np.testing.assert_array_equal(np.asarray(after["w"]), np.full((64, 64), 6.0, np.float32))


@linux_only
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_background_saves_threads_run_at_a_lower_priority_and_the_callers_keeps_its_own(tmp_path, async_save):
    """An async save's threads yield to training; a save the caller waits for (a sync
    manager's) writes at the caller's own priority."""
    seen: dict[str, int] = {}
    original = _concurrency.Operation.fan_out

    def fan_out(self, items, fn, **kwargs):  # noted on every thread that writes
        def noted(item):
            seen[threading.current_thread().name] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            return fn(item)
        return original(self, items, noted, **kwargs)

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_concurrency.Operation, "fan_out", fan_out)
        with zarrckpt.CheckpointManager(str(tmp_path), async_save=async_save) as mgr:
            mgr.save(1, sharded_state(1.0))
            mgr.wait()
    lowered_to = min(19, before + _concurrency.BACKGROUND_NICE)
    assert seen and set(seen.values()) == ({lowered_to} if async_save else {before}), seen
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


@linux_only
def test_a_thread_that_yields_to_training_lowers_only_itself_and_the_threads_it_starts():
    found = {}

    def child():
        found["child"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def lowered():
        _concurrency.yield_to_training()
        found["self"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        thread = threading.Thread(target=child)
        thread.start()
        thread.join()

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    lowered_to = min(19, before + _concurrency.BACKGROUND_NICE)
    assert found == {"self": lowered_to, "child": lowered_to}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


@pytest.mark.parametrize(("cores", "requests_wait", "expected"),
                         [(2, False, 1), (16, False, 4), (64, False, 16), (128, False, 16), (2, True, 16)])
def test_a_save_beside_training_writes_a_local_disk_with_a_thread_for_every_4_cores(monkeypatch, cores,
                                                                                     requests_wait, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    share = _concurrency.Share.beside_training(requests_wait)
    assert share.cap(16) == expected
    share.hurry()
    assert share.cap(16) == 16


def test_a_fan_out_beside_training_adds_its_workers_once_someone_waits_for_it():
    """One worker while the share is capped; more from the first item after `hurry`."""
    share = _concurrency.Share(beside=1)
    threads: list[str] = []

    def item(i):
        threads.append(threading.current_thread().name)
        if i == 20:
            share.hurry()
        time.sleep(0.002)  # an item that takes long enough for the ramp to add a worker

    with _concurrency.Operation(4, "test") as op:
        op.fan_out(range(60), item, start=1, share=share)
    assert set(threads[:21]) == {threads[0]}
    assert len(set(threads[21:])) > 1


def test_waiting_for_an_async_save_lets_it_write_with_all_its_threads(tmp_path, monkeypatch):
    hurried = []
    monkeypatch.setattr(_concurrency.Share, "hurry", lambda self: hurried.append(self._beside))
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, sharded_state(1.0))
        assert not hurried
        mgr.wait()
    assert hurried and hurried[0] != sys.maxsize  # a save beside training's share, not every worker
