"""Opening a checkpoint for reading: commit check, layout detection, leaf records.

Two layouts are read: zarrckpt's own (a zarr v3 group whose `zarrckpt` attribute
records the tree), and seqax's (a zarr v2 group with one array per leaf named by
`jax.tree_util.keystr`, and the same `write_completed` commit attribute).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from .. import _commit, _seqax, _storage
from .._format import (
    chunks as _chunks,
    dtypes as _dtypes,
    naming as _naming,
    safetensors as _safetensors,
    tree as _tree,
    vouched as _vouched,
    zarrjson as _zarrjson,
)
from .._format.chunks import ChunkCodec, Damage, DamagedChunk
from .._storage import Location
from .._util import concurrency as _concurrency
from .._util.regions import Region, chunks_touching, intersect, region_shape, relative
from ..errors import CheckpointCorruptError, CheckpointNotFoundError

_MEMORY_BYTES = _concurrency.memory_bytes() or sys.maxsize
# Chunks of one box read at once, at most, and the least a box on a local disk must hold
# for that (a pool's threads cost about a millisecond to start).
_BOX_READERS = 8
_BOX_TOGETHER_BYTES = 16 * 2**20
# The alignment of a box read into host memory: jax's CPU client takes a host array
# aligned so as a device's buffer, with no copy; numpy aligns its own arrays to 16
# bytes only, and those it copies (on 8 CPU devices, a second pass over every byte).
_BOX_ALIGNMENT = 64


@dataclasses.dataclass(frozen=True)
class StoredLeaf:
    """What a checkpoint holds for one leaf."""

    path: _tree.KeyPath
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    # What was saved: "jax", "numpy", "numpy_scalar", "prng_key", "str", "bytes",
    # "per_process", or a Python scalar type's name ("bool", "int", "float", "complex").
    kind: str
    codec: ChunkCodec | _seqax.Codec | _safetensors.TensorCodec
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


class MissingObject(CheckpointCorruptError):
    """An object a checkpoint declares is absent: damage, or a checkpoint deleted while
    it was read (the reader tells which by reading the commit marker again)."""


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
    save_id: str | None = None  # the identity of the save read (see `_commit`)
    # Each array's `zarr.json` as the leaves were built from it (zarrckpt's layout: the
    # consolidated metadata), by array name; `verify` compares each array's own with it.
    documents: dict[str, Any] = dataclasses.field(default_factory=dict)
    # What messages call it where that is not `loc` (one safetensors file of a folder).
    shown: str | None = None
    # The CRC-32C its commit records of each chunk, by array name and chunk name (see
    # `_format.vouched`): every chunk read is checked against it.
    vouched: _vouched.Record = dataclasses.field(default_factory=dict)

    @property
    def url(self) -> str:
        """The checkpoint as messages name it: what the user gave."""
        return self.shown or self.loc.url

    def read(self, leaf: StoredLeaf, box: Region) -> np.ndarray:
        """The values of `leaf` inside `box`, reading each chunk it touches once.

        Raises CheckpointCorruptError naming the chunk if one is missing, a symbolic
        link, or has the wrong size or checksum, with a note naming the leaf;
        CheckpointNotFoundError if that is because the checkpoint was deleted or
        replaced while being read.
        """
        with self._reading(leaf):
            return _read_box(self.loc, leaf, box, self.vouched)

    def read_own(self, leaf: StoredLeaf, process: int) -> Any:
        """Process `process`'s value of the per-process `leaf` (see `_tree.PerProcess`)."""
        with self._reading(leaf):
            own, document = read_own_array(self.loc, leaf, process)
            data = _read_box(self.loc, own, ((0, own.shape[0]),), self.vouched).tobytes()
            try:
                return _tree.Encoded.decode(document["attributes"][_naming.META_ATTR]["encoding"], data)
            except (KeyError, TypeError, ValueError, IndexError) as e:
                raise CheckpointCorruptError(f"{own.name}/zarr.json of checkpoint {self.loc.url} is malformed: "
                                             f"{e!r}") from e

    def check_unchanged(self) -> None:
        """Raises CheckpointNotFoundError if the checkpoint read is no longer there as it
        was opened: deleted, or replaced by another save (one small read). Called after
        the last read, so that no result mixes two saves, and on damage, which a
        deletion or replacement under the reader looks like."""
        if not self.committed or self.layout == _safetensors.LAYOUT:
            return  # a save in progress, which changes by design; a safetensors file, which has no marker
        now = _commit.head(self.loc)
        if now.state is _commit.State.UNCOMMITTED and now.save_id not in (None, self.save_id):
            raise CheckpointNotFoundError(
                f"checkpoint {self.loc.url} is being replaced by another save while it was being read (not yet "
                "committed): read it again once that save has committed")
        if now.state is not _commit.State.COMMITTED:
            raise CheckpointNotFoundError(
                f"checkpoint {self.loc.url} was deleted while it was being read (its commit marker is gone: "
                "retention or another job removed it); read a newer step")
        if now.save_id != self.save_id:
            raise CheckpointNotFoundError(
                f"checkpoint {self.loc.url} was replaced while being read (another save overwrote it); "
                "read it again")

    @contextlib.contextmanager
    def _reading(self, leaf: StoredLeaf) -> Iterator[None]:
        """Names the leaf in any failure. Damage (a missing, short or corrupt chunk)
        in a checkpoint that has meanwhile been deleted or replaced is that, not damage;
        a symbolic link where a chunk should be is damage. Damage leaves as
        CheckpointCorruptError itself: its private subclasses are for the readers' own
        `except` clauses (verify's), not names a user can import or look up."""
        note = f"while reading leaf {leaf.where} (array {leaf.name!r}) of {self.loc.url}"
        try:
            yield
        except (MissingObject, DamagedChunk, _storage.NotAFileInCheckpoint) as e:
            self.check_unchanged()
            damaged = CheckpointCorruptError(str(e))
            damaged.add_note(note)
            damaged.add_note(f"the checkpoint is damaged: `zarrckpt verify {self.loc.url}` lists every damaged "
                             "object; restore an earlier step")
            raise damaged from None
        except Exception as e:
            e.add_note(note)
            raise


