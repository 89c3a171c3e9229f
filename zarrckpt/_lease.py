"""One CheckpointManager per checkpoint directory.

A second training job started by mistake on the same directory would interleave its
steps (and its retention) with the first one's. The manager that owns a directory
keeps a lease file there and renews it every `heartbeat_s` from a background thread.
A new manager that finds a lease not its own watches it for a few heartbeats: if it
changes, its owner is alive and the new manager refuses to start; if not, the owner
died (a crash, a preemption) and the lease is taken over. Watching for change, not
comparing timestamps, keeps this correct whatever the hosts' clocks say. A lease
whose writer is provably gone is taken over at once, so a job restarted in place
after a crash does not wait: written on this very machine (its boot id) in this PID
namespace, by a process id that is gone or now names another process (its start
time). A process in another container (another PID namespace, perhaps with the same
host name) cannot be seen from here, so its lease is watched like any other. A lease
of this very process is another manager's here that was never closed: refused at once,
saying so, unless that manager is garbage (its finalizer gives the lease back).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from ._format import zarrjson as _zarrjson
from ._storage import Location
from .errors import DirectoryInUseError

log = logging.getLogger("zarrckpt")

LEASE_FILE = "zarrckpt.lease"
DEFAULT_HEARTBEAT_S = 5.0
_WATCH_BEATS = 2.5  # how many heartbeats a found lease must stay unchanged to count as dead
_SETTLE_S = 0.02  # and twice the lease write's own time: then a rival's write has landed


class Lease:
    """This manager's claim on `root`, renewed by a daemon thread. Process 0 only."""

    def __init__(self, root: Location, heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        self._root = root
        self._heartbeat_s = heartbeat_s
        self._owner = uuid.uuid4().hex
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def claim(self) -> None:
        """Takes the lease and starts renewing it; raises DirectoryInUseError if a live
        manager holds it."""
        found = self._read()
        if found is not None and found.get("owner") != self._owner and found.get("process") == _THIS_PROCESS:
            gc.collect()  # a manager nobody holds (a notebook cell run again) gives its lease back
            found = self._read()
            if found is not None and found.get("process") == _THIS_PROCESS:
                raise DirectoryInUseError(
                    f"{self._root.url} is held by another CheckpointManager in this process (pid {os.getpid()}) "
                    "that is still open: call its close() first, or use `with zarrckpt.CheckpointManager(...) as "
                    "mgr:` so that it is closed for you")
        if found is not None and found.get("owner") != self._owner and not _dead_here(found):
            wait = self._heartbeat_s * _WATCH_BEATS
            log.warning("%s has a lease of another manager (host %s, pid %s): watching it for %.1fs",
                        self._root.url, found.get("host"), found.get("pid"), wait)
            time.sleep(wait)
            if self._read() != found:
                raise DirectoryInUseError(
                    f"{self._root.url} is in use by another CheckpointManager (host {found.get('host')}, pid "
                    f"{found.get('pid')}) that is still alive: two jobs saving into one directory would "
                    "interleave their checkpoints. Stop the other job, or use another directory.")
        started = time.monotonic()
        self._write()
        # A manager started at the same moment may have read the same lease (or none)
        # and be writing its own: wait about as long as a write takes, then see whose
        # lease stands. Only one of them finds its own.
        time.sleep(_SETTLE_S + 2 * (time.monotonic() - started))
        found = self._read()
        if found is None or found.get("owner") != self._owner:
            raise DirectoryInUseError(
                f"{self._root.url} was claimed at the same moment by another CheckpointManager (host "
                f"{(found or {}).get('host')}, pid {(found or {}).get('pid')}): two jobs saving into one directory "
                "would interleave their checkpoints. Stop the other job, or use another directory.")
        self._thread = threading.Thread(target=self._renew, name="zarrckpt-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raises DirectoryInUseError if another manager has taken the lease over."""
        found = self._read()
        if found is None or found.get("owner") != self._owner:
            raise DirectoryInUseError(
                f"{self._root.url} was taken over by another CheckpointManager "
                f"(host {(found or {}).get('host')}, pid {(found or {}).get('pid')}); not saving")

    def release(self) -> None:
        """Stops renewing the lease and removes it if it is still ours. Safe to call more
        than once, and from any thread (a finalizer may run on the renewing one)."""
        self._stop.set()
        if self._thread is None:
            return  # never claimed: nothing here is ours
        if self._thread is not threading.current_thread():
            self._thread.join()
        found = self._read()
        if found is not None and found.get("owner") == self._owner:
            self._root.remove_file(LEASE_FILE)

    def _renew(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            try:
                found = self._read()
                if found is not None and found.get("owner") != self._owner:
                    return  # taken over: `check` reports it before the next save
                self._write()
            except Exception as e:  # a flaky store must not kill the heartbeat
                log.warning("could not renew the lease on %s: %s", self._root.url, e)

    def _read(self) -> dict[str, Any] | None:
        """The lease found, or None; a lease that is not a JSON object reads as `{}`
        (an owner that is not alive: watched, then taken over)."""
        try:
            raw = self._root.read(LEASE_FILE)
        except FileNotFoundError:
            return None
        found = _zarrjson.object_or_none(raw)
        if found is None:
            log.warning("%s/%s is not a JSON object: treated as the lease of a manager that is not alive",
                        self._root.url, LEASE_FILE)
        return found or {}

    def _write(self) -> None:
        self._beats += 1
        doc = {"owner": self._owner, "host": socket.gethostname(), "pid": os.getpid(), "process": _THIS_PROCESS,
               "beat": self._beats}
        self._root.write(LEASE_FILE, json.dumps(doc).encode(), atomic=True)


def _process_identity(pid: int) -> str | None:
    """What tells a process apart on this machine, now and later: the machine's boot,
    the PID namespace, the process id and its start time. None where it cannot be
    told (no /proc, or no such process)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
        with open(f"/proc/{pid}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22, after the command's name
    except (OSError, IndexError):
        return None
    return f"{boot}/{namespace}/{pid}/{started}"


_THIS_PROCESS = _process_identity(os.getpid())


def _dead_here(lease: dict[str, Any]) -> bool:
    """Whether the lease's writer is provably gone: it ran on this machine, in this PID
    namespace, and its process id is gone or names another process now."""
    written_by, pid = lease.get("process"), lease.get("pid")
    if not isinstance(written_by, str) or not isinstance(pid, int) or _THIS_PROCESS is None:
        return False
    if written_by.rsplit("/", 2)[0] != _THIS_PROCESS.rsplit("/", 2)[0]:
        return False  # another machine or container: only its renewals can tell
    return _process_identity(pid) != written_by
