"""The local tier: each process's own copy, on its own disk (a RAM disk, a local SSD), of
what its devices hold, saved every few steps beside the persistent checkpoints, and
restored when it is newer than the newest persistent step and the surviving copies
rebuild it.

Layout: `<local_directory>/process<i>/<step>/`, a zarrckpt checkpoint (the same
format as the persistent tier) holding the chunks process i's devices held, replicas
included, and every host value. Its metadata's `local` attribute records the run
(the persistent directory's URL), the step, the process, the process count and the
chunks of each array it holds. Every process's copy of a step has the same save
identity; each commits its own only once every process has written all of its (see
`_save.protocol`).

Restoring, one agreement:
    gather  each process lists its committed copies and what they hold; a copy of
            another run (another persistent URL, or saved after a persistent step that
            is gone), of another step, or with a chunk missing or cut short is set
            aside, with a warning
    choose  newest first, the local steps newer than the newest committed persistent
            step whose copies share one save identity and rebuild the whole target
            (see `_restore.local`); else the persistent tier
    read    each process reads its own copy; what it lacks comes from replicas over
            the device network, host values from a holder
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Collection
from typing import Any

from . import _commit, _multihost, _retention, _save, _steps
from ._format import naming as _naming
from ._options import LoadOptions, SaveOptions
from ._restore import checkpoint as _reader, local as _local_read, match as _match
from ._restore.load import load_requests
from ._storage import Location
from .errors import CheckpointError, CheckpointLocationError, CheckpointMismatchError

log = logging.getLogger("zarrckpt")

_PROCESS_DIR = "process"  # each process's directory: process0, process1...
RUN_FILE = "zarrckpt.run"  # in the persistent directory: its run identity
_CRC_BYTES, _BLOCK_BYTES = 4, 4096
# Room kept free beyond a step's chunks and metadata: the filesystem's own.
_SPARE_BYTES = 2**16


class _NoRoom(CheckpointError):
    """A local copy would not fit on some process's disk."""


@dataclasses.dataclass
class LocalTier:
    """One process's local tier, as a CheckpointManager keeps it."""

    root: Location  # this process's directory: <local_directory>/process<i>
    interval: int
    keep_last: int
    run: str = ""  # the persistent directory's run identity (`run_identity`), once the manager has it
    last: int | None = None  # the step this manager last saved here

    @classmethod
    def open(cls, directory: Location, interval: int, keep_last: int) -> LocalTier:
        return cls(directory.child(f"{_PROCESS_DIR}{_multihost.process_index()}"), interval, keep_last)

    def due(self, step: int) -> bool:
        return step % self.interval == 0 and step != self.last

    def job(self, step: int, state: Any, options: SaveOptions, persistent: Collection[int],
            timeout_s: float) -> _save.SaveJob | None:
        """The local save of `step`, or None, with a warning, if some process's copy
        would not fit on its disk (then no process saves it). `persistent`: the
        committed persistent steps (the copy records the newest). Agreement."""
        self.last = step  # tried once: a failed local save is not retried for the same step
        after = max(persistent, default=None)
        job = _save.SaveJob.create(self.root.step(step), state, dataclasses.replace(options, overwrite=True),
                                   extra_metadata={"local": {"run": self.run, "step": step, "after": after}},
                                   channel="manager-local", local=True)
        op = _multihost.Agreement("manager-local-room", timeout_s, what=f"the local copy of step {step}",
                                  error=_NoRoom)
        try:
            op.check("room", lambda: self._check_room(_footprint(job)))
        except _NoRoom as e:
            log.warning("local checkpoint of step %d skipped (training goes on): %s", step, e)
            return None
        finally:
            op.close()
        return job

    def _check_room(self, nbytes: int) -> None:
        os.makedirs(self.root.path, exist_ok=True)
        free = shutil.disk_usage(self.root.path).free
        if free < nbytes + _SPARE_BYTES:
            raise _NoRoom(f"{self.root.url} has {free / 1e9:.3f} GB free, process "
                          f"{_multihost.process_index()}'s copy needs {(nbytes + _SPARE_BYTES) / 1e9:.3f} GB")

    def check_run(self, timeout_s: float) -> None:
        """Raises CheckpointLocationError on every process if some process's directory
        holds committed copies of another run: they are left alone, never used nor
        deleted (a mistyped checkpoint_dir must not cost the real run its copies).
        Agreement."""
        def mine() -> None:
            others = sorted(step for step in _steps.scan(self.root)[1] if _run_of(self.root.step(step)) != self.run)
            if others:
                raise CheckpointLocationError(
                    f"local_directory {self.root.url} holds local copies of another run (steps "
                    f"{', '.join(map(str, others[:5]))}{' ...' if len(others) > 5 else ''}; this checkpoint_dir's "
                    f"run is {self.run}, in its {RUN_FILE}): delete them, or give another local_directory")

        op = _multihost.Agreement("manager-local-run", timeout_s, what="checking the local directories",
                                  error=CheckpointLocationError)
        try:
            op.check("run", mine)
        finally:
            op.close()

    def forget_newer(self, step: int | None) -> None:
        """Deletes this process's copies newer than `step` (every one, for None): after a
        restore, they belong to training that was abandoned (not collective)."""
        for found in _steps.candidate_steps(self.root):
            if step is None or found > step:
                _retention.delete(self.root, found, committed=_steps.is_committed(self.root.step(found)),
                                  why="a local copy newer than the step restored")
        if self.last is not None and (step is None or self.last > step):
            self.last = None

    def committed(self, step: int) -> None:
        """After this process's copy of `step` committed: keeps the newest `keep_last`
        copies (not collective: each process its own)."""
        log.info("local checkpoint step %d committed under %s", step, self.root.url)
        _retention.apply(self.root, _retention.Policy(keep_last=self.keep_last), {})


