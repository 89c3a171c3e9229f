"""Reading a step from the local tier's copies: what each copy holds, who reads each
part of each leaf from which process's copy, and how the processes that lack a part
get it.

Each process's copy of a step holds the chunks its devices held when the step was
saved (`_save.plan`, `held`). A step can be rebuilt when every part of every target
leaf can be read by some process holding it:
- a jax.Array that every process finds whole in its own copy (all restarted, same
  mesh): each reads what its devices hold, and nothing crosses the network;
- else, on a NamedSharding: each part (a target shard's overlap with a chunk) is read
  by one process that holds the chunk and has a device holding that shard; the other
  replicas hold zeros there, and a sum over the replicas fills them in (the exact sum
  of load and broadcast, see `broadcast`): what a replaced host lacks comes from a
  replica, over the device network;
- a value read whole on the host (numpy, Python scalars, text, typed keys) by a
  process whose copy lacks it: one process holding it reads it first and sends it to
  every process through the coordination service (host values are small);
- anything else (another sharding, a per-process value): every process must hold all
  it reads.

`plan` is pure but for the process index, and deterministic: every process computes
the same plan from the same inventory, so they agree without another round.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._format import dtypes as _dtypes
from .._regions import Region, chunks_touching, intersect, region_shape, replicas_of
from . import checkpoint as _reader, plan as _plan
from .match import Form, OneReader, OwnValue, Request, Sharded, Share, cut, sharded
from .plan import Placement


@dataclasses.dataclass(frozen=True)
class Copy:
    """One process's committed copy of a step, as its inventory lists it."""

    step: int
    save_id: str
    held: dict[str, frozenset[tuple[int, ...]]]  # per array name, the grid coordinates of its chunks
    after: int | None  # the newest persistent step committed when it was saved

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "save_id": self.save_id, "after": self.after,
                "held": {name: sorted(map(list, coords)) for name, coords in self.held.items()}}

    @classmethod
    def from_json(cls, found: dict[str, Any]) -> Copy:
        return cls(found["step"], found["save_id"],
                   {name: frozenset(map(tuple, coords)) for name, coords in found["held"].items()}, found["after"])


# What each process's copy of a step holds (`Copy.held`); None for a process without
# one (a replaced host, or a copy set aside).
Holdings = Sequence[dict[str, frozenset[tuple[int, ...]]] | None]


class Unrebuildable(Exception):
    """The copies do not hold some part of the target (the message names the leaf)."""


@dataclasses.dataclass(frozen=True)
class Relay:
    """A value read whole on the host that some process's copy lacks: `source` reads it
    and sends it to every process before the other reads."""

    index: int  # of its request
    source: int


@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """How a step is read from the copies: the requests, the values relayed, and the
    bytes this process reads from its own copy and gets from other processes."""

    requests: list[Request]
    relays: list[Relay]
    own_bytes: int
    peer_bytes: int


