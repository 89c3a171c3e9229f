"""A slow process does not hold a restore: with load and broadcast, a process that has
read its part of a group of shared leaves reads its buddy's part too when the buddy is
late, and sends it over the device network; the buddy stops waiting for its own reads.

A second read, not a hand-over of unread work: a process starts its reads of a group
at once (its byte budget holds a group), so a slow one has nothing unstarted to give;
what it waits for is in flight.

Per group of leaves shared together (`broadcast.groups`, the same on every process),
on a board in the coordination service (`_multihost.Agreement`):
  fate/G/P     set once, by whoever is first: "own" by P when it has read its part;
               "by H" by P's buddy H, when P is still not done half as long again
               after H's last read of the group came in as H took from its first
               read's start (`_PATIENCE`, at least `_PATIENCE_FLOOR_S`; a process that
               read no part of the group has no measure and never helps), before H
               reads P's part; "failed" by P when its reads failed (H neither waits
               nor reads)
  covered/G/P  after "by H": H's reads of P's part are in ("by H"), or failed
               ("failed": P reads on). P's watcher thread waits on these two keys.
  settled/G    a barrier, after which no fate changes; a helper whose reads came in
               leaves the note "helped P" there. With any note, every process builds
               the group's program with one permute between every two buddies'
               devices, both ways (zeros where nobody helped: one program whoever
               helped whom, compiled once). A process whose reads failed leaves its failure instead,
               at the barrier of the group it had not settled, and every process
               raises it rather than wait for it.
Each process makes about five calls per group with nothing to relieve (its fate, a wait
on its buddy's, the watcher's wait on its own, the barrier and its notes), whatever the
process count: buddies are processes 2k and 2k+1.
The blocks a helper read travel by that permute from its devices to its buddy's (same
rank by id) and are ORed in before the sum or reshard (`broadcast`): a part read by both
processes is the same bits either way, so a race between them changes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

from .._format import dtypes as _dtypes
from .._options import LoadOptions
from .._util import concurrency as _concurrency, multihost as _multihost, permute as _permute, stats as _stats
from .._util.regions import Region, region_of, region_shape, relative
from ..errors import CheckpointError
from . import checkpoint as _reader
from .match import Form, OneReader, Request, Sharded, ShardedByReaders, cut

log = logging.getLogger("zarrckpt")

# The buddy is late once it is still reading after half as long again as this process took.
_PATIENCE = 0.5
_PATIENCE_FLOOR_S = 0.05
# The board's waits are a restore's own reads, which may be long: a dead process shows
# here only after this (a restore without the board would wait in a collective forever).
_TIMEOUT_S = 24 * 3600.0
_WATCH_S = 60.0  # each blocking read of the watcher; closing wakes it sooner


def start(ckpt: _reader.Checkpoint, groups: list[list[Request]], options: LoadOptions,
          reading: set[str]) -> Relief | None:
    """The relief of this restore's sharing `groups` (`reading`: the leaves this process
    reads a part of), or None where there is none to give (one process, no coordination
    service)."""
    count = _multihost.process_count()
    if count < 2 or not groups or not _multihost.coordinated():
        return None
    return Relief(ckpt, groups, options, reading)


class Relief:
    """One restore's relief (see the module's docstring); `close` it when the restore
    ends, however it ends."""

    def __init__(self, ckpt: _reader.Checkpoint, groups: list[list[Request]], options: LoadOptions,
                 reading: set[str]) -> None:
        self._ckpt, self._options = ckpt, options
        self._me = _multihost.process_index()
        buddy = self._me ^ 1
        self._buddy = buddy if buddy < _multihost.process_count() else None
        self._group = {r.stored.name: g for g, group in enumerate(groups) for r in group}
        # The leaves of each group the buddy may read for this process, and this one for it.
        self._mine = [{r.stored.name for r in group if _route(r, self._buddy, self._me)} for group in groups]
        # Only a process that read a part of a group itself knows how long the buddy's
        # should take: one that read none (its leaves all dealt to others) never helps.
        self._theirs = [[r for r in group if _route(r, self._me, self._buddy)]
                        if any(r.stored.name in reading for r in group) else [] for group in groups]
        self._covered = [threading.Event() for _ in groups]
        self._settled = 0  # groups whose barrier this process has met
        self._told = False
        # When this process's first read of each group started, and its last came in.
        self._began: dict[int, float] = {}
        self._ended: dict[int, float] = {}
        self._board = _multihost.Agreement("relief", _TIMEOUT_S, what="restore")
        self._closing = threading.Event()
        self._watching = ""  # the key the watcher waits on
        self._watcher = threading.Thread(target=self._watch, name="zarrckpt-relief", daemon=True)
        if any(self._mine):
            self._watcher.start()

    def began(self, request: Request) -> None:
        """A read of `request` by this process starts (or is given up before it starts)."""
        g = self._group.get(request.stored.name)
        if g is not None:
            self._began.setdefault(g, time.monotonic())

    def ended(self, request: Request) -> None:
        """This process's last read of `request` is in (or given up)."""
        g = self._group.get(request.stored.name)
        if g is not None:
            self._ended[g] = time.monotonic()

    @property
    def abandon(self) -> Callable[[Request], bool]:
        """`covered`: a read of this process's that the buddy made for it is given up."""
        return self.covered

    def covered(self, request: Request) -> bool:
        """Whether the buddy has read this process's part of `request` for it."""
        g = self._group.get(request.stored.name)
        return g is not None and self._covered[g].is_set() and request.stored.name in self._mine[g]

    def fetch(self, request: Request, box: Region, places: Any) -> list[Any]:
        """This process's read of `box` of `request`, or `ABANDONED` where the buddy read
        it (before it started, or by the time it failed)."""
        if self.covered(request):
            return _concurrency.ABANDONED
        try:
            return request.form.fetch(self._ckpt, request.stored, box, places)
        except Exception:
            if self.covered(request):
                return _concurrency.ABANDONED
            raise

    @staticmethod
    def zeros(request: Request, places: Any) -> list[Any]:
        """What `fetch` would have returned for a read given up, in zeros: the buddy's
        blocks are ORed into them (see the module's docstring)."""
        form = request.form
        if isinstance(form, ShardedByReaders):
            return [jnp.zeros(region_shape(region), form.dtype, device=device)
                    for region, devices in places.items() for device in devices]
        return [(region, np.zeros(region_shape(region), form.dtype)) for region in places]

    def settle(self, group: list[Request], done: dict[str, Any]) -> list[Request]:
        """Before `group` is shared: takes the buddy's part over if it is late, agrees
        with every process on who read what for whom, and returns `group` with the
        routes that bring those reads (their blocks added to `done`). Collective."""
        g = self._settled
        me, buddy, board = self._me, self._buddy, self._board
        read: dict[str, list[tuple[Region, np.ndarray, list[jax.Device]]]] | None = None
        if self._mine[g]:
            # Left as it is if the buddy took this part over: its blocks come with the routes.
            board.offer(f"fate/{g}/{me}", "own")
        if buddy is not None and self._theirs[g]:
            # A buddy that helped this process set its own fate first: it is not late.
            now = time.monotonic()
            began, ended = self._began.get(g, now), self._ended.get(g, now)
            patience = max(_PATIENCE_FLOOR_S, ended + _PATIENCE * (ended - began) - now)
            if board.look(f"fate/{g}/{buddy}", patience) is None and board.claim(f"fate/{g}/{buddy}", f"by {me}"):
                read = self._read_for(buddy, g, patience)
                board.post(f"covered/{g}/{buddy}", f"by {me}" if read is not None else "failed")
        self._settled += 1
        try:
            notes = board.meet(f"settled/{g}", f"helped {buddy}" if read is not None else None)
        except CheckpointError:
            self._told = True  # another process's failure (or a timeout): nobody waits for this one's
            raise
        if not notes:
            return group
        # Every buddy pair's permute, whoever helped whom: one program per group of leaves
        # for any relief (each other set of pairs would compile one of its own).
        out = []
        for request in group:
            route = _swaps(request)
            if route is None:
                out.append(request)
                continue
            done[request.stored.name] = (done[request.stored.name], _blocks(request, route, (read or {}).get(
                request.stored.name, [])))
            assert request.share is not None  # a route is only for a shared leaf (`_route`)
            out.append(dataclasses.replace(request, share=dataclasses.replace(request.share, routes=(route,))))
        return out

    def _read_for(self, buddy: int, g: int, waited: float
                  ) -> dict[str, list[tuple[Region, np.ndarray, list[jax.Device]]]] | None:
        """The buddy's part of group `g`, as (region, values, the buddy's devices it goes
        to) by leaf; None if a read failed (the buddy then reads on: this was a spare)."""
        reads = [(r, box, places) for r in self._theirs[g] for box, places in r.form.reads(r.stored, buddy)]
        started = time.monotonic()

        def one(read: tuple[Request, Region, Any]) -> list[tuple[Region, np.ndarray, list[jax.Device]]]:
            request, box, places = read
            readers = dict(request.form.readers) if isinstance(request.form, OneReader) else {}
            return [(region, values, places[region] or [readers[region]])
                    for region, values in cut(self._ckpt.read(request.stored, box), request.form.dtype, box, places)]

        try:
            with _concurrency.Operation(self._options.max_workers or self._ckpt.loc.concurrency, "relief") as op:
                results = op.fan_out(reads, one, budget=_concurrency.ByteBudget(self._options.max_inflight_bytes),
                                     nbytes=lambda read: _dtypes.nbytes(region_shape(read[1]), read[0].form.dtype))
        except Exception as e:  # the buddy's own reads go on; its failure, if any, is its to raise
            log.debug("restore of %s: reading process %d's part for it failed: %r", self._ckpt.url, buddy, e)
            return None
        out: dict[str, list[tuple[Region, np.ndarray, list[jax.Device]]]] = {}
        for (request, _, _), pieces in zip(reads, results):
            out.setdefault(request.stored.name, []).extend(pieces)
        nbytes = sum(values.nbytes for pieces in results for _, values, _ in pieces)
        _stats.add("relief_bytes_read", nbytes)
        log.info("restore of %s: process %d was still reading its part of %d leaves %.2fs after process %d had "
                 "read its own; process %d read it (%.1f MiB in %.2fs) and sent it over the device network",
                 self._ckpt.url, buddy, len(out), waited, self._me, self._me, nbytes / 2**20,
                 time.monotonic() - started)
        return out

    def _watch(self) -> None:
        """On its own thread: marks each group whose part of this process the buddy has
        read, as soon as the buddy posts it (`covered`)."""
        try:
            for g, names in enumerate(self._mine):
                if names and (self._until(f"fate/{g}/{self._me}") or "").startswith("by ") and \
                        (self._until(f"covered/{g}/{self._me}") or "").startswith("by "):
                    self._covered[g].set()
        except Exception as e:  # the coordination service is gone: nothing is given up, reads go on
            log.debug("restore of %s: watching for relief stopped: %r", self._ckpt.url, e)

    def _until(self, key: str) -> str | None:
        """What `key` is set to, waiting for it; None once closing."""
        self._watching = key
        while not self._closing.is_set():
            if (value := self._board.look(key, _WATCH_S)) is not None:
                return value
        return None

    def close(self, error: BaseException | None = None) -> None:
        """Ends the watcher (waking it if it waits) and counts this process out of the board.
        With the `error` this process's reads failed with (not one learnt from another
        process at a barrier), it first meets the others at the next group's barrier and
        reports it there, so that they raise it instead of waiting for this process."""
        self._closing.set()
        if isinstance(error, Exception) and not self._told and self._settled < len(self._mine):
            try:
                # The buddy must not wait for this process's part, nor read it for it.
                self._board.offer(f"fate/{self._settled}/{self._me}", "failed")
                self._board.meet(f"settled/{self._settled}", error=error)
            except Exception:
                pass  # raised on every other process; here the caller raises `error` itself
        while self._watcher.is_alive():  # a restore that failed: its watcher may wait on any key
            try:
                self._board.post(self._watching, "closed")
            except Exception:
                break  # the service is gone: the watcher's read ends by itself, and it is a daemon
            self._watcher.join(0.1)
        self._board.close()


