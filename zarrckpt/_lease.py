"""One CheckpointManager per checkpoint directory.

A second training job started by mistake on the same directory would interleave its
steps (and its retention) with the first one's. The manager that owns a directory
keeps a lease file there and renews it every `heartbeat_s` from a background thread.
A new manager that finds a lease not its own watches it for a few heartbeats: if it
changes, its owner is alive and the new manager refuses to start; if not, the owner
died (a crash, a preemption) and the lease is taken over. Watching for change, not
comparing timestamps, keeps this correct whatever the hosts' clocks say. A lease
written on this host by a process that no longer exists is taken over at once, so a
job restarted in place after a crash does not wait.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from ._storage import Location
from .errors import DirectoryInUseError

log = logging.getLogger("zarrckpt")

LEASE_FILE = "zarrckpt.lease"
DEFAULT_HEARTBEAT_S = 5.0
_WATCH_BEATS = 2.5  # how many heartbeats a found lease must stay unchanged to count as dead


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
        self._write()
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
        self._stop.set()
        if self._thread is not None:
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
        try:
            doc = json.loads(self._root.read(LEASE_FILE))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def _write(self) -> None:
        self._beats += 1
        doc = {"owner": self._owner, "host": socket.gethostname(), "pid": os.getpid(), "beat": self._beats}
        self._root.write(LEASE_FILE, json.dumps(doc).encode(), atomic=True)


def _dead_here(lease: dict[str, Any]) -> bool:
    """Whether the lease's owner ran on this host and its process is gone."""
    if lease.get("host") != socket.gethostname() or not isinstance(lease.get("pid"), int):
        return False
    try:
        os.kill(lease["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, as another user
        return False
    return False
