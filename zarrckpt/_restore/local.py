"""Reading a step from the local tier: who reads each part of each leaf, from which
process's own copy, and how the processes that lack it get it.

Each process holds, in its local copy, the chunks its devices held when the step was
saved (`_save.plan`, `held`). A step can be rebuilt when every part of every target
leaf can be read by some process holding it:
- a jax.Array that every process finds whole in its own copy (all restarted, same
  mesh): each reads what its devices hold, and nothing crosses the network;
- else, on a NamedSharding: each part (a target shard's overlap with a chunk) is read
  by one process that holds the chunk and has a device holding that shard; the other
  replicas hold zeros there, and a sum over the replicas fills them in (the exact sum
  of load and broadcast, see `broadcast`): what a replaced host lacks comes from a
  replica, over the device network;
- a value read whole on the host (numpy, Python scalars, text, typed keys): read by
  every process holding all of it; one of them sends it to the others through the
  coordination service (host values are small);
- anything else (another sharding, a per-process value): every process must hold all
  it reads.

Pure but for the process index, and deterministic: every process computes the same
plan from the same inventory (`held`), so they agree without another round.
"""

from __future__ import annotations

import base64
import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .. import _multihost
from .._format import dtypes as _dtypes
from .._regions import Region, chunks_touching, intersect, region_shape, replicas_of
from . import checkpoint as _reader, plan as _plan
from .match import Form, OneReader, OwnValue, Request, Sharded, Share, cut, sharded
from .plan import Placement

# What each process's copy of the step holds: per array name, the grid coordinates of
# its chunks; None for a process that holds no copy of the step (a replaced host).
Holdings = Sequence[dict[str, set[tuple[int, ...]]] | None]


@dataclasses.dataclass(frozen=True)
class LocalPlan:
    """How a step is read from the local tier: the requests, and the bytes this
    process reads from its own copy and gets from other processes."""

    requests: list[Request]
    local_bytes: int
    peer_bytes: int


def plan(requests: list[Request], held: Holdings, relay: _multihost.Agreement) -> LocalPlan | str:
    """The requests that rebuild the target from the local copies `held`, or why they
    cannot (naming the leaf and the part). `relay` carries host values between
    processes during the read."""
    me = _multihost.process_index()
    planned, local, peers = [], 0, 0
    for request in requests:
        stored, form = request.stored, request.form
        holds = [None if h is None else h.get(stored.name, set()) for h in held]
        if isinstance(form, Sharded):
            sharding = request.share.sharding if request.share else form.sharding
            own = sharded(form.dtype, sharding, stored)[0]  # each process reads all its devices hold
            if all(h is not None and all(_holds_box(h, stored, box) for box, _ in own.reads(stored, p))
                   for p, h in enumerate(holds)):
                planned.append(dataclasses.replace(request, form=own, share=None))
                local += sum(_dtypes.nbytes(region_shape(box), form.dtype) for box, _ in own.reads(stored, me))
                continue
            if not (_plan.summable(form.dtype) and isinstance(sharding, jax.sharding.NamedSharding)):
                return f"leaf {stored.where}: some process's local copy lacks parts it needs"
            readers = _readers(sharding, stored, holds)
            if isinstance(readers, str):
                return f"leaf {stored.where}: {readers}"
            summed = any(len(devices) > 1 for devices in replicas_of(sharding, stored.shape).values())
            planned.append(dataclasses.replace(request, form=LocalParts(form.dtype, sharding, readers),
                                               share=Share(sharding, summed=True) if summed else None))
            mine, theirs = _bytes(sharding, stored, readers, me, form.dtype)
            local, peers = local + mine, peers + theirs
        elif type(form).reads is Form.reads and not isinstance(form, OwnValue):  # read whole on the host
            whole = [p for p, h in enumerate(holds) if h is not None and _holds_box(h, stored, _full(stored))]
            if not whole:
                return f"leaf {stored.where}: no process's local copy holds all of it"
            nbytes = _dtypes.nbytes(stored.shape, form.dtype)
            if len(whole) < len(holds) and me not in whole:
                planned.append(dataclasses.replace(request, form=Relay(form.dtype, form, relay, whole[0])))
                peers += nbytes
            else:
                sends = len(whole) < len(holds) and me == whole[0]
                planned.append(dataclasses.replace(request, form=Relay(form.dtype, form, relay, me))
                               if sends else request)
                local += nbytes
        else:
            for process, h in enumerate(holds):
                if isinstance(form, OwnValue) and h is None:
                    return f"leaf {stored.where}: process {process}'s own value is in no local copy"
                boxes = [box for box, _ in form.reads(stored, process)]
                if not isinstance(form, OwnValue) and (h is None or not all(_holds_box(h, stored, b) for b in boxes)):
                    return f"leaf {stored.where}: process {process}'s local copy lacks parts it needs"
            planned.append(request)
            local += sum(_dtypes.nbytes(region_shape(box), form.dtype) for box, _ in form.reads(stored, me))
    return LocalPlan(planned, local, peers)


