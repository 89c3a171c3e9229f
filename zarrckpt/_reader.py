"""Opening a checkpoint for reading: commit check, layout detection, leaf records.

Two layouts are read: zarrckpt's own (a zarr v3 group whose `zarrckpt` attribute
records the tree), and seqax's (a zarr v2 group with one array per leaf named by
`jax.tree_util.keystr`, and the same `write_completed` commit attribute).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import warnings
from typing import Any, Callable, Iterator

import jax
import numpy as np
import zarr

from . import _chunks, _commit, _concurrency, _dtypes, _multihost, _naming, _planning, _tree, _zarrjson
from ._chunks import ChunkCodec
from ._planning import Region
from ._storage import Location, MissingObject
from .errors import CheckpointCorruptError, CheckpointNotFoundError

_tu = jax.tree_util
_MEMORY_BYTES = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass(frozen=True)
class StoredLeaf:
    """What a checkpoint holds for one leaf."""

    path: _tree.KeyPath
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str  # "jax", "numpy", "numpy_scalar", "prng_key", or the Python scalar type's name
    codec: ChunkCodec
    prng_impl: str | None = None  # for typed PRNG keys: the implementation's name
    processes: int | None = None  # for per-process leaves: how many processes saved one

    @property
    def where(self) -> str:
        return _tree.describe_path(self.path)

    @property
    def nbytes(self) -> int:
        return _dtypes.nbytes(self.shape, self.dtype)

    @property
    def chunks(self) -> tuple[int, ...]:
        return self.codec.shape

    @property
    def checksum(self) -> bool:
        return self.codec.checksum


@dataclasses.dataclass
class Checkpoint:
    """An opened checkpoint: what it holds, and a way to read any box of any leaf."""

    loc: Location
    layout: str  # "zarrckpt" or "seqax"
    committed: bool
    spec: dict[str, Any]
    leaves: dict[str, StoredLeaf]
    name_of: Callable[[_tree.KeyPath], str]  # target key path -> array name in this layout
    meta: dict[str, Any]
    seqax_group: zarr.Group | None = None

    def read(self, leaf: StoredLeaf, box: Region) -> np.ndarray:
        """The values of `leaf` inside `box`, reading each chunk it touches once.

        Raises CheckpointCorruptError naming the chunk if one is missing or has the
        wrong size, with a note naming the leaf.
        """
        with self._reading(leaf):
            if self.seqax_group is not None:
                return np.asarray(self.seqax_group[leaf.name][_planning.region_slices(box)])
            return _read_box(self.loc, leaf, box)

    def read_own(self, leaf: StoredLeaf) -> Any:
        """This process's value of the per-process `leaf` (see `_tree.PerProcess`)."""
        process = _multihost.process_index()
        with self._reading(leaf):
            key = _naming.object_key(_naming.per_process_name(leaf.name, process), "zarr.json")
            document = _load_json(self.loc, key)
            try:
                own = own_array(leaf, process, document)
                data = _read_box(self.loc, own, ((0, own.shape[0]),)).tobytes()
                return _tree.Encoded.decode(document["attributes"][_naming.META_ATTR]["encoding"], data)
            except (KeyError, TypeError, ValueError, IndexError, RecursionError) as e:
                raise CheckpointCorruptError(f"{key} of checkpoint {self.loc.url} is malformed: {e!r}") from e

    @contextlib.contextmanager
    def _reading(self, leaf: StoredLeaf) -> Iterator[None]:
        """Names the leaf in any failure; a missing object in a checkpoint whose commit
        marker has meanwhile gone means it was deleted under the reader, not damaged."""
        try:
            yield
        except MissingObject as e:
            if self.committed and _commit.state(self.loc) is not _commit.State.COMMITTED:
                raise CheckpointNotFoundError(
                    f"checkpoint {self.loc.url} was deleted while it was being read (its commit marker is gone: "
                    f"retention or another job removed it); read a newer step") from e
            e.add_note(f"while reading leaf {leaf.where} (array {leaf.name!r}) of {self.loc.url}")
            raise
        except Exception as e:
            e.add_note(f"while reading leaf {leaf.where} (array {leaf.name!r}) of {self.loc.url}")
            raise


