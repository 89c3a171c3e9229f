"""A full disk fails the save cleanly: an error naming the leaf, nothing committed, the
earlier checkpoints intact, and the same step saves once there is room."""

import numpy as np
import pytest

import zarrckpt


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