def _read_box(loc: Location, leaf: StoredLeaf, box: Region, vouched: _vouched.Record) -> np.ndarray:
    nbytes = _dtypes.nbytes(region_shape(box), leaf.dtype)
    if nbytes > _MEMORY_BYTES:
        # A hostile or damaged checkpoint must not make us try to allocate it.
        raise CheckpointCorruptError(
            f"leaf {leaf.where} of {loc.url} needs {nbytes:,} bytes for {box}, more than this machine's "
            f"{_MEMORY_BYTES:,} bytes of memory")
    out = _aligned_empty(region_shape(box), leaf.dtype)
    in_part = threading.Lock()

    def read(chunk: Region) -> None:
        inside = intersect(chunk, box)
        # The trailing Ellipsis keeps a 0-d result a view, not a scalar copy.
        dest = out[relative(inside, box) + (Ellipsis,)]
        # The common case: the chunk's bytes land in the result with no copy.
        expect = _vouched.recorded(vouched, leaf.codec.key(chunk)) if vouched else None
        if inside == chunk and all(b - a == c for (a, b), c in zip(chunk, leaf.chunks)) and dest.flags.c_contiguous:
            read_chunk(loc, leaf.codec, chunk, out=dest, expect=expect)
            return
        # Read whole into memory of its own: room for it in the restore's byte budget,
        # or else one such chunk at a time.
        hold = _concurrency.spare(_dtypes.nbytes(region_shape(chunk), leaf.dtype)) if lent else None
        with contextlib.nullcontext() if hold is not None else in_part:
            try:
                dest[...] = read_chunk(loc, leaf.codec, chunk, expect=expect)[relative(inside, chunk)]
            finally:
                if hold is not None:
                    hold.release()

    # A large box of several chunks (a device's whole shard: on one GPU, a whole leaf)
    # has its chunks read at once, by workers of the restore that no other read holds.
    # One after another, a state of a few large leaves kept a few cores busy (8 GiB in
    # 57 leaves, 8 of them large, on one H200: 2.2 GB/s against 5.5 for a plain read of
    # each leaf's file, all at once) and, over a store with a latency per request, left
    # its link idle between requests. The chunks are taken as the reads go (hostile
    # metadata may claim billions of them: the first one missing ends the read).
    count = math.prod(len(range(a // c, -(-b // c))) for (a, b), c in zip(box, leaf.chunks))
    together = count > 1 and (loc.requests_wait or out.nbytes >= _BOX_TOGETHER_BYTES)
    chunks = chunks_touching(box, leaf.chunks, leaf.shape)
    with _concurrency.spare_workers(min(_BOX_READERS, count) - 1 if together else 0) as lent:
        if lent:
            with _concurrency.Operation(1 + lent, "read") as op:
                op.fan_out(chunks, read)
        else:
            for chunk in chunks:
                read(chunk)
    return out


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-order array of `shape` and `dtype` whose first byte is aligned
    to `_BOX_ALIGNMENT`: on CPU devices its pieces become the restored arrays' buffers
    as they are."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + _BOX_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _BOX_ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def read_chunk(loc: Location, codec: ChunkCodec | _seqax.Codec | _safetensors.TensorCodec, chunk: Region,
               out: np.ndarray | None = None, expect: int | None = None) -> np.ndarray:
    """Reads the chunk covering `chunk` with `codec` (`ChunkCodec.read`: each format's
    way, straight into `out` where it can) and checks it, against `expect` too, the
    CRC-32C its commit records; its values in the chunk shape. MissingObject if it is
    absent, DamagedChunk naming it if its bytes are wrong."""
    try:
        return codec.read(loc, chunk, out, expect)
    except FileNotFoundError:
        raise MissingObject(f"{codec.part} {codec.key(chunk)!r} is missing from checkpoint {loc.url}") from None
    except Damage as e:
        raise DamagedChunk(codec.key(chunk), loc.url, str(e)) from None


def _where_instead(loc: Location) -> str:
    """Where the checkpoint meant by `loc` is, where that can be told: a directory of
    steps holds them (`run`), or a step was named unpadded (`run/8` for run/0000000008)."""
    steps = sorted(s for e in loc.list_dir() if (s := _naming.parse_step_dir_name(e.name)) is not None)
    if steps:
        return f" (it is a directory of steps: give one step's URL, the newest {loc.step(steps[-1]).url})"
    name = loc.url.rstrip("/").rpartition("/")[2]
    if name.isascii() and name.isdigit() and name != _naming.step_dir_name(int(name)):
        padded = loc.sibling(_naming.step_dir_name(int(name)))
        if _commit.head(padded).state is not _commit.State.ABSENT:
            return f" (step {int(name)} is {padded.url})"
    return ""


def open_checkpoint(loc: Location, *, require_committed: bool = True, group: _commit.Group | None = None,
                    save_id: str | None = None) -> Checkpoint:
    """Opens the checkpoint at `loc`: one metadata read for a committed zarrckpt checkpoint
    (none if `group`, its group metadata, was already read).

    Raises CheckpointNotFoundError if there is none, if it is not committed and
    `require_committed`, or if `save_id` is given and it is another save's (the step
    chosen was replaced); CheckpointCorruptError if its metadata cannot be understood.
    """
    group = group or _commit.read_group(loc)
    if group is None:
        raise CheckpointNotFoundError(f"no checkpoint at {loc.url}{_where_instead(loc)}")
    if group.problem is not None:
        name = "zarr.json" if group.zarr_format == 3 else _seqax.MARKER
        raise CheckpointCorruptError(f"{loc.url}/{name}, the checkpoint's metadata, {group.problem}")
    committed = group.state is _commit.State.COMMITTED
    if require_committed and not committed:
        raise CheckpointNotFoundError(
            f"checkpoint at {loc.url} is not committed (no '{_naming.COMMIT_ATTR}: true'): "
            "it is incomplete, or still being written"
        )
    if save_id is not None and group.save_id != save_id:
        raise CheckpointNotFoundError(f"checkpoint {loc.url} was replaced by another save after it was chosen; "
                                      "restore again")
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
    if not isinstance(spec, dict):
        raise CheckpointCorruptError(f"checkpoint {loc.url} has malformed metadata: no tree record")
    try:
        records = _checked_records(spec)  # before any read: names decide which objects are read
        shared = [rec["name"] for _, rec in records if rec.get("type") != "per_process"]
        try:
            arrays = _array_documents(loc, document, shared)
        except CheckpointCorruptError as e:  # MissingObject too
            if committed:
                raise
            # A save still running writes its arrays' metadata beside its chunks: not damage.
            raise CheckpointNotFoundError(f"checkpoint at {loc.url} is not committed and not all there ({e}): its "
                                          "save is still running, or stopped part-way") from None
        leaves = {rec["name"]: stored_leaf(path, rec, arrays.get(rec["name"])) for path, rec in records}
        vouched = _vouched.parse(meta)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError,
            CheckpointCorruptError) as e:
        raise CheckpointCorruptError(f"checkpoint {loc.url} has malformed metadata: {e!r}") from e
    save_id = meta.get(_commit.SAVE_ID)
    return Checkpoint(loc, "zarrckpt", committed, spec, leaves, _tree.name_of, meta,
                      save_id if isinstance(save_id, str) else None, arrays, vouched=vouched)


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
        return _zarrjson.decode(loc.read(key))
    except FileNotFoundError:
        raise MissingObject(f"{key} is missing from checkpoint {loc.url}") from None
    except ValueError:
        raise CheckpointCorruptError(f"{key} of checkpoint {loc.url} is not JSON") from None


# More processes than any job has: a per-process leaf claiming more is damaged or
# hostile (each process's value is an object a reader would ask for).
MAX_PROCESSES = 2**20
# The leaf kinds a tree record can name (see _tree.leaf_record).
_KINDS = frozenset({"jax", "numpy", "numpy_scalar", "prng_key", "bool", "int", "float", "complex", "str", "bytes"})


def stored_leaf(path: _tree.KeyPath, rec: dict[str, Any], array: dict[str, Any] | None) -> StoredLeaf:
    """A leaf record checked against its array's metadata: they must agree exactly, and
    describe an array that zarrckpt could have written (ValueError otherwise). A
    per-process leaf has no shared array: each process's value is its own array."""
    if rec["type"] == "per_process":
        processes = rec["processes"]
        if isinstance(processes, bool) or not isinstance(processes, int) or not 1 <= processes <= MAX_PROCESSES:
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
    # Only the names zarrckpt writes: another spelling of the same type (">f", "<f4")
    # passes the array's checks, which name the type alone, and ">f" reads its bytes
    # in the wrong order.
    if rec["dtype"] != _dtypes.dtype_name(dtype):
        raise ValueError(f"leaf {where}: dtype {rec['dtype']!r}, which zarrckpt never writes (it writes "
                         f"{_dtypes.dtype_name(dtype)!r})")
    if kind not in _KINDS or (kind == "prng_key") != isinstance(impl, str):
        raise ValueError(f"leaf {where}: kind {kind!r} (PRNG implementation {impl!r})")
    if impl and (problem := key_data_problem(impl, shape, dtype)) is not None:
        raise ValueError(f"leaf {where}: {problem}")
    listed = array.get("codecs")
    codecs: list[Any] = listed if isinstance(listed, list) else []
    checksum = _chunks.CRC32C_CODEC in codecs
    compression = next((c["configuration"].get("cname") for c in codecs if isinstance(c, dict)
                        and c.get("name") == "blosc" and isinstance(c.get("configuration"), dict)), None)
    if compression not in (None, *_chunks.COMPRESSIONS):
        raise ValueError(f"leaf {where}: compressed with {compression!r}, which zarrckpt never writes")
    expected = {"shape": list(shape), **_dtype_fields(dtype, checksum, compression)}
    for field in ("shape", "data_type", "codecs", "chunk_key_encoding"):
        if array.get(field) != expected[field]:
            raise ValueError(f"leaf {where}: array {field} {array.get(field)!r}, expected {expected[field]!r}")
    if (len(chunks) != len(shape) or any(d < 0 for d in shape) or math.prod(shape) >= 2**62
            or not all(1 <= c <= max(d, 1) for c, d in zip(chunks, shape))):
        raise ValueError(f"leaf {where}: shape {shape} with chunks {chunks}")
    if (count := math.prod(_chunks.grid(shape, chunks))) > _chunks.MAX_GRID:
        raise ValueError(f"leaf {where}: shape {shape} in chunks of {chunks}, a grid of {count:,} chunks, more than "
                         f"zarrckpt ever writes ({_chunks.MAX_GRID:,})")
    codec = ChunkCodec(rec["name"], dtype, chunks, checksum, compression)
    if (problem := codec.compression_problem()) is not None:
        raise ValueError(f"leaf {where}: {problem}")
    return StoredLeaf(path, rec["name"], shape, dtype, kind, codec, impl)


def key_data_problem(impl: str, shape: tuple[int, ...], dtype: np.dtype) -> str | None:
    """Why data of `shape` and `dtype` cannot be typed PRNG keys of the implementation
    `impl` (an unknown one, or data of another shape or dtype), or None."""
    key_shape = _key_data_shape(impl)
    if key_shape is None:
        return f"PRNG implementation {impl!r} is not one this jax has"
    if dtype != np.uint32 or len(shape) < len(key_shape) or shape[len(shape) - len(key_shape):] != key_shape:
        return (f"{dtype}{list(shape)} cannot be the key data of {impl} keys "
                f"(uint32[..., {', '.join(map(str, key_shape))}])")
    return None


@functools.cache
def _key_data_shape(impl: str) -> tuple[int, ...] | None:
    try:
        return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape)
    except (ValueError, TypeError):
        return None