def _read_box(loc: Location, leaf: StoredLeaf, box: Region) -> np.ndarray:
    nbytes = _dtypes.nbytes(_planning.region_shape(box), leaf.dtype)
    if nbytes > _MEMORY_BYTES:
        # A hostile or damaged checkpoint must not make us try to allocate it.
        raise CheckpointCorruptError(
            f"leaf {leaf.where} of {loc.url} needs {nbytes:,} bytes for {box}, more than this machine's "
            f"{_MEMORY_BYTES:,} bytes of memory")
    out = np.empty([b - a for a, b in box], leaf.dtype)
    for chunk in _planning.chunks_touching(box, leaf.chunks, leaf.shape):
        inside = _planning.intersect(chunk, box)
        # The trailing Ellipsis keeps a 0-d result a view, not a scalar copy.
        dest = out[(*(slice(a - o, b - o) for (a, b), (o, _) in zip(inside, box)), ...)]
        # The common case: the chunk's bytes land in the result with no copy.
        whole = inside == chunk and all(b - a == c for (a, b), c in zip(chunk, leaf.chunks)) \
            and dest.flags.c_contiguous
        try:
            values = leaf.codec.load(loc, chunk, out=dest if whole else None)
        except FileNotFoundError:
            raise MissingObject(f"chunk {leaf.codec.key(chunk)!r} is missing from checkpoint {loc.url}") from None
        if not whole:
            dest[...] = values[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inside, chunk))]
    return out


def open_checkpoint(loc: Location, *, require_committed: bool = True) -> Checkpoint:
    """Opens the checkpoint at `loc`: one metadata read for a committed zarrckpt checkpoint.

    Raises CheckpointNotFoundError if there is none, or if it is not committed and
    `require_committed`; CheckpointCorruptError if its metadata cannot be understood.
    """
    group = _commit.read_group(loc)
    if group is None:
        steps = [s for n in loc.list_dir() if (s := _naming.parse_step_dir_name(n)) is not None]
        hint = (f" (it holds step directories: use load_checkpoint_if_it_exists, or one step's URL "
                f"such as {loc.step(steps[-1]).url})") if steps else ""
        raise CheckpointNotFoundError(f"no checkpoint at {loc.url}{hint}")
    if group.zarr_format == 3 and not group.document:
        raise CheckpointCorruptError(f"{loc.url}/zarr.json, the checkpoint's metadata, is not a JSON object")
    committed = _commit.state_of(group) is _commit.State.COMMITTED
    if require_committed and not committed:
        raise CheckpointNotFoundError(
            f"checkpoint at {loc.url} is not committed (no '{_naming.COMMIT_ATTR}: true'): "
            "it is incomplete, or still being written"
        )
    meta = group.attributes.get(_naming.META_ATTR)
    if isinstance(meta, dict):
        return _open_zarrckpt(loc, committed, meta, group.document)
    if group.zarr_format == 2:
        return _open_seqax(loc, committed)
    raise CheckpointCorruptError(f"{loc.url} is a zarr group but not a zarrckpt or seqax checkpoint")


def _open_zarrckpt(loc: Location, committed: bool, meta: dict[str, Any], document: dict[str, Any]) -> Checkpoint:
    version = meta.get("format_version")
    if not isinstance(version, int) or version > _naming.FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"checkpoint {loc.url} has format_version {version!r}; this zarrckpt reads up to "
            f"{_naming.FORMAT_VERSION} (upgrade zarrckpt to read it)"
        )
    spec = meta.get("tree")
    try:
        records = _checked_records(spec)  # before any read: names decide which objects are read
        shared = [rec["name"] for _, rec in records if rec.get("type") != "per_process"]
        arrays = _array_documents(loc, document, shared)
        leaves = {rec["name"]: stored_leaf(path, rec, arrays.get(rec["name"])) for path, rec in records}
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError,
            CheckpointCorruptError) as e:
        raise CheckpointCorruptError(f"checkpoint {loc.url} has malformed metadata: {e!r}") from e
    return Checkpoint(loc, "zarrckpt", committed, spec, leaves, _tree.name_of, meta)


