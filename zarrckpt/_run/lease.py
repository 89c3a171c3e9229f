"""One writer per checkpoint directory: the lease, taken by compare-and-swap.

A second training job started by mistake on the same directory would interleave its
steps (and its retention) with the first one's. The lease is a numbered object in
`zarrckpt.leases/` (`0000000001`, `0000000002`, ...): whoever created the newest holds
the directory. Taking it is creating the next number with `Location.create`, which
fails if the number exists, so of two jobs that want it at the same moment exactly
one gets it, whatever their timing and whatever request lands late: on a local disk
(a hard link), S3 (If-None-Match), GCS (ifGenerationMatch=0) and memory://.

Whether S3 or GCS honour that condition is asked of them at the first claim on a store
in a process (`Location.probe`, in `zarrckpt.leases/`: a second create of one object
must be refused); servers that speak the S3 API without conditional writes (as S3
itself before 2024) write over what is there. A store without such a write
(`Location.exclusive` false: found so, or an fsspec client that has none) is warned
about at `claim`, and the number is taken otherwise (`_take_by_listing`): the claimant
writes a claim of its own, `<number>.claim-<owner>`, lists the leases, and takes the
number only if it sees no other claim of that number or more and no lease of that
number or more; it deletes its claim only once it has written the lease. Of two
claimants whose writes and listings the store orders (S3 and its kind list what they
acknowledged), the one that lists second sees the other's claim or lease, so both
cannot take it; both may see each other and both be refused. A claim left by a
claimant that died in between is watched for 2.5 of this claimant's heartbeats, and
passed over (the next number is taken) if it stays; a claimant that only paused there
is then a holder taken over, as below. After writing its lease a claimant lists once
more, and gives way to a newer number found.

The holder renews its own object every `heartbeat_s` from a background thread (only
it writes that number) and marks it released when it closes (removes it where that
cannot be written: a full disk). A new claimant that
finds the newest not released watches it for 2.5 of the heartbeats the holder says
it keeps (the claimant's own if it says none; at most 10 minutes): if it changes,
its owner is alive and the claimant is refused; if not, the owner died (a crash, a
preemption) and the claimant takes the next number. Watching for change, not
comparing timestamps, keeps this correct whatever the hosts' clocks say. A lease
whose writer is provably gone is taken over at once, so a job restarted in place after
a crash does not wait: written on this very machine (its boot id) in this PID
namespace, by a process id that is gone or now names another process (its start
time); one whose writer is provably alive there is refused at once. A process in another container
(another PID namespace, perhaps with the same host name) cannot be seen from here, so
its lease is watched like any other. A lease of this very process is another manager's
here that was never closed: refused at once, saying so, unless that manager is garbage
(its finalizer gives the lease back); a new CheckpointManager on its directory has it
given back first (the earlier one is taken over), then claims as any claimant does.
Only the process that took a lease gives it back: a forked child (an `os.fork`, a
multiprocessing worker) never does. A holder that finds a newer number (it was taken
over while it looked dead) stops saving: `check` runs before each save, again
immediately before its commit, and before retention deletes anything, so that a
holder stopped past its lease (SIGSTOP, a paused VM) and resumed mid-save neither
commits nor deletes in a run another job holds now.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from .._format import naming as _naming, zarrjson as _zarrjson
from .._storage import Location, NotAFileInCheckpoint, TooLarge
from ..errors import DirectoryInUseError

log = logging.getLogger("zarrckpt")

LEASES = "zarrckpt.leases"
DEFAULT_HEARTBEAT_S = 5.0
_WATCH_BEATS = 2.5  # how many heartbeats a found lease must stay unchanged to count as dead
_MAX_WATCH_S = 600.0  # however slow a heartbeat a lease claims
_LOOKS = 10  # listings of the leases before giving up on one that keeps changing
_CLAIM = ".claim-"  # a claim's name: the number claimed, this, the claimant (see `_take_by_listing`)


def lease_key(number: int) -> str:
    return f"{LEASES}/{number:010d}"


def refuse_if_held(step: Location, what: str, *, existing_only: bool = False) -> None:
    """Raises DirectoryInUseError, naming the holder, if the checkpoint `step` is a step
    of a directory of steps (by its name) whose lease a live job holds: a one-off
    writer into a run (`import`, `cp`) must not write beside a training job (whose
    retention would delete what it wrote, or whose restart would resume from it).
    With `existing_only`, only where `step` holds something already (a step the job
    may be writing, which the writer would take for a leftover and delete): a new step
    is written without a look at the lease. Watches a lease found unreleased as a
    claimant does; takes nothing, so one-off writers never hold each other up."""
    run = step.parent()
    if run is None or _naming.step_of_url(step.url) is None:
        return
    if existing_only and not step.exists():
        return
    live_holder(run, what)


def live_holder(root: Location, what: str) -> None:
    """Raises DirectoryInUseError, naming the holder, if a live job holds the lease of the
    directory of steps `root`; watches a lease found unreleased as a claimant does (2.5
    heartbeats), and takes nothing."""
    if root.list_dir(LEASES):  # else no manager ever ran there
        Lease(root, what=what).free()


class Lease:
    """A claim on `root`, renewed by a daemon thread. Process 0 only. `what` says who
    claims, in messages ("CheckpointManager", "zarrckpt import")."""

    def __init__(self, root: Location, heartbeat_s: float = DEFAULT_HEARTBEAT_S, *,
                 what: str = "CheckpointManager") -> None:
        self._root = root
        self._heartbeat_s = heartbeat_s
        self._what = what
        self._owner = uuid.uuid4().hex
        self._pid = os.getpid()  # the process whose lease it is: never one forked from it
        self._number: int | None = None
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def claim(self) -> None:
        """Takes the lease and starts renewing it; raises DirectoryInUseError if a live
        holder has it, or another claimant took it at the same moment."""
        self._root.probe(LEASES)
        if not self._root.exclusive:
            log.warning("%s cannot create an object only if it is absent (a store that ignores If-None-Match "
                        "writes over what is there): its lease is taken by a claim and a listing instead, which "
                        "holds only where listings show every write acknowledged; unchanged chunks are written "
                        "through this process where the store ignores a copy's condition too", self._root.url)
        self._take(self.free() + 1)

    def free(self) -> int:
        """The number of the newest lease once no live holder has it (0 if there is
        none): at once if it is released or its writer is provably gone, else after
        watching it for 2.5 of its heartbeats. Raises DirectoryInUseError, naming the
        holder, if it is renewed meanwhile (released meanwhile is free), or at once if
        its writer is a live process of this machine."""
        number, found = self._newest()
        # Unknown where there is no /proc: then no lease is taken for this process's own.
        mine = _this_process()
        if mine is not None and found is not None and not found.get("released") and found.get("process") == mine:
            gc.collect()  # a manager nobody holds (a notebook cell run again) gives its lease back
            number, found = self._newest()
            if found is not None and not found.get("released") and found.get("process") == mine:
                raise DirectoryInUseError(
                    f"{self._root.url} is held by another {found.get('by', 'CheckpointManager')} in this process "
                    f"(pid {os.getpid()}) that is still open: call its close() first, or use `with "
                    "zarrckpt.CheckpointManager(...) as mgr:` so that it is closed for you")
        if found is None or found.get("released") or (alive := _alive_here(found)) is False:
            return number
        if alive:  # no need to watch it renew
            raise DirectoryInUseError(
                f"{self._root.url} is in use by {_holder(found)} that is still alive (a process of this machine): "
                "two jobs saving into one directory would interleave their checkpoints. Stop the other job, or use "
                "another directory.")
        wait = min(_MAX_WATCH_S, _WATCH_BEATS * (_number(found.get("heartbeat_s")) or self._heartbeat_s))
        log.warning("%s has a lease of another %s (host %s, pid %s): watching it for %.1fs", self._root.url,
                    found.get("by", "CheckpointManager"), found.get("host"), found.get("pid"), wait)
        time.sleep(wait)
        now, again = self._newest()
        if (now, again) == (number, found) or again is None or again.get("released"):
            return now  # its holder died, or gave it back meanwhile
        raise DirectoryInUseError(
            f"{self._root.url} is in use by {_holder(again)} that is still alive: two jobs saving into one "
            "directory would interleave their checkpoints. Stop the other job, or use another directory.")

    def check(self, doing: str = "not saving") -> None:
        """Raises DirectoryInUseError, naming the directory, the new holder and what is
        not done (`doing`), if another claimant has taken the lease over: the newest
        lease, read now from the store, is not this one's number or not its owner's."""
        number, found = self._newest()
        if number != self._number or found is None or found.get("owner") != self._owner:
            raise DirectoryInUseError(f"{self._root.url} was taken over by {_holder(found or {})} while this job "
                                      f"did not renew its lease (stopped or cut off longer than its lease); {doing}")

    def release(self) -> None:
        """Stops renewing the lease and marks it released if it is still ours (removes it
        where that cannot be written: a full disk). Safe to call more than once, and from
        any thread (a finalizer may run on the renewing one). Does nothing in a process
        forked from the one that made it: the lease is the parent's, alive or not, and a
        child's exit must not give it to another job."""
        if os.getpid() != self._pid:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._number is None:
            return  # never claimed: nothing here is ours
        # Ours only if it still names us: a claim cut short (a Ctrl-C) may never have landed.
        number, found = self._newest()
        if number == self._number and found is not None and found.get("owner") == self._owner:
            try:
                self._root.write(lease_key(self._number), self._document(released=True), atomic=True)
            except OSError as e:  # no room for the document (a full disk): no lease frees the run as well
                log.warning("could not mark the lease on %s released (%s): removing it instead", self._root.url, e)
                self._root.remove_file(lease_key(self._number))
        self._number = None

    def _take(self, number: int) -> None:
        """Creates lease `number`; one claimant of it succeeds, whatever lands when."""
        # Noted before the request: a claim that a Ctrl-C cuts short once it has landed is
        # still given back by `release` (which gives back only a lease that names us).
        self._number = number
        if not self._root.exclusive:
            number = self._number = self._take_by_listing(number)
        else:
            try:
                self._root.create(lease_key(number), self._document())
            except FileExistsError:
                found = self._read(number)
                if found is None or found.get("owner") != self._owner:  # not our own attempt that landed late
                    self._number = None
                    raise self._taken_together(found or {}) from None
        self._thread = threading.Thread(target=self._renew, name="zarrckpt-lease", daemon=True)
        self._thread.start()
        try:
            for entry in self._root.list_dir(LEASES):  # the ones before, and claims of them: nobody's any more
                if (older := _parse_number(entry.name)) is not None and older < number:
                    self._root.remove_file(lease_key(older))
                elif (claim := _parse_claim(entry.name)) is not None and claim[0] <= number:
                    self._root.remove_file(f"{LEASES}/{entry.name}")
        except Exception as e:  # left for the next holder to remove: the lease is ours all the same
            log.warning("could not remove the older leases of %s: %s", self._root.url, e)

    def _take_by_listing(self, number: int) -> int:
        """Takes lease `number`, or the next after claims left by dead claimants, on a
        store without an exclusive create (see the module's docstring); returns the
        number taken. Raises DirectoryInUseError where another claimant took it or
        claimed it at the same moment."""
        passed: set[str] = set()  # claims found twice, a watch apart: their claimants are gone
        for _ in range(_LOOKS):
            claim = f"{lease_key(number)}{_CLAIM}{self._owner}"
            self._root.write(claim, self._document(), atomic=True)
            try:
                taken, claims = self._rivals(number, passed)
                if not taken and not claims:
                    self._root.write(lease_key(number), self._document(), atomic=True)
                    taken, _ = self._rivals(number + 1, passed)
                    if not taken:
                        return number
            finally:
                self._root.remove_file(claim)
            if taken:
                self._number = None
                raise self._taken_together(self._read(max(taken)) or {})
            # A live claimant's claim lasts a few requests: one still there after a watch is a dead one's.
            time.sleep(min(_MAX_WATCH_S, _WATCH_BEATS * self._heartbeat_s))
            taken, still = self._rivals(number, passed)
            if taken or not claims.keys() <= still.keys():  # taken, or a claimant alive that gave way
                self._number = None
                raise self._taken_together((self._read(max(taken)) if taken else None) or {})
            log.warning("%s: passing over %s, left by claimants of its lease that are gone", self._root.url,
                        ", ".join(f"{LEASES}/{name}" for name in sorted(claims)))
            passed |= claims.keys()
            number = max(number, *claims.values()) + 1
        self._number = None
        raise DirectoryInUseError(f"{self._root.url}: its lease changed {_LOOKS} times while being claimed")

    def _rivals(self, number: int, passed: set[str]) -> tuple[list[int], dict[str, int]]:
        """The leases numbered `number` or more, and the claims of such numbers by others
        (by name, but those `passed` over: the number each claims), as one listing of the
        lease area finds them."""
        taken, claims = [], {}
        for entry in self._root.list_dir(LEASES):
            if (found := _parse_number(entry.name)) is not None and found >= number:
                taken.append(found)
            elif (claim := _parse_claim(entry.name)) is not None and claim[0] >= number and \
                    claim[1] != self._owner and entry.name not in passed:
                claims[entry.name] = claim[0]
        return taken, claims

    def _taken_together(self, found: dict[str, Any]) -> DirectoryInUseError:
        return DirectoryInUseError(
            f"{self._root.url} was claimed at the same moment by {_holder(found)}: two jobs saving into one "
            "directory would interleave their checkpoints. Stop the other job, or use another directory.")

    def _renew(self) -> None:
        # Beats start a heartbeat apart however long each takes (a slow store), so that
        # a watcher's 2.5 heartbeats always see two of them.
        next_beat = time.monotonic() + self._heartbeat_s
        while not self._stop.wait(max(0.0, next_beat - time.monotonic())):
            next_beat += self._heartbeat_s
            try:
                number = self._number
                if number is None or self._newest()[0] != number:
                    return  # taken over: `check` reports it before the next save
                self._root.write(lease_key(number), self._document(), atomic=True)
            except Exception as e:  # a flaky store must not kill the heartbeat
                log.warning("could not renew the lease on %s: %s", self._root.url, e)

    def _newest(self) -> tuple[int, dict[str, Any] | None]:
        """The newest lease's number (0 if none) and what it says (None if there is none)."""
        for _ in range(_LOOKS):
            numbers = [n for entry in self._root.list_dir(LEASES)
                       if entry.type != "dir" and (n := _parse_number(entry.name)) is not None]
            if not numbers:
                return 0, None
            number = max(numbers)
            found = self._read(number)
            if found is not None:
                return number, found
            # Removed between the listing and the read (by a newer holder): look again.
        raise DirectoryInUseError(f"{self._root.url}: its lease changed {_LOOKS} times while being read")

    def _read(self, number: int) -> dict[str, Any] | None:
        """Lease `number`, or None if absent; one that is not a JSON object, or not a
        regular file (a FIFO, a link: never read), or larger than SMALL_BYTES (not read),
        reads as `{}` (an owner that is not alive: watched, then taken over)."""
        try:
            raw = self._root.read(lease_key(number))
        except FileNotFoundError:
            return None
        except (NotAFileInCheckpoint, TooLarge) as e:
            log.warning("%s: treated as the lease of a job that is not alive", e)
            return {}
        found = _zarrjson.object_or_none(raw)
        if found is None:
            log.warning("%s/%s is not a JSON object: treated as the lease of a job that is not alive",
                        self._root.url, lease_key(number))
        return found or {}

    def _document(self, *, released: bool = False) -> bytes:
        self._beats += 1
        return json.dumps({"owner": self._owner, "by": self._what, "host": socket.gethostname(), "pid": os.getpid(),
                           "process": _this_process(), "heartbeat_s": self._heartbeat_s, "beat": self._beats,
                           "released": released}).encode()