def read_own_array(loc: Location, leaf: StoredLeaf, process: int) -> tuple[StoredLeaf, dict[str, Any]]:
    """The array holding `process`'s value of the per-process `leaf`, from its own
    `zarr.json`, and that document. MissingObject if it is absent,
    CheckpointCorruptError if it is malformed."""
    key = _naming.object_key(_naming.per_process_name(leaf.name, process), "zarr.json")
    document = _load_json(loc, key)
    try:
        return own_array(leaf, process, document), document
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise CheckpointCorruptError(f"{key} of checkpoint {loc.url} is malformed: {e!r}") from e


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


@functools.cache
def _dtype_fields(dtype: np.dtype, checksum: bool, compression: str | None) -> dict[str, Any]:
    """The fields of an array's `zarr.json` that its dtype and codecs fix. Cached: zarr's
    fill-value code makes a whole document cost ~50 us, 50 ms for 1000 leaves, while
    a restore waits."""
    doc = _zarrjson.array_document((), ChunkCodec("", dtype, (), checksum, compression))
    return {field: doc[field] for field in ("data_type", "codecs", "chunk_key_encoding")}


def _open_seqax(loc: Location, committed: bool) -> Checkpoint:
    try:
        arrays = _seqax.read_arrays(loc)
    except (ValueError, TypeError) as e:
        raise CheckpointCorruptError(f"seqax checkpoint {loc.url}: {e}") from e
    leaves = {codec.array: StoredLeaf(path, codec.array, shape, codec.dtype, "numpy", codec)
              for path, codec, shape in arrays}
    spec = _seqax.spec_from_paths([(leaf.path, leaf.name) for leaf in leaves.values()])
    return Checkpoint(loc, _seqax.LAYOUT, committed, spec, leaves, _seqax.name_of, {})
