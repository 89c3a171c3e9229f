"""Committed means durable: on a local disk every object of a checkpoint is on stable
storage before its commit marker is written, the marker before the save returns, and
retention deletes older steps only after that.

The writes and syncs are recorded as they happen (the real calls, wrapped), with the
file or directory each one wrote or synced, so the order is checked, not assumed: with
a sync of each file and directory, and with the one `syncfs` that ends a save's writes
where the file system allows it (`_storage.local.WriteBatch`).
"""

import errno
import os
import threading

import numpy as np
import pytest

import zarrckpt
from zarrckpt import _commit
from zarrckpt._storage import local as _local


@pytest.fixture(params=["one syncfs", "file by file"])
def events(request, monkeypatch):
    """Every write, link, sync, rename and deletion of a checkpoint, in order: (what, path)."""
    seen: list[tuple[str, str]] = []
    if request.param == "one syncfs" and _local._SYNCFS is None:
        pytest.skip("no syncfs here")
    # Whatever this file system is: the order is what is checked.
    monkeypatch.setattr(_local, "_syncs_whole", lambda device: request.param == "one syncfs")

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
    write, link, syncfs = os.write, os.link, _local._SYNCFS

    def writing(fd, data):
        seen.append(("write", path_of(fd)))
        return write(fd, data)

    def linking(src, dst, *, src_dir_fd=None, dst_dir_fd=None, follow_symlinks=True):
        seen.append(("link", os.path.join(path_of(dst_dir_fd), dst) if dst_dir_fd is not None else str(dst)))
        return link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks)

    def syncing_all(fd):
        seen.append(("syncfs", path_of(fd)))
        return syncfs(fd)

    mkdir = os.mkdir

    def making(path, mode=0o777, *, dir_fd=None):  # a new entry in its parent
        seen.append(("write", os.path.join(path_of(dir_fd), path) if dir_fd is not None else str(path)))
        return mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "write", writing)
    monkeypatch.setattr(os, "link", linking)
    monkeypatch.setattr(os, "mkdir", making)
    monkeypatch.setattr(_local, "_SYNCFS", syncing_all)
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


def synced_before(events: list[tuple[str, str]], end: int, path: str) -> bool:
    """Whether `path` (a file, or a directory: what was written or linked inside it) was
    on stable storage at event `end`: synced itself, or its whole file system, after the
    last write to it. A file made only by a hard link is the file it links, which the
    save that wrote it synced before its own commit: what the link adds is an entry of
    its directory, which is looked at as the directory's."""
    written = [i for i, (what, where) in enumerate(events[:end])  # not the commit's own file, written aside
               if not where.endswith(".tmp") and (what in ("write", "rename") and where == path
                                                  or what in ("write", "rename", "link")
                                                  and os.path.dirname(where) == path)]
    if not written and ("link", path) in events[:end]:
        return True
    last = written[-1] if written else -1
    return any(what == "syncfs" or what in ("fsync", "fdatasync") and where == path  # one file system here
               for what, where in events[last + 1:end])


@pytest.mark.parametrize("kept", ["as many directories as are written", "one directory"])
def test_a_commit_is_on_stable_storage_before_its_marker(tmp_path, events, kept, monkeypatch):
    if kept == "one directory":  # the others are opened and closed as each is written
        monkeypatch.setattr(_local, "_KEPT_DIRECTORIES", 1)
    run = tmp_path / "run"
    state = {"w": np.arange(2**16, dtype=np.float32), "b": np.ones(8), "step": 1}
    with zarrckpt.CheckpointManager(str(run), keep_last=1) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)  # its retention deletes step 1; its chunks are step 1's, linked
    step = run / "0000000002"
    marker = str(step / "zarr.json")
    commit = events.index(("rename", marker), events.index(("rename", marker)) + 1)  # the second: the commit
    assert any(what == "link" and where.startswith(str(step)) for what, where in events[:commit])
    files = [str(p) for p in step.rglob("*") if p.is_file() and p != step / "zarr.json"]
    assert len(files) == 6 and [f for f in files if not synced_before(events, commit, f)] == []  # chunks, metadata
    directories = [str(p) for p in step.rglob("*") if p.is_dir()]
    assert len(directories) == 3  # w, b, step
    assert [d for d in [*directories, str(step)] if not synced_before(events, commit, d)] == []
    if not _local._syncs_whole(os.stat(step).st_dev):  # each array directory once, not once per entry
        assert sorted(where for what, where in events[:commit] if what == "fsync" and where in directories) == sorted(
            directories)
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
    files = [str(p) for p in dst.rglob("*") if p.is_file() and p != dst / "zarr.json"]
    assert files and [f for f in files if not synced_before(events, commit, f)] == []
    assert synced_before(events, commit, str(dst / "w")) and synced_before(events, commit, str(dst / "b"))
    assert events[commit + 1] == ("fsync", str(dst))


