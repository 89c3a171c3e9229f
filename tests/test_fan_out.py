"""How many threads a fan-out keeps busy (`_concurrency.Operation.fan_out`): where it
starts with fewer workers than it may have, small quick items stay on few threads and
each item that moves many bytes or waits starts one more."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import zarrckpt
from zarrckpt import _concurrency, _storage


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
                       nbytes=lambda item: many if item[0] == "big" else many - 1)
    assert len({threads[item] for item in small}) == 1
    assert len({threads[item] for item in small + big}) >= 2


def test_an_item_that_waits_starts_another_worker(monkeypatch):
    monkeypatch.setattr(_concurrency, "_RAMP_S", 0.01)
    items = list(range(6))
    threads = _fan_out(items, 1, lambda item: time.sleep(0.05))
    assert len(set(threads.values())) >= 2


def test_without_start_every_worker_begins(monkeypatch):
    monkeypatch.setattr(_concurrency, "_RAMP_S", 3600.0)
    barrier = threading.Barrier(8, timeout=60)  # passes only with 8 items running at once
    threads = _fan_out(list(range(8)), None, lambda item: barrier.wait())
    assert len(set(threads.values())) == 8


def test_a_failure_after_workers_were_added_fails_the_fan_out_and_stops_taking_items(monkeypatch):
    monkeypatch.setattr(_concurrency, "_RAMP_S", 0.0)  # every item adds a worker
    started = []

    def fn(item):
        started.append(item)
        time.sleep(0.01)
        if item == 3:
            raise OSError("the store failed")

    with pytest.raises(OSError, match="the store failed"), _concurrency.Operation(4, "test") as op:
        op.fan_out(range(1000), fn, start=1)
    assert len(started) < 1000


_NO_THREAD_CAN_START = """
import concurrent.futures
from zarrckpt import _concurrency

def no_thread(self):
    raise RuntimeError("can't create new thread at interpreter shutdown")

concurrent.futures.ThreadPoolExecutor._adjust_thread_count = no_thread
with _concurrency.Operation(4, "write") as op:
    print(op.fan_out(range(8), lambda i: i * i, nbytes=lambda i: _concurrency._RAMP_BYTES, start=1))
"""


def test_workers_added_where_no_thread_can_start_run_on_the_calling_thread():
    """At the interpreter's exit no thread can start: the workers a fan-out adds run on
    the thread that adds them (`_concurrency._Pool`), and none waits for a lock that
    thread holds. In a process of its own: a deadlock would hold a lock every executor
    of the process needs."""
    ran = subprocess.run([sys.executable, "-c", _NO_THREAD_CAN_START], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split("\n")[-2] == str([i * i for i in range(8)])


def test_a_local_save_writes_its_array_documents_in_turn_and_its_chunks_on_several_threads(tmp_path, monkeypatch):
    """A manager's local save of small leaves and large ones (in chunks of 1 MiB or more):
    the array documents and small chunks before the first large chunk are written by
    one thread, the large chunks by more than one."""
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
    tree = {f"small{i}": np.full((16,), i, np.float32) for i in range(40)}
    tree.update({f"big{i}": np.full((2**20,), i, np.float32) for i in range(6)})  # 4 MiB each
    zarrckpt.save_pytree(str(tmp_path / "ckpt"), tree, max_chunk_bytes=2**21, min_chunk_bytes=2**21)
    first_big = next(i for i, (_, nbytes, _) in enumerate(writers) if nbytes >= 2**20)
    assert first_big >= 40 and len({thread for _, _, thread in writers[:first_big]}) == 1
    assert len({thread for _, nbytes, thread in writers if nbytes >= 2**20}) >= 2