def _swaps(request: Request) -> tuple[tuple[int, int], ...] | None:
    """The permute between every two buddies' devices, both ways, for `request`'s blocks;
    None where its blocks cannot be moved so (see `_routable`)."""
    sharding = _routable(request)
    if sharding is None:
        return None
    return _swap(_permute.mesh_of(sharding)) or None


@functools.lru_cache(maxsize=64)
def _swap(mesh: jax.sharding.Mesh) -> tuple[tuple[int, int], ...]:
    processes = {device.process_index for device in mesh.devices.flat}
    return tuple(pair for p in sorted(processes) if p ^ 1 in processes for pair in (_pairs(mesh, p, p ^ 1) or ()))


def _routable(request: Request) -> jax.sharding.NamedSharding | None:
    """The sharding of `request`'s blocks where they can be read by one process for
    another and moved to it, else None: a shared leaf not already routed (the local
    tier), read by a sharded form whose blocks all have one shape, of a dtype whose
    blocks can be ORed as integers."""
    form, share = request.form, request.share
    if not (share is not None and not share.routes and _moving_form(form)
            and _permute.as_bits(form.dtype)
            and _permute.movable(form.sharding, request.stored.shape)):
        return None
    assert isinstance(form.sharding, jax.sharding.NamedSharding)  # `movable`
    return form.sharding


