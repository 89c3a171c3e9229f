"""The local tier: each process's own copy, on its own disk (a RAM disk, a local SSD), of
what its devices hold, saved every few steps beside the persistent checkpoints, and
restored when it is newer than the newest persistent step and the surviving copies
rebuild it.

Layout: `<local_directory>/run-<run>/process<i>/<step>/`, a zarrckpt checkpoint (the
same format as the persistent tier) holding the chunks process i's devices held,
replicas included, and every host value. `<run>` is the persistent directory's run
identity (`zarrckpt.run` there), so jobs of different runs given one local directory
each work on their own copies; each process holds a lease on its directory (see
`_lease`), so two live jobs of the same run never mix theirs. Every directory is this
user's alone (mode 0700; see `_storage.local.private_directory`). A copy's metadata records,
under `local`, the run, the step, the newest persistent step committed before it, the
process, the process count, the chunks of each array it holds and who keeps whose peer
copy. With `local_peer_copies`, a copy also holds the chunks of its peers' parts that
its own devices lack (see `_peers`): a lost host is rebuilt from them. Every process's
copy of a step has the same save identity; each commits its own only once every process
has written all of its (`_save.protocol.PER_PROCESS`). A copy that fails to save is
removed.

Restoring, one agreement: each process lists its committed copies and what they hold
(a copy of another run or step, saved after a persistent step that is gone, or with a
chunk missing, cut short or anything else wrong is set aside, with a warning); newest
first, the local steps newer than the newest committed persistent step are tried
(`_restore.from_copies`), a step's damaged copies set aside (deleted) and the same step
tried again without them, then the next candidate (then the manager's persistent tier).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import uuid
from collections.abc import Collection, Mapping, Sequence, Set as AbstractSet
from typing import Any

from .._format import copy_record, naming as _naming
from .._format.copy_record import CopyRecord
from .._options import LoadOptions, SaveOptions
from .._run import lease as _lease, retention as _retention, steps as _steps
from .._save import PER_PROCESS, BackgroundSave, PlanCache, SaveJob, Unguarded
from .._save.plan import ArrayPlan
from .._save.protocol import held
from .._storage import Location, resolve
from .._util import multihost as _multihost
from ..errors import CheckpointError, CheckpointLocationError, DirectoryInUseError
from . import copies as _copies, peers as _peers
from .from_copies import CopiesDamaged, CopyReader, Unusable, open_copy

log = logging.getLogger("zarrckpt")

_RUN_DIR = "run-"  # a run's copies: run-<identity>
_PROCESS_DIR = "process"  # each process's copies in it: process0, process1...
RUN_FILE = "zarrckpt.run"  # in the persistent directory: its run identity
_CRC_BYTES, _BLOCK_BYTES = 4, 4096
# Room kept free beyond a step's chunks and metadata: the filesystem's own.
_SPARE_BYTES = 2**16


class _NoRoom(CheckpointError):
    """A local copy would not fit on some process's disk."""


