"""Copies off the devices for a save: where each write unit's bytes are read on the host.

Each device gets one of three paths:
- pinned: the device has a `pinned_host` memory (GPUs, TPUs, and the CPU backend). The
  parts of every unit that the byte budget admits are copied there in one batched
  `jax.device_put`, all local devices at once: DMA at the link's speed, where a copy
  into pageable memory (`np.asarray` of a device array) ran 30x slower on an H100. The
  call only dispatches the copies, and the runtime orders any later use of a source
  buffer (a train step that donates it) after them, so the pinned arrays are a true
  snapshot as soon as it returns: an async save need not wait for them. What is copied
  is a whole array, a whole shard or a unit's part of a shard (see `start`). The writer
  reads a pinned buffer in place (`np.asarray` of a host-memory array is a view), and
  the buffer is freed as soon as the chunks read from it are written.
- in place: a save that is not a snapshot, on the CPU backend, reads each device buffer
  where it lies: it is host memory already.
- pageable: a device without a pinned host memory: `copy_to_host_async` and `np.asarray`
  (a snapshot waits for them). Logged once per platform.

Numpy leaves are the caller's memory, which it may change in place: a snapshot copies
them before it returns. A deferred leaf (an import's, see `_tree.Deferred`) is read by
the writer of each chunk, chunk by chunk. The pinned and in-place paths leave nothing cached in the
caller's arrays (the pageable one leaves what `np.asarray` caches in a jax.Array).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from .._util import devices as _devices
from .._util.concurrency import Hold
from .._util.regions import Slices, region_slices
from .host_copies import HostCopy, SharedHold, shard_source
from .plan import ArrayPlan, PartCopy, WriteUnit

log = logging.getLogger("zarrckpt")

PINNED = "pinned_host"


def start(work: Sequence[tuple[ArrayPlan, WriteUnit]], *, snapshot: bool) -> None:
    """Starts copying the units of `work` (in plan order) to the host, setting each one's
    `copies`; the pinned copies of all of them go out in one call. With `snapshot`,
    returns once the copies no longer depend on anything the caller may change (the
    device buffers may be donated or deleted, numpy leaves mutated).

    An array whose units are all here is copied by whole shards, once each (see
    `plan.Writes`), or, when those are all its shards, as one array: each `device_put`
    item costs tens of microseconds of Python, so 600 leaves of 8 shards cost what 600
    items do, not 4,800. Its units then share their copies, and their holds of the
    budget go back together, when the last one is written (its memory is only freed
    then). An array split over several batches (larger than the budget) is copied unit
    by unit, each part on its own, sliced on its device."""
    pinned: list[tuple[HostCopy, jax.Array, jax.sharding.Sharding]] = []
    pageable: list[HostCopy] = []

    def copy_of(data: jax.Array, device: jax.Device, path: str) -> HostCopy:
        copy = HostCopy(data)
        if path == "pinned":
            pinned.append((copy, data, _pinned_sharding(device)))
        else:
            pageable.append(copy)
        return copy

    for plan, units in _by_plan(work):
        if units[0].host is not None:
            for unit in units:
                assert unit.host is not None
                if not isinstance(unit.host, np.ndarray):  # an import's: read by its writer, within the budget
                    unit.copies = [PartCopy(None, unit.host, None, region_slices(unit.region))]
                    continue
                part = unit.host[region_slices(unit.region)]
                unit.copies = [PartCopy(None, np.array(part) if snapshot else part, None, None)]
            continue
        array = plan.array
        path = _path(units[0].sources[0][0], snapshot)
        if path == "in place":  # the caller's own buffers, read where they lie
            whole = HostCopy(array)
            for unit in units:
                unit.copies = [PartCopy(put, whole, device, take) for device, take, put in unit.sources]
            continue
        together = len(units) == len(plan.writes)
        if together and len(units) > 1:
            shared = SharedHold([unit.hold for unit in units if isinstance(unit.hold, Hold)])
            for unit in units:
                unit.hold = shared
        if together and plan.copy_all and path == "pinned" and array.is_fully_addressable:
            whole = HostCopy()
            pinned.append((whole, array, _pinned_array_sharding(array.sharding)))
            for unit in units:
                unit.copies = [PartCopy(put, whole, device, take) for device, take, put in unit.sources]
            continue
        shard = shard_source(array)  # a synchronous save stages beside its writers
        by_shard: dict[jax.Device, HostCopy] = {}
        for unit in units:
            copies = []
            for device, take, put in unit.sources:
                source = plan.copy_from.get(device) if together else None
                if source is not None:
                    if (copy := by_shard.get(source)) is None:
                        on, data = shard(source)
                        copy = by_shard[source] = copy_of(data, on, path)
                    copies.append(PartCopy(put, copy, None, take))
                else:  # only this chunk's part crosses the link, not the whole shard
                    on, data = shard(device)
                    if take is None:
                        piece = data
                    else:
                        with _devices.outside_callers_mesh():
                            piece = _slicer(_bounds(take))(data)
                    copies.append(PartCopy(put, copy_of(piece, on, path), None, None))
            unit.copies = copies
    if pinned:
        # may_alias=False: a state already in pinned host memory is copied all the same.
        sent = jax.device_put([data for _, data, _ in pinned], [target for _, _, target in pinned],
                              may_alias=False)
        for (copy, _, _), array in zip(pinned, sent):
            copy.array = array
    for copy in pageable:
        copy.array.copy_to_host_async()
    if snapshot:
        for copy in pageable:
            copy.array = np.array(copy.array)


def _by_plan(work: Sequence[tuple[ArrayPlan, WriteUnit]]) -> Iterator[tuple[ArrayPlan, list[WriteUnit]]]:
    """The units of `work`, run by run of the same plan."""
    for _, run in itertools.groupby(work, key=lambda item: id(item[0])):
        items = list(run)
        yield items[0][0], [unit for _, unit in items]


def _path(device: jax.Device, snapshot: bool) -> str:
    if device.platform == "cpu" and not snapshot:
        return "in place"
    if has_pinned_memory(device):
        return "pinned"
    _log_pageable(device.platform)
    return "pageable"


def _bounds(take: Slices) -> tuple[tuple[int, int], ...]:
    return tuple((part.start, part.stop) for part in take)


@functools.lru_cache(maxsize=1024)
def _slicer(bounds: tuple[tuple[int, int], ...]) -> Any:
    """A compiled slice: called, it takes jax's fast dispatch path (a tenth of what
    indexing an array costs; a save may slice hundreds of shards)."""
    take = tuple(slice(start, stop) for start, stop in bounds)
    return jax.jit(lambda x: x[take])


@functools.cache
def has_pinned_memory(device: jax.Device) -> bool:
    """Whether `device` has a pinned host memory to copy into."""
    try:
        return any(memory.kind == PINNED for memory in device.addressable_memories())
    except Exception:  # a backend that does not implement memories
        return False


@functools.cache
def _pinned_sharding(device: jax.Device) -> jax.sharding.SingleDeviceSharding:
    return jax.sharding.SingleDeviceSharding(device, memory_kind=PINNED)


@functools.lru_cache(maxsize=256)
def _pinned_array_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    return sharding.with_memory_kind(PINNED)


@functools.cache
def _log_pageable(platform: str) -> None:
    log.info("%s devices have no pinned host memory: saves copy through pageable memory, which is slower",
             platform)