def _record(loc: Location) -> tuple[_commit.Group | None, Any]:
    """A copy's group metadata and its `local` record (None where it has none)."""
    group = _commit.read_group(loc)
    meta = group.attributes.get(_naming.META_ATTR) if group is not None else None
    return group, (meta.get("local") if isinstance(meta, dict) else None)


def _run_of(loc: Location) -> Any:
    """The run a committed copy records (None if it records none)."""
    local = _record(loc)[1]
    return local.get("run") if isinstance(local, dict) else None


def run_identity(root: Location) -> str:
    """The identity of the run in the persistent directory `root`, kept in its
    `zarrckpt.run` file: read, or made and written there by the first manager with a
    local tier. Copies of another run (another directory, or this one cleared) carry
    another identity and are never used."""
    try:
        found = root.read(RUN_FILE, limit=64).decode("ascii", "replace").strip()
    except FileNotFoundError:
        found = ""
    if re.fullmatch(r"[0-9a-f]{32}", found):
        return found
    made = uuid.uuid4().hex
    root.write(RUN_FILE, made.encode(), atomic=True, durable=True)
    return made


def _footprint(job: _save.SaveJob) -> int:
    """What a copy takes on disk, at most: its chunks with their checksums, every file
    rounded up to a 4 KiB block, and every array's metadata twice (its own and the
    group's)."""
    units = [unit for _, unit in job.units()]
    return (sum(u.nbytes + _CRC_BYTES for u in units) + (len(units) + 2 * len(job.arrays) + 1) * _BLOCK_BYTES
            + 2 * len(json.dumps(job.arrays)))


def process_directories(directory: Location) -> list[tuple[int, Location]]:
    """The processes' directories in a local tier's `directory`, by process index."""
    found = [(int(e.name[len(_PROCESS_DIR):]), directory.child(e.name)) for e in directory.list_dir()
             if e.type == "dir" and e.name.startswith(_PROCESS_DIR) and e.name[len(_PROCESS_DIR):].isdecimal()
             and e.name[len(_PROCESS_DIR):].isascii()]
    return sorted(found, key=lambda pair: pair[0])


@dataclasses.dataclass(frozen=True)
class Restored:
    """Where a restore read from: the tier, and this process's bytes by source."""

    tier: str  # "local" or "persistent"
    local_bytes: int = 0
    peer_bytes: int = 0


def restore_latest(root: Location, tier: LocalTier, target: Any, options: LoadOptions,
                   timeout_s: float) -> tuple[Any, int | None, Restored | None]:
    """The newest step the local copies rebuild if it is newer than the newest
    committed persistent step, else `_steps.restore_latest`. Agreement."""
    op = _multihost.Agreement("restore-tiers", timeout_s, what=f"restoring from {tier.root.url} or {root.url}")
    try:
        copies = op.gather("inventory", lambda: _inventory(tier))
        persistent = set(op.decide("persistent", lambda: _steps.scan(root)[1]))
        floor = max(persistent, default=None)
        copies = [_after_persistent(held, persistent, tier, p == _multihost.process_index())
                  for p, held in enumerate(copies)]
        steps = sorted({int(s) for held in copies for s in held if floor is None or int(s) > floor}, reverse=True)
        for local in steps:
            loaded = _try_step(local, copies, tier, target, options, op, timeout_s)
            if loaded is not None:
                return loaded[0], local, loaded[1]
    finally:
        op.close()
    state, step = _steps.restore_latest(root, target, options, timeout_s)
    if step is not None:
        log.info("process %d restored step %d from the persistent tier %s", _multihost.process_index(), step,
                 root.url)
    return state, step, Restored("persistent") if step is not None else None


def _after_persistent(copies: dict[str, Any], persistent: set[int], tier: LocalTier,
                      mine: bool) -> dict[str, Any]:
    """`copies` without those saved after a persistent step that is gone: the
    persistent directory was cleared or rolled back since (a new run under the same
    URL), so they are another line of training."""
    kept = {}
    for step, copy in copies.items():
        if copy["after"] is not None and copy["after"] not in persistent:
            if mine:
                log.warning("local copy %s not used: it was saved after persistent step %d, which is gone",
                            tier.root.step(int(step)).url, copy["after"])
            continue
        kept[step] = copy
    return kept