class LocalTier:
    """One process's part of the local tier, as a CheckpointManager keeps it."""

    def __init__(self, directory: Location, run: str, interval: int, keep_last: int, heartbeat_s: float) -> None:
        self.directory = directory  # local_directory, as given
        self.run = run
        self.root = directory.child(f"{_RUN_DIR}{run}").child(f"{_PROCESS_DIR}{_multihost.process_index()}")
        self.interval, self.keep_last = interval, keep_last
        self.last: int | None = None  # the step this manager last saved here
        self.peers = _peers.Peers()  # who keeps whose peer copy
        self._lease = _lease.Lease(self.root, heartbeat_s)
        self._plans = PlanCache()  # the last copy's, for the next of the same tree

    @classmethod
    def open(cls, directory: Location, run: str, interval: int, keep_last: int, *, heartbeat_s: float,
             timeout_s: float, peer_copies: int = 0, peer_group: str | None = None) -> LocalTier:
        """Every process makes its directory, checks that only this user can change it
        and takes its lease; a refusal on any process (CheckpointLocationError) is
        raised on every process, before anything is written or deleted. With
        `peer_copies`, the processes learn each other's failure domain (`peer_group`,
        by default its slice or host) and choose who keeps whose copies (ValueError
        where the domains do not allow it, see `_peers.choose`). Agreement."""
        tier = cls(directory, run, interval, keep_last, heartbeat_s)
        try:
            with _multihost.Agreement("manager-local-open", timeout_s, what=f"opening local_directory "
                                      f"{directory.url}", error=CheckpointLocationError) as op:
                op.check("open", tier._open)
                if peer_copies:
                    found = op.gather("domains", lambda: {"group": peer_group, **_peers.where()})
                    given = [f["group"] for f in found]
                    if len({g is None for g in given}) > 1:
                        raise ValueError("local_peer_group was given on processes "
                                         f"{[p for p, g in enumerate(given) if g]} only: give it on every process, "
                                         "or on none")
                    groups = [str(g) for g in given] if given[0] is not None else _peers.domains(found)
                    tier.peers = _peers.choose(peer_copies, groups)
        except BaseException:
            tier.close()
            raise
        return tier

    def _open(self) -> None:
        self.root.make_private(f"local_directory {self.directory.url}", "local_directory")
        try:
            self._lease.claim()
        except DirectoryInUseError as e:
            raise DirectoryInUseError(
                f"local_directory {self.directory.url} holds the copies of a live job of the same run ({e}); give "
                "each job its own local_directory") from None
        others = sorted(e.name for e in self.directory.list_dir() if e.type == "dir"
                        and e.name != f"{_RUN_DIR}{self.run}" and _holds_copies(self.directory, e.name))
        if others:
            log.warning("local_directory %s also holds the copies of %d other run(s) (%s): not used nor deleted; "
                        "delete them to free room", self.directory.url, len(others), ", ".join(others[:3]))

    def close(self) -> None:
        """Gives up this process's lease on its directory."""
        self._lease.release()

    def due(self, step: int) -> bool:
        return step % self.interval == 0 and step != self.last

    # -- saving ------------------------------------------------------------------

    def save(self, step: int, state: Any, options: SaveOptions, persistent: Collection[int],
             timeout_s: float) -> BackgroundSave | None:
        """This process's copy of `step`, to start or run; None, with a warning, if some
        process's copy would not fit on its disk (then no process saves it).
        `persistent`: the committed persistent steps (the copy records the newest).
        Agreement."""
        self.last = step  # tried once: a failed local save is not retried for the same step
        after = max(persistent, default=None)
        job = SaveJob.create(self.root.step(step), state, dataclasses.replace(options, overwrite=True),
                             channel="manager-local", commit=PER_PROCESS, beside=_peers.PeerPlans(self.peers),
                             plans=self._plans, guard=_Recorded(self.run, step, after, self.peers))
        try:
            with _multihost.Agreement("manager-local-room", timeout_s, what=f"the local copy of step {step}",
                                      error=_NoRoom) as op:
                op.check("room", lambda: self._check_room(_footprint(job)))
        except _NoRoom as e:
            log.warning("local checkpoint of step %d skipped (training goes on): %s", step, e)
            return None
        return BackgroundSave(job, f"zarrckpt-local-{step}", on_commit=lambda: self._committed(step),
                              on_failure=lambda e: self._failed(step, e))

    def _check_room(self, nbytes: int) -> None:
        free = self.root.free_bytes()
        if free < nbytes + _SPARE_BYTES:
            raise _NoRoom(f"{self.root.url} has {free / 1e9:.3f} GB free, process "
                          f"{_multihost.process_index()}'s copy needs {(nbytes + _SPARE_BYTES) / 1e9:.3f} GB")

    def _committed(self, step: int) -> None:
        """Keeps the newest `keep_last` copies (each process its own)."""
        log.info("local checkpoint step %d committed under %s", step, self.root.url)
        _retention.apply(self.root, _retention.Policy(keep_last=self.keep_last), {})

    def _failed(self, step: int, error: BaseException) -> None:
        """A failed copy (on every process: its agreement raises everywhere) is a
        warning, not an error: training and the persistent tier go on. What it left on
        this process's disk goes, so that the next copy has the room."""
        log.warning("local checkpoint of step %d failed (training goes on): %s", step, error)
        if not _steps.is_committed(self.root.step(step)):
            self._remove(step, committed=False, why="a local copy that failed")

    def _remove(self, step: int, *, committed: bool, why: str) -> None:
        try:
            _retention.delete(self.root, step, committed=committed, why=why)
        except Exception as e:  # whatever a broken disk holds there must not stop training
            log.warning("could not delete local copy %s (%s): %s", self.root.step(step).url, why, e)

    def forget(self, step: int) -> None:
        """Deletes this process's copy of `step`, if any (not collective): the persistent
        step was deleted by hand, and a restore must not bring it back from here."""
        if step in _steps.candidate_steps(self.root):
            self._remove(step, committed=_steps.is_committed(self.root.step(step)), why="its step was deleted")

    def forget_newer(self, step: int | None) -> None:
        """Deletes this process's copies newer than `step` (every one, for None): after a
        restore, they belong to training that was abandoned (not collective)."""
        for found in _steps.candidate_steps(self.root):
            if step is None or found > step:
                self._remove(found, committed=_steps.is_committed(self.root.step(found)),
                             why="a local copy newer than the step restored")
        if self.last is not None and (step is None or self.last > step):
            self.last = None

    # -- restoring ---------------------------------------------------------------

    def inventory(self) -> list[_copies.Copy]:
        """This process's committed copies of this run; the others, and any copy that
        fails a check, are left out with a warning."""
        found = []
        for step in _steps.scan(self.root)[1]:
            loc = self.root.step(step)
            try:
                found.append(open_copy(loc, self.run, step))
            except Exception as e:  # anything a broken or hostile disk can hold
                why = str(e) if isinstance(e, (Unusable, CheckpointError)) else f"{type(e).__name__}: {e}"
                log.warning("local copy %s not used: %s", loc.url, why)
        return found

    def set_aside(self, step: int, problems: dict[int, str]) -> None:
        """After reading the copies of `step` failed on the processes of `problems`:
        each of them deletes its copy, which will never read right (not collective)."""
        me = _multihost.process_index()
        if me in problems:
            log.warning("local copy %s set aside (deleted): %s", self.root.step(step).url, problems[me])
            self._remove(step, committed=True, why="damaged")