def _parse_number(name: str) -> int | None:
    return int(name) if len(name) == 10 and name.isascii() and name.isdigit() else None


def _parse_claim(name: str) -> tuple[int, str] | None:
    """The number and owner of a claim's name (see `_take_by_listing`), or None."""
    number, mark, owner = name.partition(_CLAIM)
    return (int(number), owner) if mark and owner and _parse_number(number) is not None else None


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 0.0


def _holder(found: dict[str, Any]) -> str:
    return f"another {found.get('by', 'CheckpointManager')} (host {found.get('host')}, pid {found.get('pid')})"


def _process_identity(pid: int) -> str | None:
    """What tells a process apart on this machine, now and later: the machine's boot,
    the PID namespace, the process id and its start time. None where it cannot be
    told (no /proc, or no such process: gone, or a zombie, which a container's first
    process may never reap)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # from field 3, after the command's name
        state, started = fields[0], fields[19]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X", "x") else f"{boot}/{namespace}/{pid}/{started}"


def _this_process() -> str | None:
    """This process's identity: asked of its own pid, not kept from the import, which a
    process forked since (a pre-forking launcher, a fork-started data loader worker)
    shares with its parent."""
    return _identity_of_this_process(os.getpid())


@functools.lru_cache(maxsize=1)
def _identity_of_this_process(pid: int) -> str | None:
    return _process_identity(pid)


def _alive_here(lease: dict[str, Any]) -> bool | None:
    """Whether the lease's writer is alive, where this machine can tell: it ran here, in
    this PID namespace, and its process id still names that process (True) or not
    (False). None for a writer elsewhere: only its renewals can tell."""
    written_by, pid = lease.get("process"), lease.get("pid")
    this = _this_process()
    if not isinstance(written_by, str) or not isinstance(pid, int) or this is None:
        return None
    if written_by.rsplit("/", 2)[0] != this.rsplit("/", 2)[0]:
        return None  # another machine or container
    return _process_identity(pid) == written_by
