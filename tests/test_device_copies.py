"""Copies off the devices for a save (zarrckpt._transfer): the pinned host memory path,
its fallback, what a snapshot guarantees, and what a save leaves behind.

The CPU backend has a `pinned_host` memory as accelerators do, so an async save on CPU
devices takes the same path as on a GPU; a sync save on CPU reads the device buffers in
place.
"""

import functools
import gc
import logging
import os
import weakref

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from builders import mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import zarrckpt
from zarrckpt._save import transfer as _transfer


def varied_state():
    """Leaves of every path a chunk can take: split shards (a replicated leaf dealt out
    over its replicas, sliced on the device), merged small shards, whole shards, odd
    dtypes, a typed key, numpy and Python leaves."""
    m = mesh()
    rng = np.random.default_rng(0)

    def put(host, spec):
        return jax.device_put(host, NamedSharding(m, spec))

    return {
        "replicated": put(rng.standard_normal((2048, 1024)).astype(np.float32), P()),  # 8 MiB: split 8 ways
        "rows": put(rng.standard_normal((64, 96)).astype(np.float32), P("data", "model")),  # merged
        "big": put(rng.standard_normal((2048, 1024)).astype(np.float32), P(("data", "model"))),
        "bf16": put(rng.standard_normal((16, 32)).astype(ml_dtypes.bfloat16), P(None, "model")),
        "int4": put(rng.integers(-8, 8, (8, 8)).astype(ml_dtypes.int4), P("data")),
        "mask": put(rng.random((40, 8)) > 0.5, P("data")),
        "key": jax.random.key(7),
        "step": jnp.array(12, jnp.int32),
        "host": rng.standard_normal(300),
        "lr": 0.5,
    }


def chunk_bytes(root):
    """Every chunk object of a checkpoint, by key."""
    out = {}
    for directory, _, names in os.walk(root):
        for name in names:
            if name.startswith("c."):
                path = os.path.join(directory, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = f.read()
    return out


def assert_restores(url, state):
    target = jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) and not jnp.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x, state)
    restored = zarrckpt.load_pytree(url, target)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(state)):
        if isinstance(want, jax.Array) and jnp.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))


def test_pinned_and_in_place_copies_write_identical_bytes(tmp_path):
    state = varied_state()
    zarrckpt.save_pytree(str(tmp_path / "sync"), state)  # CPU, not a snapshot: read in place
    with zarrckpt.CheckpointManager(str(tmp_path / "run")) as mgr:  # async: pinned host memory
        mgr.save(1, state)
    in_place, pinned = chunk_bytes(tmp_path / "sync"), chunk_bytes(tmp_path / "run" / "0000000001")
    assert len(in_place) > 20 and in_place.keys() == pinned.keys()
    assert [k for k in in_place if in_place[k] != pinned[k]] == []
    assert_restores(str(tmp_path / "run" / "0000000001"), state)


def test_a_device_without_pinned_memory_falls_back_to_pageable_copies(tmp_path, monkeypatch, caplog):
    state = varied_state()
    zarrckpt.save_pytree(str(tmp_path / "reference"), state)
    # No CPU build lacks a pinned host memory: pretend this one does.
    monkeypatch.setattr(_transfer, "has_pinned_memory", lambda device: False)
    _transfer._log_pageable.cache_clear()
    with caplog.at_level(logging.INFO, logger="zarrckpt"):
        with zarrckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
            mgr.save(1, state)
            mgr.save(2, state)
    assert [r.getMessage() for r in caplog.records if "pinned host memory" in r.getMessage()] == [
        "cpu devices have no pinned host memory: saves copy through pageable memory, which is slower"]
    assert chunk_bytes(tmp_path / "reference") == chunk_bytes(tmp_path / "run" / "0000000002")
    assert_restores(str(tmp_path / "run" / "0000000001"), state)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_an_async_save_is_a_snapshot_when_the_next_step_donates_at_once(tmp_path, monkeypatch, pinned):
    if not pinned:
        monkeypatch.setattr(_transfer, "has_pinned_memory", lambda device: False)
    m = mesh()

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state):
        return jax.tree.map(lambda x: x * 3 - 1, state)

    # 64 MiB, so that the copies are still running when `save` returns.
    state = {f"w{i}": jax.device_put(jnp.full((1024, 2048), float(i)), NamedSharding(m, P("data", "model")))
             for i in range(8)}
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        for step in range(1, 4):
            expected = {k: float(np.asarray(v[0, 0])) for k, v in state.items()}
            mgr.save(step, state)
            saved = state
            state = train_step(state)  # donates the buffers the save copies from
            assert all(v.is_deleted() for v in saved.values())  # donated at once: the save holds a copy
            mgr.wait()
            restored = zarrckpt.load_checkpoint(str(tmp_path), step)
            for key, value in expected.items():
                np.testing.assert_array_equal(restored[key], np.full((1024, 2048), value, np.float32), err_msg=key)