def local_directory(directory: str | None, interval: int | None, peer_copies: int,
                     peer_group: str | None) -> Location | None:
    """The local tier's directory for a manager's local_* options, or None without one.
    Raises TypeError or ValueError naming the option on a bad or contradictory one."""
    if peer_group is not None and not isinstance(peer_group, str):
        raise TypeError(f"local_peer_group must be a str naming this process's failure domain, got "
                        f"{type(peer_group).__name__}")
    if (peer_copies or peer_group is not None) and directory is None:
        raise ValueError("local_peer_copies and local_peer_group keep copies of the local tier: give "
                         "local_directory and local_save_interval_steps too")
    processes = _multihost.process_count()
    if peer_copies >= processes > 1:
        raise ValueError(f"local_peer_copies={peer_copies} needs more processes than the job's {processes}: "
                         "each copy is kept by another process")
    if peer_copies and processes == 1:
        log.warning("local_peer_copies=%d: a job of one process has no peer to keep a copy", peer_copies)
    if directory is None and interval is None:
        return None
    if directory is None or interval is None:
        raise ValueError("local_directory and local_save_interval_steps go together: give both for a local "
                         "tier, or neither")
    if not isinstance(directory, str):
        raise TypeError(f"local_directory must be a str path, got {type(directory).__name__}")
    local = resolve(directory)
    if not local.is_local:
        raise ValueError(f"local_directory must be a path on this host's own disk (a RAM disk or a local SSD), "
                         f"got {directory!r}; the persistent tier is checkpoint_dir")
    return local


class _Recorded(Unguarded):
    """The guard of a local copy of `step`: it writes where the tier's own lease lets it
    (the tier's directory is this process's alone), and records what the copy holds
    (`CopyRecord`: the run, the newest persistent step `after` it, which chunks of each
    array this process's group holds, who keeps whose peer copy)."""

    def __init__(self, run: str, step: int, after: int | None, peers: _peers.Peers) -> None:
        self._run, self._step, self._after, self._peers = run, step, after, peers
        self._held: dict[str, list[tuple[int, ...]]] = {}

    def planned(self, plans: Sequence[ArrayPlan], documents: Mapping[str, dict[str, Any]],
                reused: AbstractSet[str]) -> None:
        self._held = held(plans, documents)

    def before_prepare(self) -> Mapping[str, Any]:
        return {copy_record.KEY: CopyRecord(self._run, self._step, self._after, _multihost.process_index(),
                                            _multihost.process_count(), self._held, self._peers.holders).as_meta()}


