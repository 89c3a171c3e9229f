"""Write planning: the chunk shape of every array, and which device writes which chunk.

The rules (docs/pytree-zarr-checkpoint.md, "Chunks"):
- chunk boundaries fall on every shard boundary, and every chunk has exactly one
  writer, which holds all of it: every write covers a whole chunk (no
  read-modify-write, no shared chunks);
- a shard larger than `max_chunk_bytes`, or held by several replicas, is split into
  more chunks, and the chunks of a replicated shard are dealt out over its replicas,
  so replicated data is written by every host that holds it, not by one device;
- shards smaller than `min_chunk_bytes` are merged: a chunk covers several whole
  shards side by side when one process holds them all (its local devices' shards, or
  a small array whole), so that a small leaf is one object per writing process, not
  one per device.

Who writes which chunk is the save's `Writers`: `ONE_WRITER` (one group shared by
every process, each chunk written once) or `EVERY_HOLDER` (the local tier, see
`_tiers`: the same chunk grid, but each process writes every chunk its own devices
hold, replicas included, since its copy must rebuild its part of the state without
any other host).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .._format import dtypes as _dtypes
from .._format.chunks import ChunkCodec
from .._format.tree import Deferred, Leaf
from .._options import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MIN_CHUNK_BYTES
from .._util import permute as _permute
from .._util.concurrency import Hold
from .._util.regions import (
    HostOf,
    Region,
    Slices,
    aligned,
    chunks_in,
    intersect,
    process_of,
    region_of,
    region_shape,
    region_size,
    relative,
    replicas_of,
)
from .host_copies import HostCopy, SharedHold

# A replicated shard smaller than this per replica is not worth splitting.
_MIN_REPLICA_SPLIT_BYTES = 2**20

# One part of a chunk: the device whose shard holds it, the part of that shard to take
# and where it goes in the chunk (None: all of it).
Part = tuple[jax.Device, Slices | None, Slices | None]


class PartCopy(NamedTuple):
    """One part of a chunk on the host (see `_transfer.start`)."""

    put: Slices | None  # where it goes in the chunk (None: all of it)
    source: HostCopy | np.ndarray | Deferred | SourceChunk  # a host copy; or a host leaf, an import's source
    device: jax.Device | None  # a whole array's copy: the device whose shard it is
    take: Slices | None  # the part of the source to take (None: all of it)


@dataclasses.dataclass
class WriteUnit:
    """One chunk to write: its place in the array, where its data comes from, and (once
    `_transfer.start` has run) where its host copy is."""

    region: Region
    nbytes: int
    # A host leaf: the whole array; an import's: where to read it (see `SourceChunk`).
    host: np.ndarray | Deferred | SourceChunk | None = None
    # A jax.Array leaf: the parts of it that make up the chunk, read from the device the
    # plan deals it to. One, or several side by side when small shards are merged.
    sources: tuple[Part, ...] = ()
    copies: list[PartCopy] | None = None  # each part on the host, once its copy is started
    hold: Hold | SharedHold | None = None  # its bytes of the save's budget, from its copy until it is written
    key: str | None = None  # its chunk's object key, once asked (`ArrayPlan.key`)

    @property
    def imported(self) -> bool:
        """Whether the chunk is read from an import's source (see `Deferred.values`)."""
        return isinstance(self.host, (Deferred, SourceChunk))

    def host_array(self) -> np.ndarray:
        """The chunk's values on the host; waits for its copies to arrive."""
        assert self.copies is not None, "the unit's transfer was not started"
        parts = [(part.put, _on_host(part)) for part in self.copies]
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]
        out = np.empty(region_shape(self.region), parts[0][1].dtype)
        for put, part in parts:
            out[put] = part
        return out

    def release(self) -> None:
        """Drops every reference to the chunk's data (a pinned buffer goes back once no
        chunk reads it any more) and gives back its budget."""
        self.host = self.copies = None
        hold, self.hold = self.hold, None
        if hold is not None:
            hold.release()


