"""Write planning: the chunk shape of every array, and which device writes which chunk.

The rules (docs/pytree-zarr-checkpoint.md, "Chunks"):
- chunk boundaries fall on every shard boundary, so each chunk lies inside one shard
  and every write covers a whole chunk (no read-modify-write, no shared chunks);
- a shard larger than `max_chunk_bytes`, or held by several replicas, is split into
  more chunks, and the chunks of a replicated shard are dealt out over its replicas,
  so replicated data is written by every host that holds it, not by one device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from . import _dtypes, _multihost
from ._chunks import ChunkCodec
from ._concurrency import ByteBudget
from ._tree import Leaf

DEFAULT_MAX_CHUNK_BYTES = 64 * 2**20
# A replicated shard smaller than this per replica is not worth splitting.
_MIN_REPLICA_SPLIT_BYTES = 2**20

Region = tuple[tuple[int, int], ...]  # (start, stop) per axis


def region_slices(region: Region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def region_of(index: Sequence[slice], shape: Sequence[int]) -> Region:
    """A device's index (a tuple of slices, as jax gives it) as (start, stop) pairs."""
    out = []
    for s, dim in zip(index, shape):
        start, stop, step = s.indices(dim)
        if step != 1:
            raise ValueError(f"strided shard index {index} is not supported")
        out.append((start, stop))
    return tuple(out)


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(b - a for a, b in region)


def region_size(region: Region) -> int:
    return math.prod(region_shape(region))


@dataclasses.dataclass
class WriteUnit:
    """One chunk to write: its place in the array and where its data comes from."""

    region: Region
    nbytes: int
    host: np.ndarray | None = None  # a numpy leaf: the whole array
    device_data: jax.Array | None = None  # the single-device shard holding the chunk
    offset: tuple[int, ...] = ()  # where that shard starts in the array
    _pending: Any = None  # the transfer in flight: a host view, or a device piece
    _owned: np.ndarray | None = None  # a staged copy, independent of the source
    _budget: ByteBudget | None = None  # holds `nbytes` of it until released

    def hold(self, budget: ByteBudget) -> None:
        """Records that this unit holds `nbytes` of `budget`, given back by `release`."""
        self._budget = budget

    def start_transfer(self) -> None:
        """Starts the device-to-host copy without waiting for it."""
        if self.device_data is None or self._pending is not None:
            return
        local = tuple(slice(a - o, b - o) for (a, b), o in zip(self.region, self.offset))
        data = self.device_data
        if data.devices().pop().platform == "cpu":
            # CPU buffers convert to numpy without a copy; slicing there is free.
            self._pending = np.asarray(data)[local]
        else:
            # Copy only this chunk off the accelerator, not the whole shard.
            piece = data if tuple(data.shape) == tuple(s.stop - s.start for s in local) else data[local]
            piece.copy_to_host_async()
            self._pending = piece

    def host_array(self) -> np.ndarray:
        """The chunk's data on the host (waits for the copy)."""
        if self._owned is not None:
            return self._owned
        if self.host is not None:
            return self.host[region_slices(self.region)]
        self.start_transfer()
        return np.asarray(self._pending)

    def stage(self) -> None:
        """Keeps a host copy this unit owns, so that the source (a device buffer that
        training may donate, a numpy array it may mutate) is free to change."""
        data = self.host_array()
        # On CPU and for numpy leaves, host_array() is a view of the source itself.
        self._owned = data if data.flags.owndata else np.array(data)
        self.host = self.device_data = self._pending = None

    def release(self) -> None:
        """Drops every reference to the chunk's data and gives back its budget."""
        self.host = self.device_data = self._pending = self._owned = None
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.release(self.nbytes)


@dataclasses.dataclass
class ArrayPlan:
    """How one leaf is stored: shape, dtype, chunk shape, and this process's writes."""

    leaf: Leaf
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    writes: list[WriteUnit]
    checksum: bool = True

    @functools.cached_property
    def codec(self) -> ChunkCodec:
        return ChunkCodec(self.leaf.name, self.dtype, self.chunks, self.checksum)

    @property
    def nbytes(self) -> int:
        return _dtypes.nbytes(self.shape, self.dtype)


def split_chunk(chunk: Sequence[int], pieces: int) -> tuple[int, ...]:
    """Divides `chunk` into at least `pieces` equal parts, leading axes first.

    Only exact divisors are used, so the smaller chunks still tile the shard.
    """
    out = list(chunk)
    need = pieces
    for axis, dim in enumerate(chunk):
        if need <= 1:
            break
        divisor = _smallest_divisor_at_least(dim, need) if dim > 1 else 1
        out[axis] = dim // divisor
        need = math.ceil(need / divisor)
    return tuple(max(1, c) for c in out)


