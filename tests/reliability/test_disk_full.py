"""A full disk fails the save cleanly: an error naming the leaf, nothing committed, the
earlier checkpoints intact, and the same step saves once there is room. A manager's
save that fills the disk removes what it wrote at once, and once room is freed the
next save commits, making its unchanged chunks from the last committed step."""

import contextlib
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import zarrckpt
from zarrckpt._util import stats as _stats


def state(mib: int, value: float) -> dict:
    return {"w": np.full((mib, 2**18), value, np.float32)}  # 1 MiB per row


def test_disk_full(small_disk):
    directory = str(small_disk / "run")
    zarrckpt.save_checkpoint(directory, 1, state(1, 1.0))
    with pytest.raises(zarrckpt.CheckpointWriteError, match=r"No space left on device") as info:
        zarrckpt.save_checkpoint(directory, 2, state(4, 2.0), max_chunk_bytes=2**20)
    assert "['w']" in str(info.value) and "nothing was committed" in str(info.value)
    assert zarrckpt.all_steps(directory) == [1]
    np.testing.assert_array_equal(zarrckpt.load_pytree(f"{directory}/0000000001")["w"], state(1, 1.0)["w"])
    zarrckpt.save_checkpoint(directory, 2, state(1, 2.0))  # the leftover is cleared, and it fits
    assert zarrckpt.all_steps(directory) == [1, 2]


FROZEN = jnp.arange(5 * 2**16, dtype=jnp.float32)  # 1.25 MiB, the very same array at every save


def training(step: int) -> dict:
    """A fine-tune's state: a large frozen leaf, and a changing one of 0.5 MiB. On the 3 MiB
    disk a step after the first fits only if the frozen leaf is linked, not written."""
    return {"frozen": FROZEN, "changing": jnp.full(2**17, step, jnp.float32)}


def fill(disk: Path, name: str, *, leave: int = 0) -> Path:
    """Someone's file taking the room left on `disk` but about `leave` bytes (all of it,
    to the last byte a file can take, with 0)."""
    path = disk / name

    def room() -> int:
        found = os.statvfs(disk)
        return found.f_bavail * found.f_frsize

    with open(path, "ab", buffering=0) as f, contextlib.suppress(OSError):  # ENOSPC: full
        while room() > leave:
            f.write(bytes(min(2**16, room() - leave)))
    return path


def inodes(step: Path, leaf: str) -> dict[str, int]:
    return {str(p.relative_to(step)): p.stat().st_ino for p in (step / leaf).rglob("c*") if p.is_file()}


def test_a_save_that_fills_the_disk_removes_what_it_wrote_and_after_room_is_freed_the_next_reuses(small_disk):
    run = small_disk / "run"
    with zarrckpt.CheckpointManager(str(run)) as mgr:
        mgr.save(1, training(1))
        mgr.wait()
        filler = fill(small_disk, "someone's file", leave=256 * 2**10)
        mgr.save(2, training(2))
        with pytest.raises(zarrckpt.CheckpointWriteError, match="No space left on device"):
            mgr.wait()
        assert not (run / "0000000002").exists()  # gone as soon as the failure is known
        filler.unlink()  # the user frees room
        _stats.reset()
        mgr.save(3, training(3))
        mgr.wait()
        written = _stats.snapshot().get("store_bytes_written", 0)
    assert zarrckpt.all_steps(str(run)) == [1, 3]
    assert written < FROZEN.nbytes  # the changing leaf and metadata: the frozen leaf is linked
    assert inodes(run / "0000000003", "frozen") == inodes(run / "0000000001", "frozen") != {}
    restored = zarrckpt.load_checkpoint(str(run), 3)
    np.testing.assert_array_equal(restored["frozen"], np.asarray(FROZEN))
    np.testing.assert_array_equal(restored["changing"], np.full(2**17, 3, np.float32))
    assert zarrckpt.verify(str(run / "0000000003")).ok


@pytest.mark.parametrize("reported_by", ["wait", "close"])
def test_close_after_a_save_failed_on_a_full_disk_reports_it_once_and_gives_the_run_back(small_disk, reported_by):
    """The disk stays full to its last byte at `close`: the lease, which cannot be marked
    released there, is given back all the same, and the save's error is raised once, by
    the first call after it (`wait`, or else `close`), never the lease's ENOSPC."""
    run = small_disk / "run"
    mgr = zarrckpt.CheckpointManager(str(run))
    mgr.save(1, training(1))
    mgr.wait()
    fillers = [fill(small_disk, "someone's file", leave=256 * 2**10 if reported_by == "wait" else 0)]
    mgr.save(2, training(2))
    if reported_by == "wait":
        with pytest.raises(zarrckpt.CheckpointWriteError, match="No space left on device"):
            mgr.wait()
        fillers.append(fill(small_disk, "someone else's file"))  # to the last byte
        mgr.close()
    else:
        with pytest.raises(zarrckpt.CheckpointWriteError, match="No space left on device"):
            mgr.close()
    mgr.close()  # said once
    for filler in fillers:
        filler.unlink()
    with zarrckpt.CheckpointManager(str(run)) as again:  # the run is free
        assert again.all_steps() == [1]
