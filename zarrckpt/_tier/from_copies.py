"""Restoring a step from the local tier's copies (see `_tiers`, which keeps them), inside
the restore's agreement, in four steps every process takes together:
    agree  the copies are of one save and record one peer table; the step's metadata,
           read by one holder, is every process's
    match  the target against the saved leaves (a mismatch anywhere is raised
           everywhere; a saved scalar that does not read is its copy's damage)
    plan   who reads each part from which copy (`copies.plan`); host values some
           process lacks relayed through the coordination service
    read   `load_requests`, with a gate before each collective: a read that fails on any
           process fails on every process before any enters the next one
A copy that cannot rebuild the step is `Unusable`; damage found is `CopiesDamaged`,
naming whose copies (the caller sets them aside and tries again without them).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import itertools
import logging
import math
from typing import Any

import numpy as np

from .. import _commit
from .._format import naming as _naming
from .._format.chunks import ChunkCodec
from .._format.copy_record import CopyRecord
from .._options import LoadOptions
from .._restore import checkpoint as _reader, match as _match
from .._restore.load import GateClosed, load_requests
from .._storage import Location
from .._util import multihost as _multihost, progress as _progress
from .._util.regions import Region, region_shape, region_slices
from ..errors import CheckpointError, CheckpointMismatchError, UnsupportedLeafError
from . import copies as _copies, peers as _peers

log = logging.getLogger("zarrckpt")


class Unusable(Exception):
    """A copy, or the copies of a step, that cannot be used; the message says why."""


class CopiesDamaged(GateClosed):
    """Reading some processes' copies failed (`problems`: why, by process)."""

    def __init__(self, problems: dict[int, str]) -> None:
        super().__init__("; ".join(f"process {p}: {why}" for p, why in sorted(problems.items())))
        self.problems = problems


@dataclasses.dataclass
class CopyReader:
    """Restores onto `target` from the copies under `root` (a local tier's directory of
    this process), attempt after attempt, inside the restore's agreement `op`."""

    root: Location
    target: Any
    options: LoadOptions
    op: _multihost.Agreement
    timeout_s: float
    attempts: int = 0

    def read(self, step: int, found: list[_copies.Copy | None]) -> Any:
        """Restores `step` from the copies `found` (by process; None where a process has
        none). Raises, on every process alike, Unusable if the copies are of several
        saves or do not rebuild the target, CopiesDamaged if reading some of them failed,
        CheckpointMismatchError if the target does not match. Agreement."""
        self.attempts += 1
        attempt = str(self.attempts)
        me = _multihost.process_index()
        ckpt, table = self._agree(step, found, attempt)
        requests, treedef = self._match_target(step, ckpt, found[me] is not None, attempt)
        try:
            planned = _copies.plan(requests, [c.held if c is not None else None for c in found], me,
                                   table if all(len(h) == len(found) for h in table) else ())
        except _copies.Unrebuildable as e:
            raise Unusable(f"the local copies cannot rebuild it ({e})") from None
        requests = self._relay(ckpt, planned, attempt)
        gates = itertools.count()

        def gate(error: BaseException | None) -> None:
            if failed := self.op.failures(f"read-{attempt}-{next(gates)}", error):
                raise CopiesDamaged(failed)

        state = load_requests(ckpt, requests, treedef, self.options, gate=gate)
        log.info("process %d restored step %d from the local tier %s: %s from its own copy, %s from other "
                 "processes, nothing from the persistent store", me, step, self.root.url,
                 _progress.size(planned.own_bytes), _progress.size(planned.peer_bytes))
        return state

    def _agree(self, step: int, found: list[_copies.Copy | None], attempt: str
               ) -> tuple[_reader.Checkpoint, tuple[tuple[int, ...], ...]]:
        """The step's copies opened as one checkpoint (the metadata one holder read), and
        who keeps whose peer copy (a job of another size: each part changed hands)."""
        holders = [p for p, c in enumerate(found) if c is not None]
        ids = {c.save_id for c in found if c is not None}
        if len(ids) > 1:
            raise Unusable(f"its copies are of {len(ids)} different saves")
        tables = {c.peers for c in found if c is not None}
        if len(tables) > 1:
            raise Unusable("its copies record different peer copies")
        loc = self.root.step(step)
        document = self.op.decide(f"document-{attempt}", lambda: _outcome(lambda: _document(loc)),
                                  source=holders[0])
        ckpt = _opened(loc, document, holders[0], ids.pop())
        if found[_multihost.process_index()] is None:
            ckpt = dataclasses.replace(ckpt, committed=False)  # reads nothing of its own: nothing to re-check
        return ckpt, tables.pop()

    def _match_target(self, step: int, ckpt: _reader.Checkpoint, mine: bool, attempt: str) -> tuple[list[Any], Any]:
        """The target matched against the step (`_match.match`), on every process alike."""
        matched: list[Any] = []
        damage: list[BaseException] = []

        def matching() -> None:  # reads the saved scalars that decide whether they fit
            try:
                matched.extend(_match.match(ckpt, self.target, self.options.allow_dtype_cast, self.options.partial,
                                            True, values=mine, rename=self.options.rename,
                                            fallback=self.options.fallback)
                               if self.target is not None else
                               ([_match.Request(s, _match.saved_form(s)) for s in ckpt.leaves.values()], None))
            except (CheckpointMismatchError, UnsupportedLeafError):  # the target's fault, never the copy's
                raise
            except Exception as e:  # a scalar that does not read right: the copy's damage
                damage.append(e)

        # A mismatch on any process is raised on all; one without a copy reads no scalar.
        with _multihost.Agreement("restore-tiers-match", self.timeout_s, what=f"matching local step {step}",
                                  error=CheckpointMismatchError) as check:
            check.check("match", matching)
        if failed := self.op.failures(f"match-{attempt}", damage[0] if damage else None):
            raise CopiesDamaged(failed)
        return matched[0], matched[1]

    def _relay(self, ckpt: _reader.Checkpoint, planned: _copies.CopyPlan, attempt: str) -> list[_match.Request]:
        """The plan's requests, with the host values some process lacks sent to every
        process by their holders, before any collective."""
        requests = list(planned.requests)
        for relay in planned.relays:
            request = requests[relay.index]
            stored = request.stored
            data = np.empty(stored.shape, stored.dtype)  # writable, as read ones are
            for k, (part, source) in enumerate(relay.parts):
                sent = self.op.decide(f"relay-{attempt}-{relay.index}-{k}",
                                      functools.partial(_relayed, ckpt, stored, part), source=source)
                data[region_slices(part)] = np.frombuffer(base64.b64decode(_value(sent, source)),
                                                          stored.dtype).reshape(region_shape(part))
            requests[relay.index] = dataclasses.replace(request, form=_copies.Received(request.form.dtype,
                                                                                        request.form, data))
        return requests