def _smallest_divisor_at_least(n: int, low: int) -> int:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return min(d for d in small + [n // d for d in small] if d >= low) if low <= n else n


def _grid_chunk(shape: Sequence[int], regions: Sequence[Region]) -> list[int]:
    """The largest chunk whose grid has a boundary at every shard boundary."""
    chunk = []
    for axis, dim in enumerate(shape):
        cuts = {x for r in regions for x in r[axis]} - {0, dim}
        chunk.append(math.gcd(*cuts) if cuts else max(dim, 1))
    return chunk


def _chunks_in(region: Region, chunks: Sequence[int]) -> Iterator[Region]:
    """The chunks of the array grid inside `region`, in C order."""
    ranges = [range(a, b, c) for (a, b), c in zip(region, chunks)]
    for starts in np.ndindex(*(len(r) for r in ranges)):
        yield tuple(
            (r[i], min(r[i] + c, b)) for r, i, c, (_, b) in zip(ranges, starts, chunks, region)
        )


def _pieces_for(nbytes: int, replicas: int, max_chunk_bytes: int) -> int:
    by_size = math.ceil(nbytes / max_chunk_bytes)
    by_replicas = min(replicas, max(1, nbytes // _MIN_REPLICA_SPLIT_BYTES))
    return max(1, by_size, by_replicas)


def plan_array(leaf: Leaf, salt: int, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
               checksum: bool = True, *, local: bool = False) -> ArrayPlan:
    """Plans one leaf. Every process computes the same chunks and the same writers;
    `checksum` says whether its chunks carry a CRC-32C. A `local` array (a
    per-process value) is this process's alone: it writes every chunk.

    `salt` (the leaf's position) rotates which replica writes a single-chunk shard,
    so that many small replicated leaves spread over devices and hosts too.
    """
    value = leaf.value
    dtype = np.dtype(value.dtype) if hasattr(value, "dtype") else np.result_type(value)
    shape = tuple(np.shape(value))
    if isinstance(value, jax.Array) and (not value.is_fully_addressable or _multihost.process_count() == 1):
        return _plan_sharded(leaf, value, shape, dtype, salt, max_chunk_bytes, checksum)
    # Host data (numpy, scalars, process-local jax arrays) is the same on every process
    # by contract; process 0 alone writes it so that no chunk has two writers.
    chunks = split_chunk(shape, _pieces_for(_dtypes.nbytes(shape, dtype), 1, max_chunk_bytes))
    writes = []
    if _multihost.process_index() == 0 or local:
        host = np.asarray(value, dtype=dtype)
        full: Region = tuple((0, d) for d in shape)
        writes = [WriteUnit(r, _dtypes.nbytes(region_shape(r), dtype), host=host) for r in _chunks_in(full, chunks)
                  if region_size(r)]
    return ArrayPlan(leaf, shape, dtype, chunks, writes, checksum)


def _plan_sharded(leaf: Leaf, value: jax.Array, shape: tuple[int, ...], dtype: np.dtype, salt: int,
                  max_chunk_bytes: int, checksum: bool) -> ArrayPlan:
    replicas: dict[Region, list[jax.Device]] = {}
    for device, index in value.sharding.devices_indices_map(shape).items():
        replicas.setdefault(region_of(index, shape), []).append(device)
    for devices in replicas.values():
        devices.sort(key=lambda d: d.id)
    largest = max(_dtypes.nbytes(region_shape(r), dtype) for r in replicas)
    count = max(len(d) for d in replicas.values())
    chunks = split_chunk(_grid_chunk(shape, list(replicas)), _pieces_for(largest, count, max_chunk_bytes))

    shards = {s.device: s for s in value.addressable_shards}
    writes = []
    for region, devices in replicas.items():
        inside = list(_chunks_in(region, chunks))
        for k, chunk in enumerate(inside):
            # Contiguous runs of chunks per replica, replicas spaced evenly over the
            # (id-sorted, so host-grouped) devices: few chunks still reach every host.
            writer = devices[(salt + k * len(devices) // len(inside)) % len(devices)]
            if writer in shards and region_size(chunk):
                writes.append(WriteUnit(chunk, _dtypes.nbytes(region_shape(chunk), dtype),
                                        device_data=shards[writer].data,
                                        offset=tuple(a for a, _ in region)))
    return ArrayPlan(leaf, shape, dtype, chunks, writes, checksum)


def intersect(x: Region, y: Region) -> Region:
    return tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y))


def chunks_touching(box: Region, chunks: Sequence[int], shape: Sequence[int]) -> Iterator[Region]:
    """The chunks of the array grid that overlap `box`, in C order."""
    yield from _chunks_in(_aligned(box, chunks, shape), chunks)


def _aligned(region: Region, chunks: Sequence[int], shape: Sequence[int]) -> Region:
    return tuple((a // c * c, min(-(-b // c) * c, d)) for (a, b), c, d in zip(region, chunks, shape))


def _overlap(x: Region, y: Region) -> bool:
    return all(a < d and c < b for (a, b), (c, d) in zip(x, y))


def bounding_box(regions: Sequence[Region]) -> Region:
    """The bounding box of `regions`."""
    return tuple((min(r[i][0] for r in regions), max(r[i][1] for r in regions)) for i in range(len(regions[0])))


def plan_reads(regions: Sequence[Region], chunks: Sequence[int], shape: Sequence[int]) -> list[tuple[Region, list[Region]]]:
    """Groups the regions one process needs so that each chunk is read only once.

    Regions that share a chunk (directly or through a chain) are read together as
    their bounding box; each group is (box to read, regions cut from it).
    """
    groups = [[r] for r in dict.fromkeys(regions)]
    merged = True
    while merged:
        merged = False
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                if _overlap(_aligned(bounding_box(groups[i]), chunks, shape), _aligned(bounding_box(groups[j]), chunks, shape)):
                    groups[i] += groups.pop(j)
                    merged = True
                    break
            if merged:
                break
    return [(bounding_box(g), g) for g in groups]