def _checked_records(spec: Any) -> list[tuple[_tree.KeyPath, dict[str, Any]]]:
    """The leaf records of a tree record, each under exactly the array name the write
    side gives its key path, and no name twice (ValueError otherwise)."""
    records = _tree.recorded_leaves(spec)
    seen: set[str] = set()
    for path, rec in records:
        expected = _tree.name_of(path)
        if rec.get("name") != expected:
            raise ValueError(f"leaf {_tree.describe_path(path)} is recorded as array {rec.get('name')!r}, "
                             f"but zarrckpt names it {expected!r}")
        if expected in seen:
            raise ValueError(f"array {expected!r} is recorded twice")
        seen.add(expected)
    return records


def _array_documents(loc: Location, group_document: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Every array's `zarr.json`: from the consolidated metadata written at commit, or,
    for an uncommitted checkpoint being inspected, one concurrent read per array."""
    consolidated = (group_document.get("consolidated_metadata") or {}).get("metadata")
    if isinstance(consolidated, dict):
        return consolidated
    return dict(zip(names, _concurrency.run_all(lambda n: _load_json(loc, _naming.object_key(n, "zarr.json")),
                                                names, loc.concurrency)))


def _load_json(loc: Location, key: str) -> Any:
    try:
        return json.loads(loc.read(key))
    except FileNotFoundError:
        raise MissingObject(f"{key} is missing from checkpoint {loc.url}") from None
    except (ValueError, RecursionError):
        raise CheckpointCorruptError(f"{key} of checkpoint {loc.url} is not JSON") from None


# The leaf kinds a tree record can name (see _tree.leaf_record).
_KINDS = frozenset({"jax", "numpy", "numpy_scalar", "prng_key", "bool", "int", "float", "complex", "str", "bytes"})


def stored_leaf(path: _tree.KeyPath, rec: dict[str, Any], array: dict[str, Any] | None) -> StoredLeaf:
    """A leaf record checked against its array's metadata: they must agree exactly, and
    describe an array that zarrckpt could have written (ValueError otherwise). A
    per-process leaf has no shared array: each process's value is its own array."""
    if rec["type"] == "per_process":
        processes = rec["processes"]
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise ValueError(f"leaf {_tree.describe_path(path)}: saved by {processes!r} processes")
        return StoredLeaf(path, rec["name"], (), np.dtype(np.uint8), "per_process",
                          ChunkCodec(rec["name"], np.dtype(np.uint8), ()), processes=processes)
    if not isinstance(array, dict):
        raise ValueError(f"leaf {_tree.describe_path(path)}: no array metadata")
    dtype = _dtypes.from_name(rec["dtype"])
    shape = _ints(rec["shape"], "shape")
    chunks = _ints(array["chunk_grid"]["configuration"]["chunk_shape"], "chunk shape")
    kind, impl = rec["type"], rec.get("impl")
    where = _tree.describe_path(path)
    if kind not in _KINDS or (kind == "prng_key") != isinstance(impl, str) or (impl and not _prng_impl_known(impl)):
        raise ValueError(f"leaf {where}: kind {kind!r} (PRNG implementation {impl!r})")
    checksum = isinstance(array.get("codecs"), list) and _chunks.CRC32C_CODEC in array["codecs"]
    expected = {"shape": list(shape), **_dtype_fields(dtype, checksum)}
    for field in ("shape", "data_type", "codecs", "chunk_key_encoding"):
        if array.get(field) != expected[field]:
            raise ValueError(f"leaf {where}: array {field} {array.get(field)!r}, expected {expected[field]!r}")
    if (len(chunks) != len(shape) or any(d < 0 for d in shape) or math.prod(shape) >= 2**62
            or not all(1 <= c <= max(d, 1) for c, d in zip(chunks, shape))):
        raise ValueError(f"leaf {where}: shape {shape} with chunks {chunks}")
    return StoredLeaf(path, rec["name"], shape, dtype, kind, ChunkCodec(rec["name"], dtype, chunks, checksum), impl)


@functools.lru_cache(maxsize=None)
def _prng_impl_known(name: str) -> bool:
    try:
        jax.eval_shape(lambda: jax.random.key(0, impl=name))
    except (ValueError, TypeError):
        return False
    return True


def own_array(leaf: StoredLeaf, process: int, document: dict[str, Any]) -> StoredLeaf:
    """The array holding `process`'s value of the per-process `leaf`, described by its
    own `zarr.json` `document` (bytes, one dimension); ValueError if it is not such."""
    name = _naming.per_process_name(leaf.name, process)
    return stored_leaf(leaf.path, {"name": name, "type": "bytes", "shape": document["shape"], "dtype": "uint8"},
                       document)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in value):
        raise ValueError(f"{what} {value!r} is not a list of ints")
    return tuple(value)


