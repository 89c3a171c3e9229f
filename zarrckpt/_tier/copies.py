"""Reading a step from the local tier's copies: what each copy holds, who reads each
part of each leaf from which process's copy, and how the processes that lack a part
get it.

Each process's copy of a step holds the chunks its devices held when the step was
saved (`_save.plan.EVERY_HOLDER`), and those of its peers' parts it lacked. A step can be
rebuilt when every part of every target leaf can be read by some process holding it:
- a jax.Array that every process finds whole in its own copy (all restarted, same
  mesh): each reads what its devices hold, and nothing crosses the network;
- else, on a NamedSharding: each part (a target shard's overlap with a chunk) is read
  by one process that holds the chunk and has a device holding that shard; the other
  replicas hold zeros there, and a sum over the replicas fills them in (the exact sum
  of load and broadcast, see `broadcast`): what a replaced host lacks comes from a
  replica, over the device network;
- a value read whole on the host (numpy, Python scalars, text, typed keys) by a
  process whose copy lacks it: one process holding it reads it first and sends it to
  every process through the coordination service (host values are small; chunk by chunk
  from their holders where no copy holds it whole);
- a part that no process holding its target shard has, but a peer copy does (see
  `_peers`): the peer reads it into an array of blocks that its route's permute sends to
  the device holding that shard, in the same compiled program as the sum;
- anything else (another sharding, a per-process value): every process must hold all
  it reads.

`plan` is pure but for the process index, and deterministic: every process computes
the same plan from the same inventory, so they agree without another round.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._format import dtypes as _dtypes
from .._restore import checkpoint as _reader
from .._restore.match import Form, OneReader, OwnValue, Request, Sharded, Share, cut, sharded
from .._restore.plan import Placement
from .._util import permute as _permute
from .._util.regions import Region, chunks_touching, intersect, region_of, region_shape, relative, replicas_of


@dataclasses.dataclass(frozen=True)
class Copy:
    """One process's committed copy of a step, as its inventory lists it."""

    step: int
    save_id: str
    held: dict[str, frozenset[tuple[int, ...]]]  # per array name, the grid coordinates of its chunks
    after: int | None  # the newest persistent step committed when it was saved
    peers: tuple[tuple[int, ...], ...] = ()  # who kept whose peer copy (`_peers.Peers.holders`)

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "save_id": self.save_id, "after": self.after,
                "held": {name: sorted(map(list, coords)) for name, coords in self.held.items()},
                "peers": [list(holder) for holder in self.peers]}

    @classmethod
    def from_json(cls, found: dict[str, Any]) -> Copy:
        return cls(found["step"], found["save_id"],
                   {name: frozenset(map(tuple, coords)) for name, coords in found["held"].items()}, found["after"],
                   tuple(map(tuple, found["peers"])))


# What each process's copy of a step holds (`Copy.held`); None for a process without
# one (a replaced host, or a copy set aside).
Holdings = Sequence[dict[str, frozenset[tuple[int, ...]]] | None]


class Unrebuildable(Exception):
    """The copies do not hold some part of the target (the message names the leaf)."""


@dataclasses.dataclass(frozen=True)
class Relay:
    """A value read whole on the host that some process's copy lacks: each of its
    `parts` is read by the process named and sent to every process before the other
    reads (one part, the whole value, where one process's copy holds it all)."""

    index: int  # of its request
    parts: tuple[tuple[Region, int], ...]  # each part, and the process reading it


@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """How a step is read from the copies: the requests, the values relayed, and the
    bytes this process reads from its own copy and gets from other processes."""

    requests: list[Request]
    relays: list[Relay]
    own_bytes: int
    peer_bytes: int