def _moving_form(form: Form) -> TypeGuard[Sharded]:
    """Whether `form` is one whose reads relief may move: a sharded form of this module's
    kinds (not one reading otherwise, such as the local tier's)."""
    return type(form) in (Sharded, ShardedByReaders, OneReader)


def _route(request: Request, helper: int | None, helped: int | None) -> tuple[tuple[int, int], ...] | None:
    """The permute from `helper`'s devices to `helped`'s (same rank by id, as mesh
    positions) that carries `helped`'s part of `request`, or None when `helper` cannot
    read it for `helped`: not `_routable`, or the two processes' devices in its mesh
    differ in number, or `helped` reads none of it."""
    if helper is None or helped is None or (sharding := _routable(request)) is None:
        return None
    form = request.form
    if isinstance(form, OneReader) and not any(device.process_index == helped for _, device in form.readers):
        return None  # else `helped` has devices in the mesh, so a part of the staged slices to read
    return _pairs(_permute.mesh_of(sharding), helper, helped)


@functools.lru_cache(maxsize=64)
def _pairs(mesh: jax.sharding.Mesh, helper: int, helped: int) -> tuple[tuple[int, int], ...] | None:
    """`_route`'s permute for any leaf on `mesh` (None where the two processes' devices
    in it differ in number, or `helped` has none)."""
    flat = list(mesh.devices.flat)
    givers = sorted((d for d in flat if d.process_index == helper), key=lambda d: d.id)
    takers = sorted((d for d in flat if d.process_index == helped), key=lambda d: d.id)
    if not takers or len(givers) != len(takers):
        return None
    position = {device: i for i, device in enumerate(flat)}
    return tuple((position[a], position[b]) for a, b in zip(givers, takers))


def _blocks(request: Request, route: Sequence[tuple[int, int]],
            pieces: list[tuple[Region, np.ndarray, list[jax.Device]]]) -> jax.Array:
    """The array of blocks this process sends along `route` for `request`: on each of
    its devices, what it read for the device the route sends that block to (zeros
    where it read nothing, as on every process that helped no one)."""
    form = request.form
    # A route is only for a sharded form on a NamedSharding (`_routable`).
    assert isinstance(form, Sharded) and isinstance(form.sharding, jax.sharding.NamedSharding)
    sharding = form.sharding
    shape, dtype = request.stored.shape, form.dtype
    flat = list(_permute.mesh_of(sharding).devices.flat)
    back = {flat[b]: flat[a] for a, b in route}
    where = sharding.devices_indices_map(shape)
    block = sharding.shard_shape(shape)
    host: dict[jax.Device, np.ndarray] = {}
    for region, values, devices in pieces:
        for device in devices:
            sender = back[device]
            data = host.setdefault(sender, np.zeros(block, dtype))
            data[relative(region, region_of(where[device], shape))] = values
    arrays = [jax.device_put(host[d], d) if d in host else jnp.zeros(block, dtype, device=d)
              for d in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
