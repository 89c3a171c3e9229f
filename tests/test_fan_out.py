"""How many threads a fan-out keeps busy (`_concurrency.Operation.fan_out`): where it
starts with fewer workers than it may have, small quick items stay on few threads and
each item that moves many bytes or waits starts one more."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import zarrckpt
from zarrckpt import _storage
from zarrckpt._util import concurrency as _concurrency


def _fan_out(items, start, fn, nbytes=lambda item: 0):
    threads: dict[object, str] = {}

    def run(item):
        threads[item] = threading.current_thread().name
        fn(item)
        return item

    with _concurrency.Operation(8, "test") as op:
        assert op.fan_out(items, run, nbytes=nbytes, start=start) == list(items)
    return threads


def test_small_items_stay_on_one_worker_and_each_item_of_many_bytes_starts_another(monkeypatch):
    monkeypatch.setattr(_concurrency, "_RAMP_S", 3600.0)  # bytes alone decide here, whatever the machine's load
    small, big = [("small", i) for i in range(50)], [("big", i) for i in range(6)]
    many = _concurrency._RAMP_BYTES
    threads = _fan_out(small + big, 1, lambda item: time.sleep(0.05 if item[0] == "big" else 0.001),
                       nbytes=lambda item: many if item[0] == "big" else 0)
    assert len({threads[item] for item in small}) == 1
    assert len({threads[item] for item in small + big}) >= 2


def test_an_item_that_waits_starts_another_worker_and_the_first_runs_alone(monkeypatch):
    monkeypatch.setattr(_concurrency, "_RAMP_S", 0.01)
    lock, running, seen = threading.Lock(), [0], {}

    def wait(item):
        with lock:
            running[0] += 1
        time.sleep(0.05)
        with lock:
            seen[item] = running[0]  # items running as this one ends, itself included
            running[0] -= 1

    threads = _fan_out(list(range(6)), 1, wait)
    assert seen[0] == 1
    assert len(set(threads.values())) >= 2


def test_items_of_many_bytes_start_workers_before_they_end(monkeypatch):
    monkeypatch.setattr(_concurrency, "_RAMP_S", 3600.0)
    barrier = threading.Barrier(4, timeout=60)  # passes only with 4 items running at once
    threads = _fan_out(list(range(4)), 1, lambda item: barrier.wait(), nbytes=lambda item: _concurrency._RAMP_BYTES)
    assert len(set(threads.values())) == 4


def test_small_items_add_a_worker_once_together_they_move_many_bytes(monkeypatch):
    monkeypatch.setattr(_concurrency, "_RAMP_S", 3600.0)
    barrier = threading.Barrier(2, timeout=60)
    items = list(range(6))
    threads = _fan_out(items, 1, lambda item: barrier.wait() if item >= 4 else None,
                       nbytes=lambda item: _concurrency._RAMP_BYTES // 4)
    assert len({threads[item] for item in items[:4]}) == 1
    assert threads[4] != threads[5]


@pytest.mark.parametrize("start", [0, -1])
def test_a_start_below_one_still_runs_every_item(start):
    threads = _fan_out(list(range(5)), start, lambda item: None)
    assert sorted(threads) == list(range(5))


def test_without_start_every_worker_begins(monkeypatch):
    monkeypatch.setattr(_concurrency, "_RAMP_S", 3600.0)
    barrier = threading.Barrier(8, timeout=60)  # passes only with 8 items running at once
    threads = _fan_out(list(range(8)), None, lambda item: barrier.wait())
    assert len(set(threads.values())) == 8


def test_a_failure_after_workers_were_added_fails_the_fan_out_and_stops_taking_items(monkeypatch):
    monkeypatch.setattr(_concurrency, "_RAMP_S", 0.0)  # every item adds a worker
    started: list[tuple[int, str]] = []

    def fn(item):
        started.append((item, threading.current_thread().name))
        time.sleep(0.01)
        if item == 3:
            raise OSError("the store failed")

    with pytest.raises(OSError, match="the store failed"), _concurrency.Operation(4, "test") as op:
        op.fan_out(range(1000), fn, start=1)
    assert len({thread for _, thread in started}) >= 2
    assert len(started) < 1000


def test_a_worker_that_cannot_be_added_leaves_the_fan_out_to_those_running(monkeypatch):
    """Where the executors no longer take work (the interpreter's exit has begun, as
    for a save on a thread of the user's while the main thread ends), a worker that
    would be added is not: the items are all done by those running."""
    submit, calls = _concurrency._Pool.submit, []

    def refusing(self, *args, **kwargs):
        calls.append(args)
        if len(calls) > 1:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(_concurrency._Pool, "submit", refusing)
    threads = _fan_out(list(range(6)), 1, lambda item: None, nbytes=lambda item: _concurrency._RAMP_BYTES)
    assert sorted(threads) == list(range(6)) and len(calls) > 1


def test_a_local_save_writes_its_array_documents_and_small_chunks_in_turn_and_large_chunks_on_several_threads(
        tmp_path, monkeypatch):
    """A local save of small leaves and large ones (in chunks of 1 MiB or more): the
    array documents and the small leaves' chunks, written first, are written by one
    thread; the large chunks by more than one."""
    monkeypatch.setattr(_concurrency, "_RAMP_S", 3600.0)
    writers: list[tuple[str, int, str]] = []
    write_new = _storage.Location.write_new

    def recorded(self, key, *parts, **kwargs):
        nbytes = sum(memoryview(p).nbytes for p in parts)
        writers.append((key, nbytes, threading.current_thread().name))
        if nbytes >= 2**20:  # long enough for a worker started meanwhile to take the next chunk
            time.sleep(0.02)
        return write_new(self, key, *parts, **kwargs)

    monkeypatch.setattr(_storage.Location, "write_new", recorded)
    tree = {f"a_small{i:02d}": np.full((16,), i, np.float32) for i in range(40)}  # first in the tree's order
    tree.update({f"b_big{i}": np.full((2**20,), i, np.float32) for i in range(6)})  # 4 MiB each
    zarrckpt.save_pytree(str(tmp_path / "ckpt"), tree, max_chunk_bytes=2**21, min_chunk_bytes=2**21)
    first_big = next(i for i, (_, nbytes, _) in enumerate(writers) if nbytes >= 2**20)
    assert first_big == 46 + 40  # every array's document, then every small chunk
    assert len({thread for _, _, thread in writers[:first_big]}) == 1
    assert len({thread for _, nbytes, thread in writers if nbytes >= 2**20}) >= 2
