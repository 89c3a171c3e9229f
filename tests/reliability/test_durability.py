"""Committed means durable: on a local disk every object of a checkpoint is on stable
storage before its commit marker is written, the marker before the save returns, and
retention deletes older steps only after that.

The syncs are recorded as they happen (the real calls, wrapped), with the file or
directory each one synced, so the order is checked, not assumed.
"""

import os

import numpy as np
import pytest

import zarrckpt
from zarrckpt import _commit


@pytest.fixture
def events(monkeypatch):
    """Every sync, rename and deletion of a checkpoint, in order: (what, path)."""
    seen: list[tuple[str, str]] = []

    def path_of(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    def wrap(name):
        original = getattr(os, name)

        def call(fd):
            seen.append((name, path_of(fd)))
            return original(fd)
        monkeypatch.setattr(os, name, call)

    wrap("fdatasync")
    wrap("fsync")
    replace = os.replace

    def renaming(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        seen.append(("rename", os.path.join(path_of(dst_dir_fd), dst) if dst_dir_fd is not None else str(dst)))
        return replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(os, "replace", renaming)
    remove = _commit.remove
    monkeypatch.setattr(_commit, "remove", lambda loc: (seen.append(("delete", loc.path)), remove(loc))[1])
    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to tell which file a sync was for")
    return seen


def test_a_commit_is_on_stable_storage_before_its_marker(tmp_path, events):
    run = tmp_path / "run"
    state = {"w": np.arange(2**16, dtype=np.float32), "b": np.ones(8), "step": 1}
    with zarrckpt.CheckpointManager(str(run), keep_last=1) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)  # its retention deletes step 1
    step = run / "0000000002"
    marker = str(step / "zarr.json")
    commit = events.index(("rename", marker), events.index(("rename", marker)) + 1)  # the second: the commit
    before = {path for _, path in events[:commit]}
    files = [str(p) for p in step.rglob("*") if p.is_file() and p != step / "zarr.json"]
    assert len(files) == 6 and [f for f in files if f not in before] == []  # every chunk and array metadata
    assert {str(step / "w"), str(step / "b"), str(step / "step"), str(step)} <= before  # every directory
    after = events[commit + 1:]
    assert after[0] == ("fsync", str(step))  # the marker's rename, durable before anything else happens
    assert ("delete", str(run / "0000000001")) in after  # retention: only once step 2 is durable
    assert zarrckpt.all_steps(str(run)) == [2]


def test_a_copy_is_on_stable_storage_before_its_marker(tmp_path, events):
    zarrckpt.save_pytree(str(tmp_path / "src"), {"w": np.arange(1000.0), "b": np.ones(3)})
    events.clear()
    zarrckpt.copy_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"))
    dst = tmp_path / "dst"
    commit = max(i for i, event in enumerate(events) if event == ("rename", str(dst / "zarr.json")))
    before = {path for _, path in events[:commit]}
    assert {str(p) for p in dst.rglob("*") if p.is_file() and p != dst / "zarr.json"} <= before
    assert {str(dst / "w"), str(dst / "b")} <= before and events[commit + 1] == ("fsync", str(dst))