def _run_of_directory(name: str) -> str | None:
    """The run whose copies a directory of a local directory holds, or None: `run-<id>`,
    or the layout of zarrckpt before runs had a directory of their own (`process<i>`)."""
    if name.startswith(_RUN_DIR) and re.fullmatch(r"[0-9a-f]{32}", name[len(_RUN_DIR):]):
        return name[len(_RUN_DIR):]
    if name.startswith(_PROCESS_DIR) and name[len(_PROCESS_DIR):].isdecimal() and name.isascii():
        return ""
    return None


def _holds_copies(directory: Location, name: str) -> bool:
    """Whether the directory `name` of a local directory holds a run's copies: it is a
    run's, or, in the layout before runs had a directory of their own, a process's that
    holds steps (someone's folder named `process0` does not)."""
    run = _run_of_directory(name)
    if run == "":
        return any(_naming.parse_step_dir_name(e.name) is not None for e in directory.list_dir(name))
    return run is not None


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


def _footprint(job: SaveJob) -> int:
    """What a copy takes on disk, at most: its chunks with their checksums, every file
    rounded up to a 4 KiB block, and every array's metadata twice (its own and the
    group's)."""
    units = [unit for _, unit in job.units()]
    return (sum(u.nbytes + _CRC_BYTES for u in units) + (len(units) + 2 * len(job.arrays) + 1) * _BLOCK_BYTES
            + 2 * len(json.dumps(job.arrays)))


def copy_directories(directory: Location) -> list[tuple[str, int, Location]]:
    """Every process's directory of copies in a local tier's `directory`: (run, process
    index, directory), by run then process. Runs of zarrckpt before runs had a
    directory of their own are run ""."""
    found = []
    for entry in directory.list_dir():
        run = _run_of_directory(entry.name) if entry.type == "dir" else None
        if run == "":
            found.append((run, int(entry.name[len(_PROCESS_DIR):]), directory.child(entry.name)))
        elif run is not None:
            below = directory.child(entry.name)
            found += [(run, int(e.name[len(_PROCESS_DIR):]), below.child(e.name)) for e in below.list_dir()
                      if e.type == "dir" and _run_of_directory(e.name) == ""]
    return sorted(found, key=lambda found: found[:2])


def restore_newer_copy(root: Location, tier: LocalTier, target: Any, options: LoadOptions,
                       timeout_s: float) -> tuple[Any, int] | None:
    """(state, step) of the newest step the local copies rebuild, if it is newer than
    the newest committed persistent step; else None (the persistent tier's to
    restore). Agreement."""
    with _multihost.Agreement("restore-tiers", timeout_s, what=f"restoring from {tier.root.url} or {root.url}") as op:
        found = op.gather("inventory", lambda: [c.as_json() for c in tier.inventory()])
        persistent = set(op.decide("persistent", lambda: _steps.scan(root)[1]))
        me, floor = _multihost.process_index(), max(persistent, default=None)
        copies = [{c.step: c for c in map(_copies.Copy.from_json, listed) if _after_kept(c, persistent, tier, p == me)}
                  for p, listed in enumerate(found)]
        reading = CopyReader(tier.root, target, options, op, timeout_s)
        for step in sorted({s for held in copies for s in held if floor is None or s > floor}, reverse=True):
            while any(step in held for held in copies):
                try:
                    return reading.read(step, [held.get(step) for held in copies]), step
                except CopiesDamaged as e:  # on every process alike: try again without those copies
                    tier.set_aside(step, e.problems)
                    for p in e.problems:
                        copies[p].pop(step, None)
                except Unusable as e:
                    log.warning("local step %d is not used: %s", step, e)
                    break
    return None


def _after_kept(copy: _copies.Copy, persistent: set[int], tier: LocalTier, mine: bool) -> bool:
    """Whether `copy` was saved after a persistent step that is still there: if that
    step is gone, the persistent directory was cleared or rolled back since (a new run
    under the same URL), and the copy is of another line of training."""
    if copy.after is None or copy.after in persistent:
        return True
    if mine:
        log.warning("local copy %s not used: it was saved after persistent step %d, which is gone",
                    tier.root.step(copy.step).url, copy.after)
    return False