def plan(requests: list[Request], held: Holdings, me: int) -> CopyPlan:
    """The reads that rebuild the target from the copies `held`, for process `me`.
    Raises Unrebuildable naming the first leaf and part no process can read."""
    planned, relays, own, peers = [], [], 0, 0
    for request in requests:
        stored, form = request.stored, request.form
        holds = [None if h is None else h.get(stored.name, frozenset()) for h in held]
        if isinstance(form, Sharded):
            sharding = request.share.sharding if request.share else form.sharding
            direct = sharded(form.dtype, sharding, stored)[0]  # each process reads all its devices hold
            if all(h is not None and all(_holds_box(h, stored, box) for box, _ in direct.reads(stored, p))
                   for p, h in enumerate(holds)):
                planned.append(dataclasses.replace(request, form=direct, share=None))
                own += sum(_dtypes.nbytes(region_shape(box), form.dtype) for box, _ in direct.reads(stored, me))
                continue
            if not (_plan.summable(form.dtype) and isinstance(sharding, jax.sharding.NamedSharding)):
                raise Unrebuildable(f"leaf {stored.where}: some process's local copy lacks parts it needs")
            readers = _readers(sharding, stored, holds)
            summed = any(len(devices) > 1 for devices in replicas_of(sharding, stored.shape).values())
            planned.append(dataclasses.replace(request, form=CopyParts(form.dtype, sharding, readers),
                                               share=Share(sharding, summed=True) if summed else None))
            mine, theirs = _bytes(sharding, stored, readers, me, form.dtype)
            own, peers = own + mine, peers + theirs
        elif form.whole_on_host:
            whole = [p for p, h in enumerate(holds) if h is not None and _holds_box(h, stored, _full(stored))]
            if not whole:
                raise Unrebuildable(f"leaf {stored.where}: no process's local copy holds all of it")
            relayed = len(whole) < len(holds)  # then every process gets it from whole[0]
            if relayed:
                relays.append(Relay(len(planned), whole[0]))
            if me == whole[0] or (me in whole and not relayed):
                own += _dtypes.nbytes(stored.shape, form.dtype)
            else:
                peers += _dtypes.nbytes(stored.shape, form.dtype)
            planned.append(request)
        else:
            for process, h in enumerate(holds):
                if isinstance(form, OwnValue) and h is None:
                    raise Unrebuildable(f"leaf {stored.where}: process {process}'s own value is in no local copy")
                boxes = [box for box, _ in form.reads(stored, process)]
                if not isinstance(form, OwnValue) and (h is None or not all(_holds_box(h, stored, b) for b in boxes)):
                    raise Unrebuildable(f"leaf {stored.where}: process {process}'s local copy lacks parts it needs")
            planned.append(request)
            own += sum(_dtypes.nbytes(region_shape(box), form.dtype) for box, _ in form.reads(stored, me))
    return CopyPlan(planned, relays, own, peers)


def _full(stored: _reader.StoredLeaf) -> Region:
    return tuple((0, d) for d in stored.shape)


def _coords(chunk: Region, chunks: Sequence[int]) -> tuple[int, ...]:
    return tuple(start // size for (start, _), size in zip(chunk, chunks))


def _holds_box(held: frozenset[tuple[int, ...]], stored: _reader.StoredLeaf, box: Region) -> bool:
    return all(_coords(c, stored.chunks) in held for c in chunks_touching(box, stored.chunks, stored.shape))


def _readers(sharding: jax.sharding.NamedSharding, stored: _reader.StoredLeaf,
             holds: Sequence[frozenset[tuple[int, ...]] | None]) -> tuple[tuple[Region, jax.Device], ...]:
    """The one device reading each part of the leaf: a device holding the part's shard,
    of a process whose copy holds the part's chunk (taken in turn among them, as
    `plan.one_readers` does). Unrebuildable naming a part no such process holds."""
    readers, k = [], zlib.crc32(stored.name.encode())
    for region, devices in sorted(replicas_of(sharding, stored.shape).items()):
        processes = sorted({d.process_index for d in devices})
        for chunk in chunks_touching(region, stored.chunks, stored.shape):
            able = [p for p in processes if (h := holds[p]) is not None and _coords(chunk, stored.chunks) in h]
            if not able:
                part = intersect(chunk, region)
                raise Unrebuildable(f"leaf {stored.where}: part {[list(r) for r in part]} is in the local copy of "
                                    f"no process whose devices hold it (held by processes {processes})")
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
class CopyParts(OneReader):
    """Load and broadcast from the copies: each part read by the device `readers`
    names, from its process's own copy, which holds that part's chunk."""

    def reads(self, stored: _reader.StoredLeaf, process: int) -> list[tuple[Region, Placement]]:
        # One read per part: a box spanning several parts could touch a chunk this
        # process's copy does not hold.
        return [(part, {part: []}) for part, device in self.readers if device.process_index == process]


@dataclasses.dataclass(frozen=True)
class Received(Form):
    """A value read whole on the host that was read before the other reads (by the
    process that relayed it, see `Relay`): nothing is read for it."""

    dtype: np.dtype
    inner: Form
    data: np.ndarray

    def fetch(self, ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, box: Region,
              places: Placement) -> list[Any]:
        return cut(self.data, self.dtype, box, places)

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        return self.inner.build(stored, pieces)