@functools.lru_cache(maxsize=None)
def _dtype_fields(dtype: np.dtype, checksum: bool) -> dict[str, Any]:
    """The fields of an array's `zarr.json` that its dtype fixes. Cached: zarr's
    fill-value code makes a whole document cost ~50 us, 50 ms for 1000 leaves, while
    a restore waits."""
    doc = _zarrjson.array_document((), ChunkCodec("", dtype, (), checksum))
    return {field: doc[field] for field in ("data_type", "codecs", "chunk_key_encoding")}


# One key entry of jax.tree_util.keystr: ['str'] / ["str"], [int], or .attr
_KEYSTR_TOKEN = re.compile(r"""\['((?:[^'\\]|\\.)*)'\]|\["((?:[^"\\]|\\.)*)"\]|\[(-?\d+)\]|\.([A-Za-z_]\w*)""")


def _parse_keystr(name: str) -> _tree.KeyPath | None:
    path: list[Any] = []
    pos = 0
    while pos < len(name):
        m = _KEYSTR_TOKEN.match(name, pos)
        if m is None:
            return None
        single, double, index, attr = m.groups()
        if index is not None:
            path.append(_tu.SequenceKey(int(index)))
        elif attr is not None:
            path.append(_tu.GetAttrKey(attr))
        else:
            text = single if single is not None else double
            path.append(_tu.DictKey(re.sub(r"\\(.)", r"\1", text)))
        pos = m.end()
    return tuple(path)


def _open_seqax(loc: Location, committed: bool) -> Checkpoint:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            group = zarr.open_group(loc.zarr_store(), mode="r", zarr_format=2)
        except Exception as e:
            raise CheckpointCorruptError(f"cannot open checkpoint {loc.url}: {type(e).__name__}: {e}") from e
    names = sorted(group.array_keys())
    arrays = dict(zip(names, _concurrency.run_all(lambda n: group[n], names, loc.concurrency)))
    leaves = {}
    for name, array in arrays.items():
        path = _parse_keystr(name)
        if path is None:
            raise CheckpointCorruptError(f"seqax checkpoint {loc.url}: cannot parse leaf name {name!r}")
        leaves[name] = StoredLeaf(path, name, tuple(array.shape), np.dtype(array.dtype), "numpy",
                                  ChunkCodec(name, np.dtype(array.dtype), tuple(array.chunks), checksum=False))
    spec = _spec_from_paths(list(leaves.values()))
    return Checkpoint(loc, "seqax", committed, spec, leaves, lambda p: _tu.keystr(tuple(p)), {}, group)


def _spec_from_paths(leaves: list[StoredLeaf]) -> dict[str, Any]:
    """A tree record for seqax's layout, which keeps only leaf names: dicts and lists."""
    if len(leaves) == 1 and not leaves[0].path:
        return {"kind": "leaf", "name": leaves[0].name, "type": "numpy"}
    root: dict[Any, Any] = {}
    for leaf in leaves:
        node = root
        for entry in leaf.path[:-1]:
            node = node.setdefault(_key(entry), {})
        node[_key(leaf.path[-1])] = leaf

    def to_spec(node: Any) -> dict[str, Any]:
        if isinstance(node, StoredLeaf):
            return {"kind": "leaf", "name": node.name, "type": "numpy"}
        keys = sorted(node, key=lambda k: (isinstance(k, str), k))
        if keys and all(isinstance(k, int) for k in keys):
            return {"kind": "list", "children": [to_spec(node[k]) for k in keys]}
        return {"kind": "dict", "keys": keys, "children": [to_spec(node[k]) for k in keys]}

    return to_spec(root)


def _key(entry: Any) -> Any:
    if isinstance(entry, _tu.SequenceKey):
        return entry.idx
    return entry.name if isinstance(entry, _tu.GetAttrKey) else entry.key
