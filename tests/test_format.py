"""The on-disk format: leaf names, the tree record, chunk planning, the commit marker."""

import json
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import zarrckpt
from zarrckpt._format import naming as _naming, tree as _tree
from zarrckpt._save import plan as _planning


def names(tree) -> list[str]:
    return [leaf.name for leaf in _tree.record(tree)[1]]


def test_names_are_readable():
    tree = {"params": {"dense": {"kernel": 1, "bias": 2}}, "opt": [3, (4,)], "step": 5}
    assert names(tree) == ["opt.0", "opt.1.0", "params.dense.bias", "params.dense.kernel", "step"]


@pytest.mark.parametrize("key, name", [
    ("../x", "%2E%2E%2Fx"), ("a/b", "a%2Fb"), ("", "%"), ("%", "%25"), (".", "%2E"), ("..", "%2E%2E"),
    ("zarr.json", "zarr%2Ejson"), ("a.b", "a%2Eb"), ("é", "%C3%A9"), ("~", "%7E"), ("\x00", "%00"),
    ("/abs", "%2Fabs"), ("c", "c"), ("__x", "__x"),
])
def test_escaping(key, name):
    assert names({key: 1}) == [name]


def test_root_leaf_and_long_names():
    assert names(np.zeros(2)) == ["%root"]
    long = names({"k" * 500: 1, "k" * 499: 2})
    assert all(len(n) <= _naming.MAX_NAME_LENGTH for n in long) and len(set(long)) == 2
    assert all("~" in n for n in long)


def test_separator_cannot_collide():
    # {"a.b": x} and {"a": {"b": y}} would both be "a.b" without escaping.
    assert set(names({"a.b": 1, "a": {"b": 2}})) == {"a.b", "a%2Eb"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=12), min_size=1, max_size=6, unique=True))
def test_names_unique_and_safe(keys):
    tree = {k: {k2: 0 for k2 in keys[:2]} for k in keys}
    got = names(tree)
    assert len(set(got)) == len(got)
    for n in got:
        assert "/" not in n and n not in (".", "..") and n.isascii() and 0 < len(n) <= _naming.MAX_NAME_LENGTH


def test_escaped_names_stay_inside_the_group(tmp_path):
    url = str(tmp_path / "ckpt")
    tree = {"../escape": np.ones(2), "/abs": np.ones(2), "a/b": np.ones(2), "": np.ones(2), "..": np.ones(2)}
    zarrckpt.save_pytree(url, tree)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    back = zarrckpt.load_pytree(url)
    assert set(back) == set(tree)


def test_tree_record_keeps_structure(tmp_path):
    from collections import namedtuple

    Point = namedtuple("Point", "x y")
    url = str(tmp_path / "c")
    tree = {"none": None, "empty_d": {}, "empty_l": [], "empty_t": (), "p": Point(1, np.float32(2)),
            "nested": [{"a": (1, [2])}], "int_keys": {3: 4, 1: 2}}
    zarrckpt.save_pytree(url, tree)
    back = zarrckpt.load_pytree(url)
    assert back["none"] is None and back["empty_d"] == {} and back["empty_l"] == [] and back["empty_t"] == ()
    assert back["p"] == {"x": 1, "y": np.float32(2)}  # custom nodes come back as dicts of fields
    assert back["nested"] == [{"a": (1, [2])}] and back["int_keys"] == {1: 2, 3: 4}
    with_target = zarrckpt.load_pytree(url, jax.tree_util.tree_map(lambda x: x, tree))
    assert isinstance(with_target["p"], Point) and with_target["p"].y == np.float32(2)
    record = json.loads((Path(url) / "zarr.json").read_text())["attributes"]["zarrckpt"]
    assert record["format_version"] == 2  # arrays only: still readable by zarrckpt before format 3


def test_split_chunk():
    assert _planning.split_chunk((8, 8), 1) == (8, 8)
    assert _planning.split_chunk((8, 8), 2) == (4, 8)
    assert _planning.split_chunk((8, 8), 8) == (1, 8)
    assert _planning.split_chunk((8, 8), 16) == (1, 4)
    assert _planning.split_chunk((), 4) == ()
    # A shard's parts must tile it: only exact divisors, and where the leading axis has
    # none near the count, the next axis takes the split (never 7 single rows).
    assert _planning.split_chunk((7, 6), 2) == (7, 3)
    assert _planning.split_chunk((101, 13), 4) == (101, 13)  # prime both ways: one part, not 1,313
    # Spanning the whole array, an axis is cut anywhere, the last part at the edge.
    assert _planning.split_chunk((7, 6), 2, (7, 6)) == (4, 6)
    assert _planning.split_chunk((104_729, 8), 26, (104_729, 8)) == (4029, 8)
    assert _planning.split_chunk((7, 6), 2, (14, 6)) == (7, 3)  # 7 of 14 rows: a shard, constrained