def _try_step(step: int, copies: list[dict[str, Any]], tier: LocalTier, target: Any, options: LoadOptions,
              op: _multihost.Agreement, timeout_s: float) -> tuple[Any, Restored] | None:
    """Restores local `step` if its copies share one identity and rebuild the target;
    else None, with a warning saying why. Agreement."""
    key, me = str(step), _multihost.process_index()
    found = {p: held[key] for p, held in enumerate(copies) if key in held}
    ids = {c["save_id"] for c in found.values()}
    if len(ids) > 1:
        log.warning("local copies of step %d are of %d different saves: not used", step, len(ids))
        return None
    holders = sorted(found)
    document = op.decide(f"document-{step}", lambda: _commit.read_group(tier.root.step(step)).document,  # type: ignore[union-attr]
                         source=holders[0])
    (save_id,) = ids
    group = _commit.Group(3, document["attributes"], document)
    ckpt = _reader.open_checkpoint(tier.root.step(step), group=group, save_id=save_id)
    if me not in found:
        # Holds no copy: reads nothing of its own, so there is nothing to re-check.
        ckpt = dataclasses.replace(ckpt, committed=False)
    matched: list[Any] = []
    check = _multihost.Agreement("restore-tiers-match", timeout_s, what=f"matching local step {step}",
                                 error=CheckpointMismatchError)
    try:  # a mismatch on any process is raised on all; one without a copy reads no scalar
        check.check("match", lambda: matched.extend(
            _match.match(ckpt, target, options.allow_dtype_cast, options.partial, True, values=me in found)
            if target is not None else ([_match.Request(s, _match.saved_form(s)) for s in ckpt.leaves.values()],
                                        None)))
    finally:
        check.close()
    requests, treedef = matched
    held = [None if p not in found else {name: {tuple(c) for c in coords} for name, coords in found[p]["held"].items()}
            for p in range(_multihost.process_count())]
    planned = _local_read.plan(requests, held, op)
    if isinstance(planned, str):
        log.warning("local step %d cannot be rebuilt from the local copies (%s): not used", step, planned)
        return None
    state = load_requests(ckpt, planned.requests, treedef, options)
    log.info("process %d restored step %d from the local tier %s: %.3f MB from its own copy, %.3f MB from "
             "other processes, 0 from the persistent store", me, step, tier.root.url,
             planned.local_bytes / 1e6, planned.peer_bytes / 1e6)
    return state, Restored("local", planned.local_bytes, planned.peer_bytes)


def _inventory(tier: LocalTier) -> dict[str, Any]:
    """This process's committed copies of this run, by step: save identity and the
    chunks held; copies of another run or step, or damaged, are left out with a
    warning."""
    copies = {}
    for step in _steps.scan(tier.root)[1]:
        loc = tier.root.step(step)
        group, local = _record(loc)
        problem = _problem(loc, group, local, tier, step)
        if problem is not None:
            log.warning("local copy %s not used: %s", loc.url, problem)
            continue
        save_id = group.save_id if group is not None else None
        copies[str(step)] = {"save_id": save_id, "held": local["held"], "after": local.get("after")}
    return copies


def _problem(loc: Location, group: _commit.Group | None, local: Any, tier: LocalTier, step: int) -> str | None:
    """What makes a committed copy unusable: not a local copy of this run's `step`, or a
    chunk it says it holds missing, a link, or of the wrong size."""
    if not isinstance(local, dict) or not isinstance(local.get("held"), dict):
        return "it is not a local-tier copy (no record of what it holds)"
    if local.get("run") != tier.run:
        return (f"it belongs to another run (run {local.get('run')!r}; {tier.run!r} is the one in the persistent "
                f"directory's {RUN_FILE})")
    if local.get("step") != step:
        return f"it holds step {local.get('step')!r}"
    if local.get("after") is not None and not isinstance(local.get("after"), int):
        return f"it records persistent step {local.get('after')!r}"
    try:
        ckpt = _reader.open_checkpoint(loc, group=group)  # the metadata already read
    except CheckpointError as e:
        return str(e)
    sizes = {e.name: (e.type, e.size) for e in loc.walk()}
    for name, coords in local["held"].items():
        stored = ckpt.leaves.get(name)
        if stored is None or not isinstance(coords, list):
            return f"it says it holds array {name!r}, which it does not describe"
        for c in coords:
            key = stored.codec.key_at(c)  # type: ignore[union-attr]
            kind, size = sizes.get(key, (None, 0))
            if kind is None or kind != "file":
                return f"chunk {key} is {'missing' if kind is None else 'a ' + kind}"
            if (why := stored.codec.size_damage(size)) is not None:  # type: ignore[union-attr]
                return f"chunk {key} {why}"
    return None