def _relayed(ckpt: _reader.Checkpoint, stored: _reader.StoredLeaf, part: Region) -> dict[str, Any]:
    """What a process relaying (part of) a host value publishes: its bytes (base64)."""
    return _outcome(lambda: base64.b64encode(ckpt.read(stored, part).tobytes()).decode())


def _outcome(read: Any) -> dict[str, Any]:
    """What a process reading from its copy for the others publishes: the value, or why
    its copy could not give it (never an error: the others must learn whose copy)."""
    try:
        return {"value": read()}
    except Exception as e:
        return {"damaged": str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"}


def _document(loc: Location) -> dict[str, Any]:
    """The group metadata document of the copy at `loc`; FileNotFoundError if it is gone."""
    group = _commit.read_group(loc)
    if group is None:
        raise FileNotFoundError(f"no group metadata at {loc.url}")
    return group.document


def _value(outcome: dict[str, Any], source: int) -> Any:
    if "damaged" in outcome:
        raise CopiesDamaged({source: outcome["damaged"]})
    return outcome["value"]


def _opened(loc: Location, outcome: dict[str, Any], source: int, save_id: str) -> _reader.Checkpoint:
    """The copy at `loc` opened from the group metadata `source` read (the same on every
    process); metadata that does not open is damage of `source`'s copy."""
    document = _value(outcome, source)
    try:
        return _reader.open_checkpoint(loc, group=_commit.Group(3, document["attributes"], document),
                                       save_id=save_id)
    except Exception as e:
        raise CopiesDamaged({source: str(e)}) from None


def open_copy(loc: Location, run: str, step: int) -> _copies.Copy:
    """The copy at `loc`, checked: a local copy of `run`'s `step` whose every chunk is
    there with its size. Raises Unusable (or what reading it raised) if not."""
    group = _commit.read_group(loc)
    try:
        record = _record(group)
    except ValueError as e:
        raise Unusable(str(e)) from None
    if record.run != run:
        raise Unusable(f"it belongs to another run ({record.run!r})")
    if record.step != step:
        raise Unusable(f"it holds step {record.step!r}")
    ckpt = _reader.open_checkpoint(loc, group=group)  # the metadata already read
    if ckpt.save_id is None:
        raise Unusable("it has no save identity")
    sizes = {e.name: (e.type, e.size) for e in loc.walk()}
    held = {}
    for name, coords in record.held.items():
        stored = ckpt.leaves.get(name)
        if stored is None:
            raise Unusable(f"it says it holds array {name!r}, which it does not describe")
        codec = stored.codec
        if not isinstance(codec, ChunkCodec):
            raise Unusable(f"array {name!r} is not in zarrckpt's layout")
        held[name] = frozenset(_chunk_coords(stored, c) for c in coords)
        for c in held[name]:
            key = codec.key_at(c)
            if (why := codec.object_problem(*sizes.get(key, (None, 0)))) is not None:
                raise Unusable(f"chunk {key} {why}")
    return _copies.Copy(step, ckpt.save_id, held, record.after, record.peers)


def peers_of(group: _commit.Group | None) -> list[int]:
    """The processes whose peer copy the local copy of metadata `group` also holds (see
    `_peers`); none for metadata that does not say."""
    try:
        record = _record(group)
    except ValueError:
        return []
    return _peers.Peers(record.peers).sources(record.process)


def _record(group: _commit.Group | None) -> CopyRecord:
    """The copy record in the group metadata `group` (see `CopyRecord.parse`)."""
    return CopyRecord.parse(group.attributes.get(_naming.META_ATTR) if group is not None else None)


def _chunk_coords(stored: _reader.StoredLeaf, coords: tuple[int, ...]) -> tuple[int, ...]:
    """`coords` (a record's, see `CopyRecord.parse`), checked to be a chunk's place in the
    grid of `stored`; Unusable if it is none."""
    grid = [math.ceil(d / c) if d else 1 for d, c in zip(stored.shape, stored.chunks)]
    if len(coords) != len(grid) or not all(c < n for c, n in zip(coords, grid)):
        raise Unusable(f"it says it holds chunk {list(coords)!r} of array {stored.name!r}, whose grid is {grid}")
    return coords
