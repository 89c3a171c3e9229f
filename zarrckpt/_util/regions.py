"""Boxes of arrays, as (start, stop) per axis, and the arithmetic on them that write
planning, read planning, reading and the chunk codecs share: the one place where a
region becomes slices, a shape, a grid of chunks, or a part of another region."""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # for annotations only: the on-disk format's modules import this one, and no JAX
    import jax

_T = TypeVar("_T")
Region = tuple[tuple[int, int], ...]  # (start, stop) per axis
Slices = tuple[slice, ...]
# Which process holds a device. Planners take it as an argument (the device's own
# `process_index` by default), so that a layout of many hosts can be planned, and
# tested, in one process.
HostOf = Callable[["jax.Device"], int]
process_of: HostOf = operator.attrgetter("process_index")


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


def chunks_in(region: Region, chunks: Sequence[int]) -> Iterator[Region]:
    """The chunks of the array grid inside `region`, in C order."""
    ranges = [range(a, b, c) for (a, b), c in zip(region, chunks)]
    for starts in indices(tuple(len(r) for r in ranges)):
        yield tuple(
            (r[i], min(r[i] + c, b)) for r, i, c, (_, b) in zip(ranges, starts, chunks, region)
        )


def first_absent(candidates: Iterable[_T], present: Container[_T], count: int) -> list[_T]:
    """The first `count` of `candidates` not in `present`, looking no further than that
    (a few missing chunks or processes named out of millions declared)."""
    return list(itertools.islice((c for c in candidates if c not in present), max(count, 0)))


def indices(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every index of an array of `shape`, in C order, one at a time: np.ndindex (and
    itertools.product, which it uses) first makes each dimension's range a tuple, 2.5 GB
    for metadata declaring a grid of 2**26 chunks in one dimension."""
    if 0 in shape:
        return
    index = [0] * len(shape)
    while True:
        yield tuple(index)
        for axis in range(len(shape) - 1, -1, -1):
            index[axis] += 1
            if index[axis] < shape[axis]:
                break
            index[axis] = 0
        else:
            return


def relative(part: Region, within: Region) -> Slices:
    """`part` as slices of an array holding `within`."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(part, within))


def intersect(x: Region, y: Region) -> Region:
    return tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y))


def chunks_touching(box: Region, chunks: Sequence[int], shape: Sequence[int]) -> Iterator[Region]:
    """The chunks of the array grid that overlap `box`, in C order."""
    yield from chunks_in(aligned(box, chunks, shape), chunks)


def aligned(region: Region, chunks: Sequence[int], shape: Sequence[int]) -> Region:
    return tuple((a // c * c, min(-(-b // c) * c, d)) for (a, b), c, d in zip(region, chunks, shape))


def overlap(x: Region, y: Region) -> bool:
    return all(a < d and c < b for (a, b), (c, d) in zip(x, y))


def bounding_box(regions: Sequence[Region]) -> Region:
    """The bounding box of `regions`."""
    return tuple((min(r[i][0] for r in regions), max(r[i][1] for r in regions)) for i in range(len(regions[0])))


@functools.lru_cache(maxsize=256)
def replicas_of(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[Region, tuple[jax.Device, ...]]:
    """Each distinct shard region of an array of `shape` on `sharding`, with every device
    (of every process) holding it, sorted by id, so grouped by host. Cached: many
    leaves share a shape and sharding; callers must not change what it returns."""
    replicas: dict[Region, list[jax.Device]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        replicas.setdefault(region_of(index, shape), []).append(device)
    return {region: tuple(sorted(devices, key=lambda d: d.id)) for region, devices in replicas.items()}
