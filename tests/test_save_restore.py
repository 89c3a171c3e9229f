"""Round trips of every leaf kind and dtype, onto other meshes, on every store."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import zarr
from builders import mesh, train_state
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import zarrckpt
from zarrckpt import _storage

DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128, ml_dtypes.bfloat16,
          ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4]


def values(dtype, shape):
    raw = np.random.default_rng(0).integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize,
                                            dtype=np.uint8)
    if np.dtype(dtype) == np.bool_:
        return (raw % 2).astype(np.bool_).reshape(shape)
    if np.dtype(dtype) == ml_dtypes.int4:
        return (raw.astype(np.int8) % 8).astype(dtype).reshape(shape)
    return raw.view(dtype).reshape(shape)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_every_dtype_round_trips_bit_exactly(store):
    m = mesh((2, 4), ("a", "b"))
    tree = {}
    for dt in DTYPES:
        name = np.dtype(dt).name
        host = values(dt, (8, 16))
        tree[f"np_{name}"] = host
        if np.dtype(dt) not in (np.dtype(np.float64), np.dtype(np.complex128), np.dtype(np.int64),
                                np.dtype(np.uint64)):  # jax runs with x64 off
            tree[f"jax_{name}"] = jax.device_put(host, NamedSharding(m, P("a", "b")))
    zarrckpt.save_pytree(store.url, tree, storage_options=store.options)
    plain = zarrckpt.load_pytree(store.url, storage_options=store.options)
    for key, value in tree.items():
        assert same_bits(plain[key], value), key
    onto = zarrckpt.load_pytree(store.url, jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh((8,), ("x",)), P(None, "x")))
        if isinstance(x, jax.Array) else x, tree), storage_options=store.options)
    for key, value in tree.items():
        assert same_bits(onto[key], value), key


def test_a_save_without_checksums_round_trips(store):
    """`checksums=False` stores each chunk as its bytes alone, one buffer handed to the
    store as it is (before, gcsfs was given the numpy array and failed every write)."""
    tree = {"w": jax.device_put(values(np.float32, (8, 16)), NamedSharding(mesh((8,), ("x",)), P("x"))),
            "h": values(np.int16, (5,))}
    zarrckpt.save_pytree(store.url, tree, storage_options=store.options, checksums=False)
    restored = zarrckpt.load_pytree(store.url, storage_options=store.options)
    for key, value in tree.items():
        assert same_bits(restored[key], value), key


def test_scalars_and_host_leaves(store):
    tree = {"i": 3, "f": 2.5, "b": True, "c": 1 + 2j, "np_f32": np.float32(1.5), "np_i8": np.int8(-3),
            "zero_d": np.array(7, np.int16), "empty": np.zeros((0, 3), np.float32), "key": jax.random.PRNGKey(1)}
    zarrckpt.save_pytree(store.url, tree, storage_options=store.options)
    back = zarrckpt.load_pytree(store.url, storage_options=store.options)
    for key in ("i", "f", "b", "c"):
        assert type(back[key]) is type(tree[key]) and back[key] == tree[key]
    assert back["np_f32"] == np.float32(1.5) and back["np_f32"].dtype == np.float32
    assert back["np_i8"].dtype == np.int8 and back["zero_d"].shape == ()
    assert back["empty"].shape == (0, 3)
    assert np.array_equal(back["key"], tree["key"])
    with_target = zarrckpt.load_pytree(store.url, tree, storage_options=store.options)
    assert with_target["i"] == 3 and isinstance(with_target["key"], jax.Array)


SAVE_LAYOUTS = {
    "rows": (mesh((2, 4), ("a", "b")), P("a")),
    "cols": (mesh((2, 4), ("a", "b")), P(None, "b")),
    "both": (mesh((2, 4), ("a", "b")), P("a", "b")),
    "replicated": (mesh((2, 4), ("a", "b")), P()),
    "single_device": (None, None),
}
RESTORE_LAYOUTS = {
    "flat8": (mesh((8,), ("x",)), P("x")),
    "4x2_transposed": (mesh((4, 2), ("a", "b")), P("b", "a")),
    "2x2_subset": (mesh((2, 2), ("a", "b")), P(None, "a")),
    "replicated": (mesh((4, 2), ("a", "b")), P()),
    "single_device": (None, None),
}


def place(x, layout):
    m, spec = layout
    sharding = SingleDeviceSharding(jax.devices()[3]) if m is None else NamedSharding(m, spec)
    return jax.device_put(x, sharding), sharding


@pytest.mark.parametrize("restore_as", RESTORE_LAYOUTS)
@pytest.mark.parametrize("saved_as", SAVE_LAYOUTS)
@pytest.mark.parametrize("store", ["local", "s3", "gcs"], indirect=True)
def test_restore_onto_another_mesh(store, saved_as, restore_as):
    x = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)
    # By default shards this small are merged into one 16x32 chunk, and every target
    # would read one whole chunk: min_chunk_bytes=1 keeps the shards' grid, and chunks
    # of at most 512 bytes split even a replicated or single-device source into
    # several, so each target shard is cut out of chunks laid out on another grid.
    zarrckpt.save_pytree(store.url, {"x": place(x, SAVE_LAYOUTS[saved_as])[0]}, storage_options=store.options,
                         min_chunk_bytes=1, max_chunk_bytes=512)
    saved = zarr.open_array(f"{store.url}/x", mode="r", storage_options=store.options)
    assert saved.nchunks > 1, (saved_as, saved.chunks)
    _, sharding = place(x, RESTORE_LAYOUTS[restore_as])
    back = zarrckpt.load_pytree(store.url, {"x": sharding}, storage_options=store.options)["x"]
    assert back.sharding == sharding
    for shard in back.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])


def test_target_kinds(tmp_path):
    url = str(tmp_path / "c")
    m = mesh((2, 4), ("a", "b"))
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    zarrckpt.save_pytree(url, {"a": x, "b": x, "c": x, "d": x})
    sharding = NamedSharding(m, P("a", "b"))
    back = zarrckpt.load_pytree(url, {
        "a": jax.device_put(np.zeros_like(x), sharding),  # a live array: its sharding is used
        "b": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        "c": jax.ShapeDtypeStruct(x.shape, x.dtype),  # no sharding: the default device
        "d": np.zeros_like(x),
    })
    assert back["a"].sharding == sharding and back["b"].sharding == sharding
    assert isinstance(back["c"], jax.Array) and isinstance(back["d"], np.ndarray)
    for v in back.values():
        np.testing.assert_array_equal(np.asarray(v), x)


def test_target_arrays_are_freed_before_reading(tmp_path):
    url = str(tmp_path / "c")
    state = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    zarrckpt.save_pytree(url, state)
    target = {"w": jnp.full((4, 4), 7.0), "b": jnp.full(4, 7.0)}
    back = zarrckpt.load_pytree(url, target, donate_target=True)
    assert all(t.is_deleted() for t in target.values())
    np.testing.assert_array_equal(back["w"], np.ones((4, 4)))
    kept = {"w": jnp.full((4, 4), 7.0), "b": jnp.full(4, 7.0)}
    zarrckpt.load_pytree(url, kept)  # donation is opt-in (issue 10)
    assert not any(t.is_deleted() for t in kept.values())


def test_dtype_cast_only_when_asked(tmp_path):
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"w": np.arange(4, dtype=np.float32)})
    target = {"w": jax.ShapeDtypeStruct((4,), jnp.bfloat16, sharding=NamedSharding(mesh((2,), ("x",)), P("x")))}
    with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"\['w'\]: dtype float32 in the checkpoint, "
                                                               r"bfloat16 in the target \(pass allow_dtype_cast"):
        zarrckpt.load_pytree(url, target)
    back = zarrckpt.load_pytree(url, target, allow_dtype_cast=True)
    assert back["w"].dtype == jnp.bfloat16 and np.array_equal(np.asarray(back["w"], np.float32), np.arange(4))


class CountingStore:
    """Records every object zarrckpt reads from storage."""

    def __init__(self, monkeypatch):
        self.keys = []
        read, read_into = _storage.Location.read, _storage.Location.read_into

        def counted_read(loc, key, **options):
            self.keys.append(key)
            return read(loc, key, **options)

        def counted_read_into(loc, key, *buffers, **options):
            self.keys.append(key)
            return read_into(loc, key, *buffers, **options)

        monkeypatch.setattr(_storage.Location, "read", counted_read)
        monkeypatch.setattr(_storage.Location, "read_into", counted_read_into)

    def chunk_reads(self):
        return [k for k in self.keys if "/c." in k or k.endswith("/c")]


def test_each_chunk_read_once_per_process(tmp_path, monkeypatch):
    url = str(tmp_path / "c")
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    sharded = jax.device_put(x, NamedSharding(mesh((2, 4), ("a", "b")), P("a", "b")))
    zarrckpt.save_pytree(url, {"x": sharded}, min_chunk_bytes=1)
    counter = CountingStore(monkeypatch)
    # Replicated over 8 devices, and split more finely than the saved chunks (32 x 16).
    for spec in (P(), P("x"), P(None, "x")):
        counter.keys.clear()
        back = zarrckpt.load_pytree(url, {"x": NamedSharding(mesh((8,), ("x",)), spec)})
        np.testing.assert_array_equal(np.asarray(back["x"]), x)
        reads = counter.chunk_reads()
        assert len(reads) == len(set(reads)) == 8, (spec, reads)


def test_metadata_reads_no_array_data(tmp_path, monkeypatch):
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"w": jax.device_put(jnp.ones((8, 4), jnp.bfloat16),
                                                   NamedSharding(mesh((2, 4), ("a", "b")), P("a"))), "n": None, "s": 1},
                         min_chunk_bytes=1)
    counter = CountingStore(monkeypatch)
    meta = zarrckpt.metadata(url)
    assert counter.chunk_reads() == []
    assert meta.committed and meta.layout == "zarrckpt" and meta.format_version == 2  # arrays only (format 3: str...)
    (w,) = [leaf for leaf in meta.leaves if leaf.name == "w"]
    assert (w.key_path, w.shape, w.dtype, w.chunks, w.nbytes) == ("['w']", (8, 4), jnp.bfloat16, (4, 4), 64)
    assert meta.tree["n"] is None and meta.tree["w"] == jax.ShapeDtypeStruct((8, 4), jnp.bfloat16)


def test_small_host_memory_bound_still_works(tmp_path):
    url = str(tmp_path / "c")
    tree = {f"l{i}": jax.device_put(jnp.full((64, 64), i, jnp.float32), NamedSharding(mesh((2, 4), ("a", "b")), P("a")))
            for i in range(6)}
    zarrckpt.save_pytree(url, tree, max_inflight_bytes=1, max_workers=2)
    back = zarrckpt.load_pytree(url, jax.tree_util.tree_map(lambda x: x.sharding, tree), max_inflight_bytes=1)
    for k, v in tree.items():
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(v))


def test_typed_prng_keys_round_trip(tmp_path):
    url = str(tmp_path / "c")
    m = mesh((2, 4), ("a", "b"))
    keys = jax.device_put(jax.random.split(jax.random.key(7), 8), NamedSharding(m, P("a")))
    rbg = jax.random.key(3, impl="rbg")
    zarrckpt.save_pytree(url, {"keys": keys, "rbg": rbg, "raw": jax.random.PRNGKey(1)})
    target = {"keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=NamedSharding(mesh((8,), ("x",)), P("x"))),
              "rbg": rbg, "raw": jax.random.PRNGKey(0)}
    back = zarrckpt.load_pytree(url, target, donate_target=False)
    assert back["keys"].dtype == keys.dtype and back["keys"].sharding == target["keys"].sharding
    np.testing.assert_array_equal(jax.random.key_data(back["keys"]), jax.random.key_data(keys))
    assert jax.random.key_impl(back["rbg"]) == jax.random.key_impl(rbg)
    np.testing.assert_array_equal(jax.random.key_data(back["rbg"]), jax.random.key_data(rbg))
    plain = zarrckpt.load_pytree(url)
    assert jax.dtypes.issubdtype(plain["keys"].dtype, jax.dtypes.prng_key)
    with pytest.raises(zarrckpt.CheckpointMismatchError, match="a typed PRNG key array in the target, saved as plain"):
        zarrckpt.load_pytree(url, {**target, "raw": jax.random.key(0)})


# -- donation, partial restore -------------------------------------------------------


def damage_one_chunk(url: str, name: str = "params.w") -> None:
    loc = _storage.resolve(url)
    key = next(k for k in (e.name for e in loc.walk()) if k.startswith(f"{name}/c"))
    data = bytearray(loc.read(key))
    data[0] ^= 0xFF
    loc.write(key, bytes(data))


def test_restoring_into_aliases_of_live_arrays_keeps_them_alive(tmp_path):
    """eqx.filter(model, eqx.is_array) shares its arrays with the model: a restore into it
    must not free them unless asked."""
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, train_state(2.0))
    model = train_state(1.0)
    alias = jax.tree.map(lambda x: x, model)  # the same array objects
    back = zarrckpt.load_pytree(url, alias)
    assert float(back["params"]["w"][0, 0]) == 2.0
    assert float(model["params"]["w"][0, 0]) == 1.0  # still usable


def test_a_failed_restore_leaves_the_target_untouched_unless_donated(tmp_path):
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, train_state(2.0))
    damage_one_chunk(url)
    target = train_state(1.0)
    with pytest.raises(zarrckpt.CheckpointCorruptError, match="fails its CRC-32C checksum"):
        zarrckpt.load_pytree(url, target)
    assert not any(x.is_deleted() for x in jax.tree.leaves(target))
    np.testing.assert_array_equal(target["params"]["w"], np.ones((4, 3)))
    # With donation the arrays read before the failure are gone, as documented.
    donated = train_state(1.0)
    with pytest.raises(zarrckpt.CheckpointCorruptError):
        zarrckpt.load_pytree(url, donated, donate_target=True)
    assert any(x.is_deleted() for x in jax.tree.leaves(donated))


def test_partial_restore_of_the_params_of_a_train_train_state(tmp_path):
    url = str(tmp_path)
    zarrckpt.save_checkpoint(url, 10, train_state(3.0))
    abstract = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), train_state()["params"])}
    with pytest.raises(zarrckpt.CheckpointMismatchError) as info:
        zarrckpt.load_checkpoint_if_it_exists(url, abstract)
    assert "['opt_state']['mu']: in the checkpoint but not in the target" in str(info.value)
    assert "['step']: in the checkpoint but not in the target" in str(info.value)
    assert "pass partial=True" in str(info.value)
    reads = []
    original = _storage.Location.read_into
    try:
        _storage.Location.read_into = lambda self, key, *b, **o: reads.append(key) or original(self, key, *b, **o)
        params, step = zarrckpt.load_checkpoint_if_it_exists(url, abstract, partial=True)
    finally:
        _storage.Location.read_into = original
    assert step == 10 and set(params) == {"params"}
    assert float(params["params"]["w"][0, 0]) == 3.0
    assert all(key.startswith("params.") for key in reads), reads  # the rest is never read
    with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"\['params'\]\['extra'\]: in the target but not"):
        zarrckpt.load_checkpoint_if_it_exists(url, {"params": {**abstract["params"], "extra": jnp.ones(2)}},
                                              partial=True)


def test_fine_tuning_with_a_new_head(tmp_path):
    """Restore the backbone of a pretrained model, initialize a head of another shape."""
    pretrained = {"backbone": {"w": jnp.full((8, 8), 0.5)}, "head": {"w": jnp.ones((8, 10))}}
    with zarrckpt.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(100, pretrained)
        fresh = {"backbone": {"w": jnp.zeros((8, 8))}, "head": {"w": jnp.zeros((8, 3))}}  # 3 classes now
        with pytest.raises(zarrckpt.CheckpointMismatchError, match=r"shape \(8, 10\) in the checkpoint, \(8, 3\)"):
            mgr.restore(fresh)
        backbone, step = mgr.restore({"backbone": fresh["backbone"]}, partial=True)
    model = {**backbone, "head": fresh["head"]}
    assert step == 100 and float(model["backbone"]["w"][0, 0]) == 0.5 and model["head"]["w"].shape == (8, 3)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_aimed_at_an_array_inside_a_checkpoint_is_refused_and_the_array_kept(tmp_path, overwrite):
    """An array's `zarr.json` (a leaf with no chunks: nothing else there) is no save's
    leftover: a save into it is refused, naming it, and the checkpoint stays whole."""
    step = tmp_path / "0000000001"
    zarrckpt.save_pytree(str(step), {"empty": np.zeros((0, 4)), "w": np.ones(3)})
    before = (step / "empty" / "zarr.json").read_bytes()
    with pytest.raises(zarrckpt.CheckpointExistsError, match=r"0000000001/empty is a zarr 'array', not a checkpoint"):
        zarrckpt.save_pytree(str(step / "empty"), {"x": np.ones(2)}, overwrite=overwrite)
    assert (step / "empty" / "zarr.json").read_bytes() == before
    assert zarrckpt.verify(str(step)).ok


def chunk_reads(monkeypatch, meet_first: int = 0):
    """Counts `read_chunk` calls and the most running at once; with `meet_first`, the
    first that many must all be running together (a barrier, broken after 20 s)."""
    import threading

    from zarrckpt._restore import checkpoint as _reader

    seen = {"calls": 0, "now": 0, "most": 0}
    lock, meet, read_chunk = threading.Lock(), threading.Barrier(max(1, meet_first), timeout=20), _reader.read_chunk

    def counted(*args, **kwargs):
        with lock:
            seen["calls"] += 1
            first = seen["calls"] <= meet_first
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
        try:
            if first:
                meet.wait()
            return read_chunk(*args, **kwargs)
        finally:
            with lock:
                seen["now"] -= 1

    monkeypatch.setattr(_reader, "read_chunk", counted)
    return seen


def one_device_leaves(tmp_path, count: int = 1):
    """`count` leaves of 16 MiB on one device saved in 4 chunks each: a restore reads
    each as one box."""
    device = SingleDeviceSharding(jax.devices()[0])
    tree = {f"x{i}": jax.device_put(jnp.arange(1024 * 4096, dtype=jnp.float32).reshape(1024, 4096) + i, device)
            for i in range(count)}
    zarrckpt.save_pytree(str(tmp_path / "ckpt"), tree, max_chunk_bytes=4 * 2**20)
    return tree, {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device) for k, x in tree.items()}


def test_the_chunks_of_one_devices_shard_are_read_at_once(tmp_path, monkeypatch):
    """A large shard of several chunks (a whole leaf, on one GPU) is read chunk by chunk
    at once, not one after another: its four chunk reads must meet."""
    tree, target = one_device_leaves(tmp_path)
    seen = chunk_reads(monkeypatch, meet_first=4)
    restored = zarrckpt.load_pytree(str(tmp_path / "ckpt"), target)
    assert seen["calls"] == 4
    np.testing.assert_array_equal(np.asarray(restored["x0"]), np.asarray(tree["x0"]))


@pytest.mark.parametrize("workers", [1, 3])
def test_the_chunks_of_a_shard_are_read_by_no_more_workers_than_the_restore_has(tmp_path, monkeypatch, workers):
    """The chunks read at once are read by workers of the restore that no other read
    runs on: six such shards with `max_workers` of 1 or 3 never have more reads at
    once (the first reads had borrowed workers the later ones then ran on too)."""
    tree, target = one_device_leaves(tmp_path, 6)
    seen = chunk_reads(monkeypatch)
    restored = zarrckpt.load_pytree(str(tmp_path / "ckpt"), target, max_workers=workers)
    assert seen["calls"] == 24 and seen["most"] <= workers, seen
    for k, x in tree.items():
        np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(x))


def test_on_cpu_devices_the_restored_shards_are_the_bytes_read(tmp_path, monkeypatch):
    """Onto CPU devices, each box is read into memory the CPU client takes as a device's
    buffer: no shard of an array is copied again after its read (small leaves and large,
    sharded and replicated, of every item size), and the values are those saved."""
    from zarrckpt._restore import checkpoint as _reader

    if jax.devices()[0].platform != "cpu":
        pytest.skip("the CPU client's own buffers")
    rows = NamedSharding(mesh(), P(("data", "model")))
    tree = {"big": jnp.arange(2048 * 2048, dtype=jnp.float32).reshape(2048, 2048),  # large: put by the readers
            "rows": jnp.arange(64 * 24, dtype=jnp.bfloat16).reshape(64, 24), "norm": jnp.ones(5, jnp.int8),
            "flags": jnp.array([True, False, True]), "scalar": jnp.float32(3.5),
            "empty": jnp.zeros((0, 3), jnp.float16)}
    zarrckpt.save_pytree(str(tmp_path / "ckpt"), tree)
    made, aligned_empty = [], _reader.aligned_empty

    def recorded(shape, dtype):
        made.append(aligned_empty(shape, dtype))
        return made[-1]

    monkeypatch.setattr(_reader, "aligned_empty", recorded)
    target = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows if x.ndim and x.shape[0] % 8 == 0 else
                                      NamedSharding(mesh(), P())) for k, x in tree.items()}
    restored = zarrckpt.load_pytree(str(tmp_path / "ckpt"), target)
    spans = [(x.ctypes.data, x.ctypes.data + x.nbytes) for x in made]
    for k, x in restored.items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(tree[k]))
        assert x.sharding == target[k].sharding, k
        for shard in x.addressable_shards if x.size and x.ndim else ():  # jax copies a 0-d array
            at = shard.data.unsafe_buffer_pointer()
            assert any(a <= at < b for a, b in spans), (k, shard.index)  # in a box read, not a copy of one