def _full(stored: _reader.StoredLeaf) -> Region:
    return tuple((0, d) for d in stored.shape)


def _coords(chunk: Region, chunks: Sequence[int]) -> tuple[int, ...]:
    return tuple(start // size for (start, _), size in zip(chunk, chunks))


def _holds_box(held: set[tuple[int, ...]], stored: _reader.StoredLeaf, box: Region) -> bool:
    return all(_coords(c, stored.chunks) in held for c in chunks_touching(box, stored.chunks, stored.shape))


def _readers(sharding: jax.sharding.NamedSharding, stored: _reader.StoredLeaf,
             holds: Sequence[set[tuple[int, ...]] | None]) -> tuple[tuple[Region, jax.Device], ...] | str:
    """The one device reading each part of the leaf: a device holding the part's shard,
    of a process whose copy holds the part's chunk (taken in turn among them, as
    `plan.one_readers` does); or which part no such process holds."""
    readers, k = [], zlib.crc32(stored.name.encode())
    for region, devices in sorted(replicas_of(sharding, stored.shape).items()):
        processes = sorted({d.process_index for d in devices})
        for chunk in chunks_touching(region, stored.chunks, stored.shape):
            able = [p for p in processes if (h := holds[p]) is not None and _coords(chunk, stored.chunks) in h]
            if not able:
                part = intersect(chunk, region)
                return (f"part {[list(r) for r in part]} is in the local copy of no process whose devices hold it "
                        f"(held by processes {processes})")
            process = able[k % len(able)]
            k += 1
            readers.append((intersect(chunk, region), next(d for d in devices if d.process_index == process)))
    return tuple(readers)


def _bytes(sharding: jax.sharding.NamedSharding, stored: _reader.StoredLeaf,
           readers: Sequence[tuple[Region, jax.Device]], me: int, dtype: np.dtype) -> tuple[int, int]:
    """The bytes `me` reads of a leaf, and those its devices get from other processes."""
    mine = sum(_dtypes.nbytes(region_shape(part), dtype) for part, device in readers if device.process_index == me)
    wanted = {region for region, devices in replicas_of(sharding, stored.shape).items()
              if any(d.process_index == me for d in devices)}
    theirs = sum(_dtypes.nbytes(region_shape(part), dtype) for part, device in readers
                 if device.process_index != me and any(intersect(part, r) == part for r in wanted))
    return mine, theirs


@dataclasses.dataclass(frozen=True)
class LocalParts(OneReader):
    """Load and broadcast from the local tier: each part read by the device `readers`
    names, from its process's own copy, which holds that part's chunk."""

    def reads(self, stored: _reader.StoredLeaf, process: int) -> list[tuple[Region, Placement]]:
        # One read per part: a box spanning several parts could touch a chunk this
        # process's copy does not hold.
        return [(part, {part: []}) for part, device in self.readers if device.process_index == process]


@dataclasses.dataclass(frozen=True)
class Relay(Form):
    """A value read whole on the host by process `source`, which sends it (base64, through
    the coordination service) to the processes whose copies lack it."""

    dtype: np.dtype
    inner: Form
    relay: _multihost.Agreement
    source: int

    def fetch(self, ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, box: Region,
              places: Placement) -> list[Any]:
        if _multihost.process_index() == self.source:
            data = ckpt.read(stored, box)
            self.relay.send(stored.name, base64.b64encode(data.tobytes()).decode())
        else:
            raw = base64.b64decode(self.relay.receive(stored.name, self.source))
            data = np.frombuffer(raw, stored.dtype).reshape(region_shape(box)).copy()  # writable, as read ones are
        return cut(data, self.dtype, box, places)

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        return self.inner.build(stored, pieces)
