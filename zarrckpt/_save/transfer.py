"""Copies off the devices for a save: where each write unit's bytes are read on the host.

Each device gets one of three paths:
- pinned: the device has a `pinned_host` memory (GPUs, TPUs, and the CPU backend). The
  parts of every unit that the byte budget admits are copied there in one batched
  `jax.device_put`, all local devices at once: DMA at the link's speed, where a copy
  into pageable memory (`np.asarray` of a device array) ran 30x slower on an H100. The
  call only dispatches the copies, and the runtime orders any later use of a source
  buffer (a train step that donates it) after them, so the pinned arrays are a true
  snapshot as soon as it returns: an async save need not wait for them. The writer reads
  a pinned buffer in place (`np.asarray` of a host-memory array is a view), and the
  buffer is freed as soon as its chunk is written.
- in place: a save that is not a snapshot, on the CPU backend, reads each device buffer
  where it lies: it is host memory already.
- pageable: a device without a pinned host memory: `copy_to_host_async` and `np.asarray`
  (a snapshot waits for them). Logged once per platform.

Numpy leaves are the caller's memory, which it may change in place: a snapshot copies
them before it returns. The pinned and in-place paths leave nothing cached in the
caller's arrays (the pageable one leaves what `np.asarray` caches in a jax.Array).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._regions import Slices, region_slices
from .plan import WriteUnit

log = logging.getLogger("zarrckpt")

PINNED = "pinned_host"


def start(units: Sequence[WriteUnit], *, snapshot: bool) -> None:
    """Starts copying `units` to the host, setting each one's `copies`; the pinned copies
    of all of them go out in one call. With `snapshot`, returns once the copies no
    longer depend on anything the caller may change (the device buffers may be donated
    or deleted, numpy leaves mutated)."""
    pinned: list[tuple[list[Any], int, jax.Array, jax.Device]] = []
    pageable: list[tuple[list[Any], int, jax.Array]] = []
    for unit in units:
        if unit.host is not None:
            part = unit.host[region_slices(unit.region)]
            unit.copies = [(None, np.array(part) if snapshot else part)]
            continue
        copies: list[Any] = []
        unit.copies = copies
        for data, take, put in unit.sources:
            device = next(iter(data.devices()))
            path = _path(device, snapshot)
            if path == "in place":
                host = np.asarray(data)  # no copy: a CPU device's buffer is host memory
                copies.append((put, host if take is None else host[take]))
                continue
            # Only this chunk's part crosses the link, not the whole shard.
            piece = data if take is None else _slicer(_bounds(take))(data)
            if path == "pinned":
                pinned.append((copies, len(copies), piece, device))
            else:
                pageable.append((copies, len(copies), piece))
            copies.append((put, piece))
    if pinned:
        sent = jax.device_put([piece for _, _, piece, _ in pinned],
                              [_pinned_sharding(device) for _, _, _, device in pinned])
        for (copies, i, _, _), copy in zip(pinned, sent):
            copies[i] = (copies[i][0], copy)
    for _, _, piece in pageable:
        piece.copy_to_host_async()
    if snapshot:
        for copies, i, piece in pageable:
            copies[i] = (copies[i][0], np.array(piece))


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


@functools.cache
def _log_pageable(platform: str) -> None:
    log.info("%s devices have no pinned host memory: saves copy through pageable memory, which is slower",
             platform)