def plan(requests: list[Request], held: Holdings, me: int, holders: Sequence[Sequence[int]] = ()) -> CopyPlan:
    """The reads that rebuild the target from the copies `held`, for process `me`, where
    process `holders[m][p]` kept the m-th peer copy of process p's part (see `_peers`).
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
            if not (_permute.as_bits(form.dtype) and isinstance(sharding, jax.sharding.NamedSharding)):
                raise Unrebuildable(f"leaf {stored.where}: some process's local copy lacks parts it needs")
            # Blocks of uneven shapes cannot be permuted (jax 0.12 makes no such array yet):
            # their parts come from the copies alone, or the restore falls back.
            movable = _permute.movable(sharding, stored.shape)
            # The route of each peer copy (by its index) whose holders' devices pair up.
            routes = {m: route for m, holder in enumerate(holders)
                      if movable and (route := _permute.pairs(_permute.mesh_of(sharding), holder)) is not None}
            readers, moved = _readers(sharding, stored, holds, holders, routes)
            used = sorted({m for *_, m in moved})
            moved = tuple((part, device, reader, used.index(m)) for part, device, reader, m in moved)
            summed = any(len(devices) > 1 for devices in replicas_of(sharding, stored.shape).values())
            back = tuple(_permute.inverse(routes[m]) for m in used)
            planned.append(dataclasses.replace(request, form=CopyParts(form.dtype, sharding, readers, moved),
                                               share=Share(sharding, summed, back) if summed or back else None))
            mine, theirs = _bytes(sharding, stored, readers + tuple((p, r) for p, _, r, _ in moved), me, form.dtype,
                                  {part: device for part, device, _, _ in moved})
            own, peers = own + mine, peers + theirs
        elif form.whole_on_host:
            whole = [p for p, h in enumerate(holds) if h is not None and _holds_box(h, stored, _full(stored))]
            if len(whole) == len(holds):
                own += _dtypes.nbytes(stored.shape, form.dtype)
            else:  # every process gets it from whole[0], or part by part from their holders
                parts = ((_full(stored), whole[0]),) if whole else _parts(stored, holds)
                relays.append(Relay(len(planned), parts))
                for part, source in parts:
                    size = _dtypes.nbytes(region_shape(part), form.dtype)
                    own, peers = (own + size, peers) if source == me else (own, peers + size)
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


def _parts(stored: _reader.StoredLeaf, holds: Sequence[frozenset[tuple[int, ...]] | None]
           ) -> tuple[tuple[Region, int], ...]:
    """Each chunk of a leaf with the first process whose copy holds it; Unrebuildable if
    none does (sharded typed PRNG keys are read whole on the host)."""
    parts = []
    for chunk in chunks_touching(_full(stored), stored.chunks, stored.shape):
        holder = next((p for p, h in enumerate(holds) if h is not None and _coords(chunk, stored.chunks) in h), None)
        if holder is None:
            raise Unrebuildable(f"leaf {stored.where}: chunk {_coords(chunk, stored.chunks)} is in no process's "
                                "local copy")
        parts.append((chunk, holder))
    return tuple(parts)


def _full(stored: _reader.StoredLeaf) -> Region:
    return tuple((0, d) for d in stored.shape)


def _coords(chunk: Region, chunks: Sequence[int]) -> tuple[int, ...]:
    return tuple(start // size for (start, _), size in zip(chunk, chunks))


def _holds_box(held: frozenset[tuple[int, ...]], stored: _reader.StoredLeaf, box: Region) -> bool:
    return all(_coords(c, stored.chunks) in held for c in chunks_touching(box, stored.chunks, stored.shape))


# A part read by a peer: the part, the device of the target holding it, the device of the
# peer reading it and which peer copy it is read from.
MovedPart = tuple[Region, jax.Device, jax.Device, int]


def _readers(sharding: jax.sharding.NamedSharding, stored: _reader.StoredLeaf,
             holds: Sequence[frozenset[tuple[int, ...]] | None], peers: Sequence[Sequence[int]],
             routes: Mapping[int, _permute.Pairs]) -> tuple[tuple[tuple[Region, jax.Device], ...],
                                                             tuple[MovedPart, ...]]:
    """The one device reading each part of the leaf: a device holding the part's shard,
    of a process whose copy holds the part's chunk (taken in turn among them, as
    `plan.one_readers` does); else, where no such process holds it, the device a peer
    copy's route pairs with one of those devices, on the process keeping that peer copy
    (`moved`). Unrebuildable naming a part no process holds."""
    readers, moved, k = [], [], zlib.crc32(stored.name.encode())
    to = {m: _permute.mapping(_permute.mesh_of(sharding), route) for m, route in routes.items()}
    for region, devices in sorted(replicas_of(sharding, stored.shape).items()):
        processes = sorted({d.process_index for d in devices})
        for chunk in chunks_touching(region, stored.chunks, stored.shape):
            coords = _coords(chunk, stored.chunks)
            able = [p for p in processes if (h := holds[p]) is not None and coords in h]
            part = intersect(chunk, region)
            if able:
                process = able[k % len(able)]
                k += 1
                readers.append((part, next(d for d in devices if d.process_index == process)))
                continue
            found = next(((d, sent[d], m) for m, sent in to.items() for d in devices
                          if (h := holds[peers[m][d.process_index]]) is not None and coords in h), None)
            if found is None:
                raise Unrebuildable(f"leaf {stored.where}: part {[list(r) for r in part]} is in the local copy of "
                                    f"no process whose devices hold it (held by processes {processes}), nor in a "
                                    "peer copy")
            moved.append((part, *found))
    return tuple(readers), tuple(moved)


def _bytes(sharding: jax.sharding.NamedSharding, stored: _reader.StoredLeaf,
           readers: Sequence[tuple[Region, jax.Device]], me: int, dtype: np.dtype,
           moved_to: dict[Region, jax.Device]) -> tuple[int, int]:
    """The bytes `me` reads of a leaf, and those its devices get from other processes
    (a part a peer read, `moved_to` the device holding it, counts for that device's)."""
    mine = sum(_dtypes.nbytes(region_shape(part), dtype) for part, device in readers if device.process_index == me)
    wanted = {region for region, devices in replicas_of(sharding, stored.shape).items()
              if any(d.process_index == me for d in devices)}
    theirs = sum(_dtypes.nbytes(region_shape(part), dtype) for part, device in readers
                 if device.process_index != me and (part in moved_to and moved_to[part].process_index == me or
                                                    any(intersect(part, r) == part for r in wanted)))
    return mine, theirs


@dataclasses.dataclass(frozen=True)
class CopyParts(OneReader):
    """Load and broadcast from the copies: each part read by the device `readers`
    names, from its process's own copy, which holds that part's chunk; or, for the parts
    in no such copy (`moved`), by a peer's device, into one array of blocks per peer
    copy that its route's permute sends on (see `broadcast`, `_peers`): the block a
    device stages there is the target's block of the device it is sent to."""

    moved: tuple[MovedPart, ...] = ()

    def reads(self, stored: _reader.StoredLeaf, process: int) -> list[tuple[Region, Placement]]:
        # One read per part: a box spanning several parts could touch a chunk this
        # process's copy does not hold.
        return ([(part, {part: []}) for part, device in self.readers if device.process_index == process]
                + [(part, {part: []}) for part, _, reader, _ in self.moved if reader.process_index == process])

    def build(self, stored: _reader.StoredLeaf, pieces: list[Any]) -> Any:
        if not self.moved:
            return super().build(stored, pieces)
        by_part = {part: (device, reader, m) for part, device, reader, m in self.moved}
        staged = super().build(stored, [(part, piece) for part, piece in pieces if part not in by_part])
        regions = {d: region_of(index, stored.shape) for d, index in
                   self.sharding.devices_indices_map(stored.shape).items()}
        blocks = []
        for m in range(1 + max(m for *_, m in self.moved)):
            arrays = []
            for device in self.sharding.addressable_devices_indices_map(stored.shape):
                mine = [(part, piece, by_part[part][0]) for part, piece in pieces
                        if part in by_part and by_part[part][1:] == (device, m)]
                shape = region_shape(regions[device])  # every block's: the sharding is even
                if not mine:
                    arrays.append(jnp.zeros(shape, self.dtype, device=device))
                    continue
                data = np.zeros(shape, self.dtype)
                for part, piece, owner in mine:
                    data[relative(part, regions[owner])] = piece
                arrays.append(jax.device_put(data, device))
            blocks.append(jax.make_array_from_single_device_arrays(stored.shape, self.sharding, arrays))
        return (staged, *blocks)


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
