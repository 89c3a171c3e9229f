"""Read planning: which boxes of a leaf a process reads, and, when several processes
need the same part of a leaf (data-parallel replicas), who reads it once for all (load
and broadcast).

Pure functions of a sharding, a shape, a chunk grid and a process index, with the
process holding each device given by `host_of` (by default the device's own
`process_index`): a layout of many hosts can be planned, and tested, in one process.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence

import jax

from .._util.regions import (
    HostOf,
    Region,
    aligned,
    bounding_box,
    chunks_touching,
    intersect,
    overlap,
    process_of,
    replicas_of,
)

# Where each region read goes: the devices that need it, or none (the host).
Placement = dict[Region, list[jax.Device]]


def plan_reads(regions: Sequence[Region], chunks: Sequence[int], shape: Sequence[int]
               ) -> list[tuple[Region, list[Region]]]:
    """Groups the regions one process needs so that each chunk is read only once.

    Regions that share a chunk (directly or through a chain) are read together as
    their bounding box; each group is (box to read, regions cut from it).
    """
    groups = [[r] for r in dict.fromkeys(regions)]
    spans = [aligned(g[0], chunks, shape) for g in groups]  # each group's chunks' box
    while pair := next(((i, j) for i in range(len(groups)) for j in range(i + 1, len(groups))
                        if overlap(spans[i], spans[j])), None):
        i, j = pair
        groups[i] += groups.pop(j)
        del spans[j]
        spans[i] = aligned(bounding_box(groups[i]), chunks, shape)
    return [(bounding_box(g), g) for g in groups]


@functools.lru_cache(maxsize=256)
def sharded_reads(sharding: jax.sharding.Sharding, shape: tuple[int, ...], chunks: tuple[int, ...], process: int,
                  host_of: HostOf = process_of) -> list[tuple[Region, Placement]]:
    """What `process` reads of a leaf on `sharding`: every region its devices hold, each
    chunk once, with the devices each region goes to. Cached: a model's leaves come in
    a few shapes and shardings (a layer's, again and again), and every leaf is planned
    before the first read; callers must not change what it returns."""
    devices: Placement = {}
    for region, holders in replicas_of(sharding, shape).items():
        if mine := [d for d in holders if host_of(d) == process]:
            devices[region] = mine
    return [(box, {region: devices[region] for region in regions})
            for box, regions in plan_reads(list(devices), chunks, shape)]


def one_readers(sharding: jax.sharding.Sharding, shape: tuple[int, ...], chunks: Sequence[int], name: str,
                host_of: HostOf = process_of) -> tuple[tuple[Region, jax.Device], ...]:
    """The one device reading each part of a leaf (a shard's overlap with a chunk): the
    first device (by id) of one of the processes holding the shard, taken in turn."""
    # Start the turn at a place of the leaf's own, so that many one-chunk leaves
    # spread over the processes too.
    readers, k = [], zlib.crc32(name.encode())
    for region, devices in sorted(replicas_of(sharding, shape).items()):
        processes = sorted({host_of(d) for d in devices})
        for chunk in chunks_touching(region, chunks, shape):
            process = processes[k % len(processes)]
            k += 1
            readers.append((intersect(chunk, region), next(d for d in devices if host_of(d) == process)))
    return tuple(readers)


def one_reader_reads(readers: Sequence[tuple[Region, jax.Device]], shape: tuple[int, ...], chunks: Sequence[int],
                     process: int, host_of: HostOf = process_of) -> list[tuple[Region, Placement]]:
    """What `process` reads of a leaf whose parts `readers` deals out: its parts, to the host."""
    mine = [part for part, device in readers if host_of(device) == process]
    return [(box, {part: [] for part in parts}) for box, parts in plan_reads(mine, chunks, shape)]


def held_by_several_processes(sharding: jax.sharding.Sharding, shape: tuple[int, ...],
                              host_of: HostOf = process_of) -> bool:
    """Whether some part of a leaf on `sharding` is on devices of several processes."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return False
    return any(len({host_of(d) for d in devices}) > 1 for devices in replicas_of(sharding, shape).values())


def replica_axes(sharding: jax.sharding.NamedSharding) -> list[str]:
    """The mesh axes the spec leaves out: the target is replicated along them."""
    used = {a for e in sharding.spec if e is not None for a in (e if isinstance(e, tuple) else (e,))}
    return [a for a in sharding.mesh.axis_names if a not in used and sharding.mesh.shape[a] > 1]


def staging_sharding(target: jax.sharding.NamedSharding, shape: tuple[int, ...],
                     chunks: tuple[int, ...]) -> jax.sharding.NamedSharding | None:
    """The target's sharding with every replica axis also cutting one dimension, where
    the cut falls on chunk boundaries (so no chunk is read twice); None when some
    replica axis finds no such dimension."""
    spec = list(target.spec) + [None] * (len(shape) - len(target.spec))
    entries = [[] if e is None else list(e) if isinstance(e, tuple) else [e] for e in spec]
    mesh = target.mesh
    for axis in replica_axes(target):
        for dim, entry in enumerate(entries):
            pieces = math.prod(mesh.shape[a] for a in entry) * mesh.shape[axis]
            if shape[dim] % pieces == 0 and (shape[dim] // pieces) % chunks[dim] == 0:
                entry.append(axis)
                break
        else:
            return None
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        *(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries)))