def test_numpy_leaves_are_copied_before_an_async_save_returns(tmp_path):
    host = np.arange(1000.0)
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"host": host, "w": jnp.ones(4)})
        host[:] = -1  # the caller reuses its buffer at once
    np.testing.assert_array_equal(zarrckpt.load_checkpoint(str(tmp_path), 1)["host"], np.arange(1000.0))


def test_many_leaves_go_out_in_one_batched_transfer(tmp_path, monkeypatch):
    m = mesh()
    state = {f"layer{i:03d}": {"w": jax.device_put(jnp.full((8, 64), float(i)), NamedSharding(m, P(None, "model"))),
                               "b": jax.device_put(jnp.full((64,), -float(i)), NamedSharding(m, P()))}
             for i in range(300)}
    calls = []
    real = _transfer.jax.device_put
    monkeypatch.setattr(_transfer.jax, "device_put", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
    assert len(calls) == 1 and calls[0] >= 600  # every leaf's shards in one call
    restored = zarrckpt.load_checkpoint(str(tmp_path), 1)
    for i in (0, 151, 299):
        np.testing.assert_array_equal(restored[f"layer{i:03d}"]["w"], np.full((8, 64), float(i), np.float32))
        np.testing.assert_array_equal(restored[f"layer{i:03d}"]["b"], np.full((64,), -float(i), np.float32))


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_state_larger_than_the_budget_goes_out_in_several_batches(tmp_path, monkeypatch, async_save):
    state = {f"l{i}": jax.device_put(jnp.full((256, 256), float(i)), NamedSharding(mesh(), P("data")))
             for i in range(8)}  # 256 KiB each
    calls = []
    real = _transfer.jax.device_put
    monkeypatch.setattr(_transfer.jax, "device_put", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    with zarrckpt.CheckpointManager(str(tmp_path), async_save=async_save, max_inflight_bytes=600 * 1024) as mgr:
        mgr.save(1, state)
    if async_save:
        assert len(calls) > 2  # at most two leaves' copies at a time
    restored = zarrckpt.load_checkpoint(str(tmp_path), 1)
    for key, value in state.items():
        np.testing.assert_array_equal(restored[key], np.asarray(value))


@pytest.mark.parametrize("how", ["save_pytree", "async manager", "sync manager"])
def test_a_saved_state_is_freed_as_soon_as_the_caller_drops_it(tmp_path, how):
    """No reference cycle keeps the caller's arrays (device memory, on an accelerator)
    alive after a save until the garbage collector happens to run."""
    state = varied_state()
    alive = [weakref.ref(x) for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    gc.collect()
    gc.disable()
    try:
        if how == "save_pytree":
            zarrckpt.save_pytree(str(tmp_path / "ckpt"), state)
        else:
            with zarrckpt.CheckpointManager(str(tmp_path / "run"), async_save=how == "async manager") as mgr:
                mgr.save(1, state)
                mgr.save(1, state, force=True)  # already committed: not saved again
        del state
        assert [r for r in alive if r() is not None] == []
    finally:
        gc.enable()


def record_device_puts(monkeypatch):
    """The items of every `device_put` a save makes, as (shape, sharding) pairs."""
    calls = []
    real = _transfer.jax.device_put

    def device_put(xs, shardings, **kw):
        calls.append([(x.shape, s) for x, s in zip(xs, shardings)])
        return real(xs, shardings, **kw)

    monkeypatch.setattr(_transfer.jax, "device_put", device_put)
    return calls


def test_an_array_whose_every_shard_is_written_is_copied_as_one_array(tmp_path, monkeypatch):
    """600 leaves of 8 shards were 4,800 `device_put` items, tens of microseconds each."""
    sharding = NamedSharding(mesh(), P(("data", "model")))
    state = {f"w{i:02d}": jax.device_put(jnp.full((64, 32), float(i)), sharding) for i in range(40)}
    calls = record_device_puts(monkeypatch)
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
    assert calls == [[((64, 32), sharding.with_memory_kind("pinned_host"))] * 40]
    assert_restores(str(tmp_path / "0000000001"), state)


def test_a_replicated_shard_is_copied_once_whole_not_sliced_on_its_devices(tmp_path, monkeypatch):
    """Its chunks are dealt over its replicas, but on one host they are all read from one
    copy of the shard: slicing it on the devices first is a copy of its own (on CPU
    devices, on the training thread)."""
    state = {"replicated": jax.device_put(jnp.arange(2048 * 1024, dtype=jnp.float32).reshape(2048, 1024),
                                          NamedSharding(mesh(), P())),  # 8 MiB: 8 chunks, one per replica
             "rows": jax.device_put(jnp.ones((2048, 1024)), NamedSharding(mesh(), P("data")))}  # 4 replicas
    calls = record_device_puts(monkeypatch)
    monkeypatch.setattr(_transfer, "_slicer", lambda bounds: pytest.fail("sliced on the device"))
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
    assert [[shape for shape, _ in call] for call in calls] == [[(2048, 1024), (1024, 1024), (1024, 1024)]]
    assert len(chunk_bytes(tmp_path / "0000000001" / "replicated")) == 8
    assert_restores(str(tmp_path / "0000000001"), state)


def test_an_array_larger_than_the_budget_is_copied_part_by_part(tmp_path, monkeypatch):
    state = {"replicated": jax.device_put(jnp.arange(2048 * 1024, dtype=jnp.float32).reshape(2048, 1024),
                                          NamedSharding(mesh(), P()))}  # 8 chunks of 1 MiB
    calls = record_device_puts(monkeypatch)
    with zarrckpt.CheckpointManager(str(tmp_path), max_inflight_bytes=3 * 2**20) as mgr:
        mgr.save(1, state)
    assert len(calls) >= 3 and all(shape == (256, 1024) for call in calls for shape, _ in call)
    assert_restores(str(tmp_path / "0000000001"), state)


def test_chunks_that_share_a_copy_give_their_budget_back_together():
    """The copy's memory is only freed once every chunk read from it is written."""
    from zarrckpt._options import SaveOptions
    from zarrckpt._save.protocol import SaveJob

    state = {"a": jax.device_put(jnp.ones((2048, 1024)), NamedSharding(mesh(), P())),  # 8 chunks, one copy
             "b": jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh(), P()))}
    job = SaveJob.create(None, state, SaveOptions())
    work = list(job.admitted(snapshot=True))
    a = [unit for plan, unit in work if plan.leaf.name == "a"]
    b = [unit for plan, unit in work if plan.leaf.name == "b"]
    assert len(a) == 8 and len(b) == 1
    for unit in a[:-1]:
        unit.release()
    assert job.budget._used == sum(u.nbytes for u in a + b)
    a[-1].release()
    a[-1].release()  # a second release gives nothing back twice
    assert job.budget._used == b[0].nbytes
    b[0].release()
    assert job.budget._used == 0


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_a_chunk_read_from_a_pinned_copy_keeps_the_copy_alive(dtype):
    """A writer may drop the last unit of a copy while another thread still reads a
    chunk of it: the chunk's view must keep the buffer it reads (and the copy) alive,
    and must hold it by nothing but Python references: on the GPU runtime, a buffer
    destroyed while a numpy view held it through the runtime aborted the process."""
    from zarrckpt._save.host_copies import HostCopy

    values = np.arange(4096, dtype=np.float32).reshape(64, 64).astype(dtype)
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=_transfer.PINNED)
    (array,) = jax.device_put([jnp.asarray(values)], [pinned], may_alias=False)
    copy = HostCopy(array)
    chunk = copy.view(None, (slice(8, 16), slice(None)))
    alive = weakref.ref(array)
    del copy, array
    gc.collect()
    assert alive() is not None  # the view holds it
    again = jax.device_put([jnp.asarray(values) + 1], [pinned], may_alias=False)  # memory that may be reused
    np.testing.assert_array_equal(chunk, values[8:16])
    assert chunk.base is not None and not chunk.flags.writeable
    del chunk, again
    gc.collect()
    assert alive() is None  # and lets it go with the last view