def test_a_writer_left_running_past_the_end_of_writes_made_together_keeps_its_directory(tmp_path):
    """A second Ctrl-C can cut a save's join short while a writer thread still writes:
    the directory it holds stays its own until it is done (a descriptor closed under it
    could be given to another file, and its writes land there), no call starts after
    the end, and every descriptor is closed once the last call ends."""
    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to tell where a descriptor leads")
    opened = len(os.listdir("/proc/self/fd"))
    together = _local.WriteBatch(str(tmp_path))
    inside, leave, seen = threading.Event(), threading.Event(), {}

    def writer():
        with together.directory("a") as (fd, _):
            inside.set()
            leave.wait(30)
            seen["a"] = os.readlink(f"/proc/self/fd/{fd}")

    thread = threading.Thread(target=writer)
    thread.start()
    assert inside.wait(30)
    with pytest.raises(KeyboardInterrupt), together:
        raise KeyboardInterrupt
    with pytest.raises(OSError), together.directory("b"):
        pass
    assert len(os.listdir("/proc/self/fd")) > opened  # still held for the writer
    leave.set()
    thread.join(30)
    assert seen["a"] == str(tmp_path / "a")
    assert len(os.listdir("/proc/self/fd")) == opened


def test_ext4_syncs_a_save_whole_only_with_its_journal(tmp_path):
    """Without a journal ext4 keeps directory blocks and bitmaps in the block device's
    cache, which `syncfs` writes out after its flush of the disk's cache: a save there
    must sync file by file. The journal is told here by jbd2's own entry for the device,
    not by what zarrckpt reads."""
    device = os.stat(tmp_path).st_dev
    try:
        name = os.path.basename(os.readlink(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"))
        journals = os.listdir("/proc/fs/jbd2") if os.path.isdir("/proc/fs/jbd2") else []
    except OSError:
        pytest.skip("no /sys or /proc here to tell the file system's device")
    if not os.path.isdir(f"/proc/fs/ext4/{name}") or _local._SYNCFS is None or _local._kernel() < (5, 17):
        pytest.skip("the test directory is not on ext4, or this kernel never syncs a save whole")
    journaled = any(entry.startswith(f"{name}-") for entry in journals)
    assert _local._syncs_whole(device) == journaled


def test_a_sync_failing_where_a_save_s_writes_end_fails_the_save_and_commits_nothing(tmp_path, events, monkeypatch):
    """What a save writes together is synced when the writes end (one `syncfs`, or each
    directory they made entries in, once): a sync that fails there (EIO: the disk lost
    what it had been given) fails the save, nothing of it is committed, and the next
    save commits."""
    run = tmp_path / "run"
    state = {"w": np.arange(2**16, dtype=np.float32), "b": np.ones(8)}
    failing = str(run / "0000000002" / "w")  # an array's directory: synced with the save's writes
    fsync, syncfs = os.fsync, _local._SYNCFS

    def lost(sync, where):
        def call(fd):
            if where is None or os.readlink(f"/proc/self/fd/{fd}") == where:
                raise OSError(errno.EIO, "Input/output error")
            return sync(fd)
        return call

    with zarrckpt.CheckpointManager(str(run), async_save=False) as mgr:
        mgr.save(1, state)
        monkeypatch.setattr(os, "fsync", lost(fsync, failing))
        monkeypatch.setattr(_local, "_SYNCFS", lost(syncfs, None))  # a save's writes end with its only one
        with pytest.raises(zarrckpt.CheckpointWriteError) as raised:
            mgr.save(2, state)
        assert zarrckpt.all_steps(str(run)) == [1]
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(_local, "_SYNCFS", syncfs)
        mgr.save(3, state)
    assert zarrckpt.all_steps(str(run)) == [1, 3]
    error, seen = raised.value, []
    while error is not None:
        seen.append(getattr(error, "errno", None))
        error = error.__cause__ or error.__context__
    assert errno.EIO in seen