@pytest.mark.parametrize("rows, spec", [(104_729, P()), (8 * 10_007, P("a"))])  # primes: 104,729 and 10,007
def test_awkward_lengths_make_few_chunks(tmp_path, rows, spec):
    """A leaf whose length has no divisor near the split it needs is still cut into about
    max_chunk_bytes parts (it once became one chunk object per row), and comes back whole."""
    mesh = Mesh(np.array(jax.devices()), ("a",))
    x = jax.device_put(jnp.arange(rows * 8, dtype=jnp.float32).reshape(rows, 8), NamedSharding(mesh, spec))
    host = np.arange(rows * 8, dtype=np.float32).reshape(rows, 8)
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"x": x, "host": host}, max_chunk_bytes=2**18)
    for name in ("x", "host"):
        files = [p for p in (Path(url) / name).rglob("*") if p.is_file() and p.name != "zarr.json"]
        parts = -(-host.nbytes // 2**18)
        assert parts <= len(files) <= 4 * max(parts, jax.device_count()), (name, len(files))
    out = zarrckpt.load_pytree(url)
    np.testing.assert_array_equal(np.asarray(out["x"]), host)
    np.testing.assert_array_equal(out["host"], host)


def plan(x, **kw):
    return _planning.plan_array(_tree.Leaf((), "x", x), 0, process=0, processes=1, **kw)


def test_chunks_follow_shards():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    x = jax.device_put(jnp.zeros((16, 32)), NamedSharding(mesh, P("a", "b")))
    p = plan(x, min_chunk_bytes=1)  # shards this small are merged by default (test_small_shards_are_merged)
    assert p.chunks == (8, 8)
    assert len(p.writes) == 8  # one whole chunk per shard, each written once
    # Uneven shards (10 rows over 4 devices): the chunk grid still has every boundary.
    assert _planning._grid_chunk((10, 3), [((0, 3), (0, 3)), ((3, 6), (0, 3)), ((6, 9), (0, 3)),
                                           ((9, 10), (0, 3))]) == [3, 3]


def test_large_shards_split_and_replicas_share():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    big = jax.device_put(jnp.zeros((64, 1024)), NamedSharding(mesh, P("a")))  # 128 KiB shards
    assert plan(big, max_chunk_bytes=32 * 1024, min_chunk_bytes=1).chunks == (8, 1024)
    replicated = jax.device_put(jnp.zeros((2048, 1024)), NamedSharding(mesh, P()))  # 8 MiB on 8 devices
    p = plan(replicated)
    writers = {u.sources[0][0] for u in p.writes}
    assert len(p.writes) == 8 and len(writers) == 8
    regions = [u.region for u in p.writes]
    assert len(set(regions)) == len(regions)  # no chunk has two writers
    small = jax.device_put(jnp.zeros((4,)), NamedSharding(mesh, P()))
    assert len(plan(small).writes) == 1


def test_every_chunk_is_written_even_zeros(tmp_path):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"z": jax.device_put(jnp.zeros((8, 8)), NamedSharding(mesh, P("a", "b")))},
                         min_chunk_bytes=1)
    chunks = [p for p in (Path(url) / "z").glob("c.*") if p.is_file()]
    assert len(chunks) == 8


def test_commit_marker_is_written_last(tmp_path, monkeypatch):
    from zarrckpt import _commit, _storage

    url = str(tmp_path / "c")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    tree = {f"l{i}": jax.device_put(jnp.full((8, 8), float(i)), NamedSharding(mesh, P("a", "b"))) for i in range(8)}
    tree["host"] = np.ones(3)
    events, lock = [], threading.Lock()
    original = _storage.Location.write

    def recorded(loc, key, *parts, **kwargs):
        commits = key == "zarr.json" and _naming.COMMIT_ATTR in json.loads(b"".join(map(bytes, parts)))["attributes"]
        with lock:
            events.append(("begin", key, commits))
        original(loc, key, *parts, **kwargs)
        with lock:
            events.append(("end", key, commits))

    monkeypatch.setattr(_storage.Location, "write", recorded)
    zarrckpt.save_pytree(url, tree, min_chunk_bytes=1)  # 8 chunks per array, written concurrently
    begun = [key for kind, key, commits in events if kind == "begin" and commits]
    assert begun == ["zarr.json"], events
    # Every other write, each of the 65 chunks among them, has returned (its object
    # durable) before the commit begins.
    commit_at = events.index(("begin", "zarr.json", True))
    ended = {key for kind, key, _ in events[:commit_at] if kind == "end"}
    others = {key for kind, key, commits in events if not commits}
    assert others == ended, sorted(others - ended)
    chunks = {f"l{i}/c.{row}.{col}" for i in range(8) for row in range(2) for col in range(4)} | {"host/c.0"}
    assert chunks <= ended, sorted(chunks - ended)
    assert _commit.head(_storage.resolve(url)).state is _commit.State.COMMITTED
    doc = json.loads((Path(url) / "zarr.json").read_text())
    assert doc["attributes"]["write_completed"] is True and "consolidated_metadata" in doc