@dataclasses.dataclass
class ArrayPlan:
    """How one leaf is stored: shape, dtype, chunk shape, and this process's writes."""

    leaf: Leaf
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    writes: list[WriteUnit]
    checksum: bool = True
    # A jax.Array leaf: the shards this process writes all of, each to be copied to the
    # host once, whole, from one device (see `Writes`)...
    copy_from: dict[jax.Device, jax.Device] = dataclasses.field(default_factory=dict)
    # ...and whether those are all its local shards, so that it is copied as one array.
    copy_all: bool = False
    # A peer copy's part (see `_peers`): the leaf's blocks, once moved onto this process's
    # devices, that its units are copied from.
    moved: Moved | None = None
    # The save's `compression`, which its chunks get where they are large enough (see
    # `ChunkCodec.of`).
    compression: str | None = None

    @property
    def array(self) -> Any:
        """What the units are copied from: the leaf's value, or its moved blocks."""
        return self.leaf.value if self.moved is None else self.moved.array

    @functools.cached_property
    def codec(self) -> ChunkCodec:
        return ChunkCodec.of(self.leaf.name, self.dtype, self.chunks, self.checksum, self.compression)

    def key(self, unit: WriteUnit) -> str:
        """The object key of `unit`'s chunk (kept on the unit, and by `again`)."""
        if unit.key is None:
            unit.key = self.codec.key(unit.region)
        return unit.key

    def template(self) -> ArrayPlan | None:
        """This plan without its leaf's value or anything of its save, for `again`; None
        where its writes hold the value (a host leaf's), which every save plans afresh."""
        if any(unit.host is not None for unit in self.writes) or self.moved is not None:
            return None
        for unit in self.writes:
            self.key(unit)
        return self.again(Leaf(self.leaf.path, self.leaf.name, None))

    def again(self, leaf: Leaf) -> ArrayPlan:
        """This plan for `leaf`: a value of the same kind, shape, dtype and sharding at the
        same place in a tree of the same structure (see `plan_cache`), with writes of its own."""
        plan = ArrayPlan(leaf, self.shape, self.dtype, self.chunks,
                         [WriteUnit(unit.region, unit.nbytes, sources=unit.sources, key=unit.key)
                          for unit in self.writes],
                         self.checksum, self.copy_from, self.copy_all, compression=self.compression)
        plan.__dict__["codec"] = self.codec  # `codec`'s cache: pure in what the two plans share
        return plan

    @property
    def nbytes(self) -> int:
        return _dtypes.nbytes(self.shape, self.dtype)


