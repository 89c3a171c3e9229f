"""Host memory of a restore onto CPU devices: a leaf read whole becomes the device
arrays' memory (every replica's), not a second copy of it."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from builders import mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import zarrckpt
from zarrckpt._restore.checkpoint import aligned_empty


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (7,), (5, 3, 2), (1024, 33)])
@pytest.mark.parametrize("dtype", [np.uint8, np.bool_, np.float32, np.complex128, ml_dtypes.bfloat16])
def test_aligned_empty_is_a_c_contiguous_array_on_a_64_byte_boundary(shape, dtype) -> None:
    out = aligned_empty(shape, np.dtype(dtype))
    assert (out.shape, out.dtype, out.flags.c_contiguous, out.flags.writeable) == (shape, dtype, True, True)
    assert out.size == 0 or out.ctypes.data % 64 == 0


def test_a_restored_leaf_on_cpu_devices_is_the_memory_it_was_read_into(tmp_path) -> None:
    devices = mesh()
    # Placed by the main thread (4 MiB) and by the readers (20 MiB); larger than malloc's
    # mmap threshold, whose blocks start 16 bytes into a page.
    small = np.arange(2**20, dtype=np.float32).reshape(1024, 1024)
    large = np.arange(5 * 2**20, dtype=np.float32).reshape(2048, 2560)
    sharded = NamedSharding(devices, P("data"))  # two shards, each on the 4 devices of the model axis
    replicated = NamedSharding(devices, P())
    values = {"small": small, "large": large, "small_whole": small, "large_whole": large}
    state = {name: jax.device_put(value, replicated if name.endswith("whole") else sharded)
             for name, value in values.items()}
    zarrckpt.save_pytree(str(tmp_path / "ckpt"), state)

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = zarrckpt.load_pytree(str(tmp_path / "ckpt"), target=target)

    for name, leaf in restored.items():
        np.testing.assert_array_equal(np.asarray(leaf), values[name])
        buffers = {}
        for shard in leaf.addressable_shards:
            buffers.setdefault(str(shard.index), set()).add(shard.data.unsafe_buffer_pointer())
        assert all(len(pointers) == 1 for pointers in buffers.values()), (name, buffers)