def test_plain_zarr_reads_what_zarrckpt_writes(tmp_path):
    import ml_dtypes
    import zarr

    url = str(tmp_path / "c")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    tree = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("a", "b"))),
            "bf": np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3), "i8": np.arange(5, dtype=np.int8),
            "scalar": 3.5, "flag": True}
    zarrckpt.save_pytree(url, tree)
    for consolidated in (True, False):
        group = zarr.open_group(url, mode="r", use_consolidated=consolidated)
        assert sorted(group.array_keys()) == ["bf", "flag", "i8", "scalar", "w"]
        for name, value in tree.items():
            np.testing.assert_array_equal(group[name][...], np.asarray(value))


def test_edge_chunks_are_padded_as_zarr_expects(tmp_path):
    import zarr

    from zarrckpt import _storage
    from zarrckpt._format import chunks as _chunks, zarrjson as _zarrjson

    loc = _storage.resolve(str(tmp_path))
    codec = _chunks.ChunkCodec("a", np.dtype("f4"), (2, 2))
    loc.write("a/zarr.json", _zarrjson.encode_document(_zarrjson.array_document((5, 3), codec)))
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    for i in range(3):
        for j in range(2):
            chunk = ((2 * i, 2 * i + 2), (2 * j, 2 * j + 2))
            loc.write(codec.key(chunk), *codec.encode(x[2 * i:2 * i + 2, 2 * j:2 * j + 2]))
    np.testing.assert_array_equal(zarr.open_array(f"{loc.path}/a", mode="r")[...], x)


class TwoKinds:
    """A custom pytree node whose two children have different key kinds but one name."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    TwoKinds,
    lambda n: (((jax.tree_util.GetAttrKey("x"), n.a), (jax.tree_util.DictKey("x"), n.b)), None),
    lambda _, children: TwoKinds(*children),
)


def test_colliding_key_paths_are_refused(tmp_path):
    with pytest.raises(zarrckpt.UnsupportedLeafError,
                       match=r"key paths \['n'\]\.x and \['n'\]\['x'\] both map to array name 'n\.x'"):
        zarrckpt.save_pytree(str(tmp_path / "c"), {"n": TwoKinds(1, 2)})
    assert not (tmp_path / "c").exists()


def test_checkpoints_without_checksums_still_load(tmp_path):
    # Format 1 had no crc32c codec; checksums=False writes that chunk layout.
    url = tmp_path / "c"
    zarrckpt.save_pytree(str(url), {"w": np.arange(6.0)}, checksums=False)
    doc = json.loads((url / "zarr.json").read_text())
    doc["attributes"]["zarrckpt"]["format_version"] = 1
    (url / "zarr.json").write_text(json.dumps(doc))
    assert (url / "w" / "c.0").stat().st_size == 48
    np.testing.assert_array_equal(zarrckpt.load_pytree(str(url))["w"], np.arange(6.0))
    assert zarrckpt.verify(str(url)).ok


def test_small_shards_are_merged_into_one_object_per_writing_process(tmp_path):
    """A 4 KiB leaf over 8 devices was 8 objects of 512 bytes: now one chunk, whole, written
    once; a larger leaf's shards merge up to `min_chunk_bytes`, never past a process."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    small = jax.device_put(jnp.arange(1024.0, dtype=jnp.float32), NamedSharding(mesh, P(("a", "b"))))
    p = plan(small)
    assert p.chunks == (1024,) and len(p.writes) == 1 and len(p.writes[0].sources) == 8
    grid = jax.device_put(jnp.zeros((512, 1024), jnp.float32), NamedSharding(mesh, P("a", "b")))  # 256 KiB shards
    p = plan(grid)
    assert p.chunks == (256, 1024) and len(p.writes) == 2  # two 1 MiB chunks of four shards each
    assert plan(grid, max_chunk_bytes=512 * 1024).chunks == (256, 512)  # never past max_chunk_bytes
    url = str(tmp_path / "c")
    zarrckpt.save_pytree(url, {"small": small, "grid": grid})
    assert sorted(p.name for p in (Path(url) / "small").iterdir()) == ["c.0", "zarr.json"]
    back = zarrckpt.load_pytree(url, {"small": small.sharding, "grid": grid.sharding})
    np.testing.assert_array_equal(np.asarray(back["small"]), np.arange(1024.0))
    assert zarrckpt.verify(url).ok


def test_a_local_copys_record_reads_back_as_written_and_a_bad_one_says_what_is_wrong():
    from zarrckpt._format.copy_record import KEY, CopyRecord

    record = CopyRecord("ab" * 16, 150, 100, 1, 2, {"w": [(1, 0), (0, 0)], "v": []}, ((1, 0),))
    assert CopyRecord.parse({KEY: record.as_meta()}) == record
    for bad in ({**record.as_meta(), "process": 2}, {**record.as_meta(), "peers": [[0, 0]]},
                {**record.as_meta(), "step": True}, {**record.as_meta(), "held": {"w": [[0, -1]]}}):
        with pytest.raises(ValueError):
            CopyRecord.parse({KEY: bad})