def split_chunk(chunk: Sequence[int], pieces: int, shape: Sequence[int] | None = None) -> tuple[int, ...]:
    """Divides `chunk` into about `pieces` parts, leading axes first (a split of the
    leading axis keeps each part contiguous in memory).

    On an axis where `chunk` spans all of `shape`, any size tiles it (the last part
    is cut at the array's edge); elsewhere the parts must still tile the shard, so
    only exact divisors are used. Either way an exact divisor giving between `pieces`
    and twice as many parts is preferred (no edge part); failing one, a constrained
    axis takes the nearest divisor below and leaves the rest of the split to the next
    axis. Never finer than needed: a leading axis of prime length is not cut into
    single rows (a 104,857-row leaf became 104,857 chunk objects).
    """
    out = list(chunk)
    need = pieces
    for axis, dim in enumerate(chunk):
        if need <= 1:
            break
        if dim <= 1:
            continue
        divisors = _divisors(dim)
        if exact := [d for d in divisors if need <= d <= 2 * need]:
            parts = exact[0]
            out[axis] = dim // parts
        elif shape is not None and dim >= shape[axis]:
            out[axis] = -(-dim // need)
            parts = -(-dim // out[axis])
        else:
            parts = max(d for d in divisors if d <= need)
            out[axis] = dim // parts
        need = -(-need // parts)
    return tuple(max(1, c) for c in out)


def _divisors(n: int) -> list[int]:
    """The divisors of `n` (> 0), ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _grid_chunk(shape: Sequence[int], regions: Sequence[Region]) -> list[int]:
    """The largest chunk whose grid has a boundary at every shard boundary."""
    chunk = []
    for axis, dim in enumerate(shape):
        cuts = {x for r in regions for x in r[axis]} - {0, dim}
        chunk.append(math.gcd(*cuts) if cuts else max(dim, 1))
    return chunk


def _pieces_for(nbytes: int, replicas: int, max_chunk_bytes: int) -> int:
    by_size = math.ceil(nbytes / max_chunk_bytes)
    by_replicas = min(replicas, max(1, nbytes // _MIN_REPLICA_SPLIT_BYTES))
    return max(1, by_size, by_replicas)


class OneWriter:
    """Each chunk written once, by the process (and device) the plan deals it to; a host
    value, the same on every process by contract, by process 0 alone."""

    def chunks(self, layout: Layout, salt: int, process: int) -> Writes:
        return layout.writes(salt, process)

    def writes_host_values(self, process: int) -> bool:
        return process == 0


class EveryHolder:
    """Every chunk a process's devices hold, and every host value, written by that
    process: each process's own copy (the local tier)."""

    def chunks(self, layout: Layout, salt: int, process: int) -> Writes:
        return layout.held_writes(process)

    def writes_host_values(self, process: int) -> bool:
        return True


Writers = OneWriter | EveryHolder
ONE_WRITER, EVERY_HOLDER = OneWriter(), EveryHolder()


def plan_array(leaf: Leaf, salt: int, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
               checksum: bool = True, *, process: int, processes: int, own: bool = False,
               writers: Writers = ONE_WRITER, min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
               host_of: HostOf = process_of, compression: str | None = None) -> ArrayPlan:
    """Plans one leaf for `process` of `processes`, the device `host_of` says where each
    device is. Every process computes the same chunks and the same writers; `checksum`
    says whether its chunks carry a CRC-32C, `compression` how they may be compressed
    (see `ArrayPlan.compression`). An `own` array (a per-process value) is
    this process's alone: it writes every chunk. `writers` says which chunks each
    process writes.

    `salt` (the leaf's position) rotates which replica writes a single-chunk shard,
    so that many small replicated leaves spread over devices and hosts too.
    """
    value = leaf.value
    dtype = np.dtype(value.dtype) if hasattr(value, "dtype") else np.result_type(value)
    shape = tuple(np.shape(value))
    if isinstance(value, jax.Array) and (not value.is_fully_addressable or processes == 1):
        lay = layout(value.sharding, shape, dtype.itemsize, max_chunk_bytes, min_chunk_bytes, host_of)
        mine = writers.chunks(lay, salt, process)
        units = [WriteUnit(chunk, size * dtype.itemsize, sources=parts) for chunk, size, parts in mine.units]
        return ArrayPlan(leaf, shape, dtype, lay.chunks, units, checksum, mine.copy_from, mine.copy_all,
                         compression=compression)
    # Host data: numpy, scalars, process-local jax arrays.
    source = value.chunks if isinstance(value, Deferred) else None
    if source is not None:
        chunks = _import_chunks(source, shape, dtype.itemsize, min_chunk_bytes, max_chunk_bytes)
    else:
        chunks = split_chunk(shape, _pieces_for(_dtypes.nbytes(shape, dtype), 1, max_chunk_bytes), shape)
    writes = []
    if own or writers.writes_host_values(process):
        host = value if isinstance(value, Deferred) else np.asarray(value, dtype=dtype)
        full: Region = tuple((0, d) for d in shape)
        writes = [WriteUnit(r, _dtypes.nbytes(region_shape(r), dtype), host=host) for r in chunks_in(full, chunks)
                  if region_size(r)]
        if source is not None and chunks != source and all(c <= s for c, s in zip(chunks, source)):
            _share_source_chunks(writes, source)  # parts of source chunks
    return ArrayPlan(leaf, shape, dtype, chunks, writes, checksum, compression=compression)


def _import_chunks(source: tuple[int, ...], shape: tuple[int, ...], itemsize: int, min_chunk_bytes: int,
                   max_chunk_bytes: int) -> tuple[int, ...]:
    """An import's chunk shape, from its source's (`Deferred.chunks`): a large source
    chunk cut into parts of at most `max_chunk_bytes`, small ones put together, whole,
    up to `min_chunk_bytes` (last axes first): either way each source chunk is read
    once (see `SourceChunk`)."""
    nbytes = math.prod(source) * itemsize
    if nbytes > max_chunk_bytes:
        return split_chunk(source, math.ceil(nbytes / max_chunk_bytes), shape)
    chunk = list(source)
    for axis in reversed(range(len(chunk))):
        size = math.prod(chunk) * itemsize
        if size >= min_chunk_bytes or size == 0:
            break
        chunk[axis] = min(chunk[axis] * math.ceil(min_chunk_bytes / size), shape[axis])
    return tuple(chunk)


def _share_source_chunks(writes: list[WriteUnit], source: tuple[int, ...]) -> None:
    """Points each unit, a part of one source chunk, at that chunk's `SourceChunk`."""
    groups: dict[Region, list[WriteUnit]] = {}
    for unit in writes:
        assert isinstance(unit.host, Deferred)
        groups.setdefault(aligned(unit.region, source, unit.host.shape), []).append(unit)
    for region, units in groups.items():
        assert isinstance(units[0].host, Deferred)
        shared = SourceChunk(units[0].host, region, len(units))
        for unit in units:
            unit.host = shared


def _on_host(part: PartCopy) -> np.ndarray:
    source = part.source
    if isinstance(source, HostCopy):
        return source.view(part.device, part.take)
    if part.take is None:  # a host leaf's part, taken already (a numpy scalar, for a 0-d one)
        return np.asarray(source)
    return source[part.take]  # a part of a host array, or of an import's source


class SourceChunk:
    """One chunk of an import's source that several write units are parts of: read whole
    by the first of them to need it (decoding a compressed chunk costs as much for a
    part as for all of it), and let go once each has taken its part."""

    def __init__(self, source: Deferred, region: Region, parts: int) -> None:
        self._source, self._region, self._left = source, region, parts
        self._data: np.ndarray | None = None
        self._lock = threading.Lock()

    def __getitem__(self, take: Slices) -> np.ndarray:
        """The values in `take` (slices of the whole array), a part of this chunk."""
        with self._lock:  # the other parts wait for the one read
            if self._data is None:
                self._data = self._source.values(self._region)
            data = self._data
            self._left -= 1
            if self._left == 0:
                self._data = None  # each part's view keeps it until that part is written
        return data[relative(region_of(take, self._source.shape), self._region)]


@dataclasses.dataclass
class Moved:
    """A leaf's blocks on their way to the processes keeping peer copies of them: `start`
    sends them (collective: every process starts the same leaves' in the same order),
    and `array` holds them on this process's devices until they are copied off."""

    source: jax.Array | None
    route: _permute.Pairs
    array: jax.Array | None = None

    def start(self) -> None:
        if self.source is not None:
            source, self.source = self.source, None
            self.array = _permute.move(source, self.route)


def plan_peer_array(own: ArrayPlan, route: _permute.Pairs, max_chunk_bytes: int, *, process: int,
                    min_chunk_bytes: int, written: set[Region], host_of: HostOf = process_of) -> ArrayPlan:
    """The peer copy's part of a leaf `own` plans (a local-tier save): the chunks that the
    process `route` sends its blocks to `process` holds and `process` does not write
    already (`written`),
    read from the moved blocks (see `Moved`). Its writes may be none: the move is
    collective all the same."""
    value = own.leaf.value
    lay = layout(value.sharding, own.shape, own.dtype.itemsize, max_chunk_bytes, min_chunk_bytes,
                 host_of).moved(_permute.mapping(value.sharding.mesh, route))
    assert lay.chunks == own.chunks, "a permutation of whole processes keeps the chunk grid"
    mine = Writes.of(lay, ((c, p) for c, p in lay.held(process) if c not in written), process)
    units = [WriteUnit(chunk, size * own.dtype.itemsize, sources=parts) for chunk, size, parts in mine.units]
    return ArrayPlan(own.leaf, own.shape, own.dtype, own.chunks, units, own.checksum, mine.copy_from,
                     mine.copy_all, Moved(value, route), compression=own.compression)


@dataclasses.dataclass(frozen=True)
class Writes:
    """One process's writes of an array of some layout: per chunk, its region, its size
    in elements and its parts (as `Layout.assignments` gives them).

    Which device a part is dealt to matters across hosts; within one, each shard
    region the process writes all of (every region, on a single host) is copied to the
    host once, whole, from one of its devices (`copy_from`: from each device a part is
    read from, to that one): slicing a shard on the device first is a copy of its own,
    which on CPU devices runs at once on the caller's thread. `copy_all` says those are
    every local shard of the array (no local replica is left out), so that it can be
    copied as one array.
    """

    units: tuple[tuple[Region, int, tuple[Part, ...]], ...]
    copy_from: dict[jax.Device, jax.Device]
    copy_all: bool

    @classmethod
    def of(cls, layout: Layout, chunks: Iterable[tuple[Region, list[Part]]], process: int) -> Writes:
        units = tuple((chunk, region_size(chunk), tuple(parts)) for chunk, parts in chunks if region_size(chunk))
        region_of = {device: region for region, devices in layout.replicas.items() for device in devices}
        read: dict[Region, list[Any]] = {}  # per region: the elements read, the device to copy it from
        for _, _, parts in units:
            for device, take, _ in parts:
                entry = read.setdefault(region_of[device], [0, device])
                entry[0] += region_size(region_of[device]) if take is None else math.prod(
                    t.stop - t.start for t in take)
        whole = {region: device for region, (count, device) in read.items() if count == region_size(region)}
        copy_from = {device: whole[region_of[device]] for _, _, parts in units for device, _, _ in parts
                     if region_of[device] in whole}
        local = {d for devices in layout.replicas.values() for d in devices if layout.host_of(d) == process}
        return cls(units, copy_from, set(whole.values()) == local)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The chunk grid of arrays of one shape and sharding, and who may write each chunk.

    `replicas` maps each distinct shard region to the devices holding it (sorted by id,
    so grouped by host). A chunk lies inside one shard (split: large shards, or shards
    held by several replicas, are cut into more chunks) or covers several whole shards
    of one process side by side (`merged`: small shards, so that no chunk is tiny).
    """

    chunks: tuple[int, ...]
    replicas: dict[Region, tuple[jax.Device, ...]]
    host_of: HostOf
    merged: _Shards | None = None

    def moved(self, to: dict[jax.Device, jax.Device]) -> Layout:
        """This layout with each device's blocks on the device `to` maps it to (see
        `_permute.move`), computed once per mapping."""
        key = tuple(sorted((a.id, b.id) for a, b in to.items()))
        found = self._moved.get(key)
        if found is None:
            replicas = {region: tuple(sorted((to[d] for d in devices), key=lambda d: d.id))
                        for region, devices in self.replicas.items()}
            merged = None if self.merged is None else _Shards.of(
                [end for _, end in self.merged.full], self.merged.base, replicas, self.host_of)
            found = self._moved[key] = Layout(self.chunks, replicas, self.host_of, merged)
        return found

    @functools.cached_property
    def _moved(self) -> dict[tuple[tuple[int, int], ...], Layout]:
        return {}

    def assignments(self, salt: int) -> Iterator[tuple[Region, int, list[Part]]]:
        """Every chunk with the process that writes it and, on that process, each device
        to copy from, the part of its shard to take and where it goes in the chunk."""
        if self.merged is None:
            for region, devices in self.replicas.items():
                inside = list(chunks_in(region, self.chunks))
                for k, chunk in enumerate(inside):
                    # Contiguous runs of chunks per replica, replicas spaced evenly over the
                    # (id-sorted, so host-grouped) devices: few chunks still reach every host.
                    writer = devices[(salt + k * len(devices) // len(inside)) % len(devices)]
                    yield chunk, self.host_of(writer), [(writer, None if chunk == region else
                                                         relative(chunk, region), None)]
            return
        for k, (chunk, holders, parts) in enumerate(self._merged_cells):
            writer = holders[(salt + k) % len(holders)]
            yield chunk, writer, [(first[writer], take, put) for first, take, put in parts]

    def writes(self, salt: int, process: int) -> Writes:
        """`process`'s writes of the chunks `assignments` deals it, computed once per
        layout, salt and process: a training loop saves arrays of the same layouts
        again and again, and many leaves share one."""
        return self._cached((salt % self._period, process),
                            ((c, p) for c, w, p in self.assignments(salt) if w == process), process)

    def held_writes(self, process: int) -> Writes:
        """`process`'s writes of every chunk it holds (see `held`), computed once."""
        return self._cached((-1, process), self.held(process), process)

    def _cached(self, key: tuple[int, int], chunks: Iterable[tuple[Region, list[Part]]], process: int) -> Writes:
        """The writes cached under `key`, made of `chunks` (a lazy iterable) on a miss."""
        found = self._writes.get(key)
        if found is None:
            found = self._writes[key] = Writes.of(self, chunks, process)
        return found

    @functools.cached_property
    def _writes(self) -> dict[tuple[int, int], Writes]:
        return {}

    @functools.cached_property
    def _period(self) -> int:
        """How often the writers `assignments` deals out repeat as the salt grows."""
        if self.merged is None:
            return math.lcm(*(len(devices) for devices in self.replicas.values()))
        return math.lcm(*(len(holders) for _, holders, _ in self._merged_cells))

    def held(self, process: int) -> Iterator[tuple[Region, list[Part]]]:
        """Every chunk `process` holds whole, with the parts to copy as `assignments`
        gives them (from its first device holding each shard)."""
        if self.merged is None:
            for region, devices in self.replicas.items():
                device = next((d for d in devices if self.host_of(d) == process), None)
                if device is not None:
                    for chunk in chunks_in(region, self.chunks):
                        yield chunk, [(device, None if chunk == region else relative(chunk, region), None)]
            return
        for chunk, holders, parts in self._merged_cells:
            if process in holders:
                yield chunk, [(first[process], take, put) for first, take, put in parts]

    @functools.cached_property
    def _merged_cells(self) -> list[tuple[Region, list[int], list[tuple[dict[int, jax.Device], Slices | None,
                                                                           Slices]]]]:
        """Per merged chunk, computed once for every leaf of this layout: the processes
        holding it whole, and per shard inside it, its first device on each process,
        the part of the shard to take and where it goes in the chunk."""
        assert self.merged is not None
        cells = []
        for chunk in chunks_in(self.merged.full, self.chunks):
            inside = self.merged.inside(chunk)
            parts = []
            for region in inside:
                first: dict[int, jax.Device] = {}
                for device in self.replicas[region]:
                    first.setdefault(self.host_of(device), device)
                part = intersect(chunk, region)
                parts.append((first, None if part == region else relative(part, region), relative(part, chunk)))
            cells.append((chunk, sorted(self.merged.holders(inside)), parts))
        return cells


@dataclasses.dataclass(frozen=True)
class _Shards:
    """Which shard each chunk of the base grid (the largest chunk that every shard
    boundary cuts) lies in, to tell quickly which shards a larger chunk covers."""

    full: Region
    base: tuple[int, ...]
    shard_of: dict[tuple[int, ...], Region]  # base chunk start -> the shard holding it
    processes: dict[Region, frozenset[int]]

    @classmethod
    def of(cls, shape: Sequence[int], base: Sequence[int], replicas: dict[Region, tuple[jax.Device, ...]],
           host_of: HostOf) -> _Shards:
        shard_of = {tuple(a for a, _ in c): region for region in replicas for c in chunks_in(region, base)}
        processes = {r: frozenset(host_of(d) for d in devices) for r, devices in replicas.items()}
        return cls(tuple((0, d) for d in shape), tuple(base), shard_of, processes)

    def inside(self, chunk: Region) -> list[Region]:
        """The shards a chunk made of whole base chunks covers."""
        return list(dict.fromkeys(self.shard_of[tuple(a for a, _ in c)] for c in chunks_in(chunk, self.base)))

    def holders(self, shards: Sequence[Region]) -> frozenset[int]:
        """The processes holding every one of `shards`."""
        return frozenset.intersection(*(self.processes[r] for r in shards))


@functools.lru_cache(maxsize=256)
def layout(sharding: jax.sharding.Sharding, shape: tuple[int, ...], itemsize: int, max_chunk_bytes: int,
           min_chunk_bytes: int, host_of: HostOf = process_of) -> Layout:
    """The layout of every array of this shape and sharding (many leaves share one),
    with each device on the process `host_of` says. Pure: a layout over many hosts can
    be planned in one process."""
    replicas = replicas_of(sharding, shape)
    base = _grid_chunk(shape, list(replicas))
    if len(replicas) > 1 and math.prod(base) * itemsize < min_chunk_bytes:
        shards = _Shards.of(shape, base, replicas, host_of)
        merged = _merged_chunk(shards, itemsize, min_chunk_bytes, max_chunk_bytes)
        if merged != shards.base:
            return Layout(merged, replicas, host_of, shards)
    largest = max(region_size(r) for r in replicas) * itemsize
    count = max(len(d) for d in replicas.values())
    return Layout(split_chunk(base, _pieces_for(largest, count, max_chunk_bytes), shape), replicas, host_of)


def _merged_chunk(shards: _Shards, itemsize: int, min_chunk_bytes: int, max_chunk_bytes: int) -> tuple[int, ...]:
    """The smallest chunk of at least `min_chunk_bytes` (else the largest one) made of
    whole base chunks, growing trailing axes first, such that one process holds every
    chunk of its grid whole and no chunk exceeds `max_chunk_bytes`."""
    chunk = list(shards.base)
    for axis in reversed(range(len(chunk))):
        dim, step = shards.full[axis][1], shards.base[axis]
        count = -(-dim // step)  # base chunks along the axis
        for multiple in (m for m in range(2, count + 1) if count % m == 0):
            if math.prod(chunk) * itemsize >= min_chunk_bytes:
                return tuple(chunk)
            candidate = chunk[:axis] + [min(multiple * step, dim)] + chunk[axis + 1:]
            if math.prod(candidate) * itemsize > max_chunk_bytes:
                break
            if all(shards.holders(shards.inside(c)) for c in chunks_in(shards.full, candidate)):
                chunk = candidate
    return tuple(chunk)
