"""A store that fails a share of requests: transient failures are retried with backoff,
persistent ones abort the save with nothing committed."""

import random
import threading

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import zarrckpt
from zarrckpt import _storage


class FlakyFileSystem(MemoryFileSystem):
    """fsspec's memory file system, failing `fail_rate` of reads and writes, every one
    whose path ends in `fail_suffix`, and every one whose path contains `fail_inside`,
    with `error`."""

    protocol = "flaky"
    injected = 0

    def __init__(self, fail_rate=0.0, error="transient", seed=0, fail_suffix=None, fail_inside=None, **kwargs):
        super().__init__(**kwargs)
        self._fail_rate, self._error, self._fail_suffix, self._fail_inside = fail_rate, error, fail_suffix, fail_inside
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _maybe_fail(self, path):
        with self._lock:
            fail = (self._rng.random() < self._fail_rate or bool(self._fail_suffix and path.endswith(self._fail_suffix))
                    or bool(self._fail_inside and self._fail_inside in path))
        if fail:
            type(self).injected += 1
            if self._error == "transient":
                raise ConnectionResetError(f"injected: connection reset while accessing {path}")
            raise PermissionError(f"injected: access denied to {path}")

    def cat_file(self, path, *args, **kwargs):
        self._maybe_fail(path)
        return super().cat_file(path, *args, **kwargs)

    def pipe_file(self, path, *args, **kwargs):
        self._maybe_fail(path)
        return super().pipe_file(path, *args, **kwargs)


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(_storage.guard, "_FIRST_BACKOFF_S", 0.001)
    FlakyFileSystem.injected = 0


def state():
    return {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(7), "step": 3}


def test_transient_failures_are_retried(tmp_path):
    url = f"flaky://transient-{tmp_path.name}/run"
    options = {"fail_rate": 0.3, "seed": 4}
    for step in (1, 2):
        zarrckpt.save_checkpoint(url, step, state(), storage_options=options, max_chunk_bytes=1024)
    restored, step = zarrckpt.load_checkpoint_if_it_exists(url, None, storage_options=options)
    assert step == 2 and np.array_equal(restored["w"], state()["w"]) and restored["step"] == 3
    assert FlakyFileSystem.injected > 20  # the faults really happened, and were absorbed


def test_persistent_failures_abort_with_nothing_committed(tmp_path):
    url = f"flaky://persistent-{tmp_path.name}/run"
    zarrckpt.save_checkpoint(url, 1, state(), storage_options={"fail_rate": 0.0})
    with pytest.raises(zarrckpt.CheckpointWriteError, match=r"connection reset.*after 11 tries"):
        zarrckpt.save_checkpoint(url, 2, state(), storage_options={"fail_rate": 1.0, "seed": 1})
    assert zarrckpt.all_steps(url, storage_options={"fail_rate": 0.0}) == [1]


def test_permanent_errors_are_not_retried(tmp_path):
    url = f"flaky://denied-{tmp_path.name}/run"
    with pytest.raises(zarrckpt.CheckpointWriteError, match=r"access denied") as info:
        zarrckpt.save_checkpoint(url, 1, state(), storage_options={"fail_rate": 1.0, "error": "denied"})
    assert "tries" not in str(info.value) and FlakyFileSystem.injected == 1


@pytest.mark.parametrize("key, what", [("w/zarr.json", "metadata"), ("w/c.1.0", r"chunk \[1, 0\]")])
def test_a_failed_write_names_its_leaf(tmp_path, key, what):
    """Whichever object of a leaf cannot be written, its array metadata or one chunk,
    the error names the leaf, and nothing is committed."""
    url = f"flaky://one-key-{tmp_path.name}/run"
    options = {"error": "denied", "fail_suffix": f"0000000001/{key}"}
    with pytest.raises(zarrckpt.CheckpointWriteError,
                       match=rf"writing leaf \['w'\] \(array 'w'\) {what}: PermissionError: .*access denied"):
        zarrckpt.save_checkpoint(url, 1, state(), storage_options=options, max_chunk_bytes=1024)
    assert zarrckpt.all_steps(url, storage_options=options) == []


def test_a_refused_save_stops_at_its_first_failure(tmp_path):
    """A store that resets every connection to one leaf's objects: once the first
    write has used up its retries, no new write starts and the writes in flight stop
    retrying (it used to try all 257 objects 7 times each), and nothing is committed."""
    url = f"flaky://refusing-{tmp_path.name}/run"
    options = {"fail_inside": "0000000001/w/"}
    tree = {"w": np.zeros((256, 64), np.float32)}  # 256 chunks of one row each
    with pytest.raises(zarrckpt.CheckpointWriteError, match=r"connection reset.*after 11 tries"):
        zarrckpt.save_checkpoint(url, 1, tree, storage_options=options, max_chunk_bytes=256, max_workers=4)
    assert zarrckpt.all_steps(url, storage_options=options) == []
    assert 7 <= FlakyFileSystem.injected <= 4 * (_storage.RETRIES + 1)