class _Finalized:
    """Garbage in a cycle whose finalizer runs Python: a collection triggered inside
    jax's C++ then lets other threads run there, as a busy training process's does."""

    def __init__(self):
        self.me = self

    def __del__(self):
        sum(range(20))


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned copy", "caller's array in place"])
def test_writers_reading_one_copy_at_once_each_find_their_shard(pinned):
    """Writers read chunks of one host copy at the same moment, each of them maybe the
    first to ask jax about it (its shards, a shard's buffer). jaxlib before 0.12 filled
    an array's list of shards on first use without a lock: a second thread asking got a
    short or doubled list, a save failed once in thousands with `KeyError:
    CpuDevice(id=5)`, and jax kept the wrong list on the array. Here 8 writers start
    together on a fresh copy, 200 times, with finalizers making threads switch inside
    jax (before the fix: about 40% of rounds failed)."""
    import sys
    import threading

    from zarrckpt._save.host_copies import HostCopy

    sharding = NamedSharding(mesh(), P("data", "model"))
    values = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    source = jax.device_put(values, sharding)
    devices = [shard.device for shard in source.addressable_shards]
    regions = {shard.device: shard.index for shard in source.addressable_shards}
    threshold, interval = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(1, 1, 1)
    sys.setswitchinterval(1e-6)
    failures = []
    try:
        for _ in range(200):
            if pinned:
                (array,) = jax.device_put([source], [sharding.with_memory_kind(_transfer.PINNED)], may_alias=False)
            else:
                array = jax.device_put(values, sharding)
            copy = HostCopy(array)
            start = threading.Barrier(len(devices))

            def read(device, copy=copy, start=start):
                _Finalized()
                start.wait()
                try:
                    np.testing.assert_array_equal(copy.view(device, None), values[regions[device]])
                except Exception as e:
                    failures.append(f"{device}: {type(e).__name__}: {e}")

            readers = [threading.Thread(target=read, args=(device,)) for device in devices]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join()
            assert len(array.addressable_shards) == len(devices), "jax kept a wrong list of the array's shards"
    finally:
        gc.set_threshold(*threshold)
        sys.setswitchinterval(interval)
    assert failures == []
