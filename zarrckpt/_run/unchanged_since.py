"""`save_checkpoint`'s `unchanged_since`: each chunk a save writes whose bytes are the
very chunk that a committed step's commit records under the same name (its CRC-32C and
size, see `_format.vouched`) is made from that step's (`Location.copy_new`: a hard link
on a local disk, a copy inside S3 or GCS) instead of written.

Only what the step's commit records is used, nothing this process saved or restored
before: any process, after a restart too, makes its chunks from any committed step
saved with checksums. A chunk is made only from the version the commit records for it,
which the store checks (in the copy's own request on S3 and GCS, on the link made on a
local disk): a chunk another program rewrote or deleted since is never made from, and
the bytes in hand are written instead. Each leaf is still copied off its devices and
checksummed, as a save without the option does; what is saved is the bytes written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _commit, _storage
from .._format import vouched as _vouched
from .._save.collaborators import NoReuse, Reused
from .._save.plan import ArrayPlan
from .._storage.store import SourceChanged, size_of
from .._util import multihost as _multihost, progress as _progress

log = logging.getLogger("zarrckpt")


class SameChunksSince(NoReuse):
    """A save's `Reuse` (see `_save.collaborators`) that makes each chunk it writes from
    the committed step `source` where that step's commit records the very same chunk."""

    def __init__(self, source: _storage.Location) -> None:
        self._source = source
        self._crcs: Mapping[str, int] = {}
        self._versions: Mapping[str, str] = {}
        self._made_bytes = 0  # of this process's chunks, made from `source`
        self._lock = threading.Lock()

    def plan(self, plans: Sequence[ArrayPlan], documents: Mapping[str, dict[str, Any]],
             step: _storage.Location) -> dict[str, Reused]:
        """Reads what `source`'s commit records; makes no leaf whole from it. Never raises
        an Exception: a step that cannot be used leaves every chunk written, with a
        warning saying why."""
        try:
            self._crcs, self._versions = self._recorded()
        except Exception as e:  # written whole, as every other process may go on to do: never left waiting
            log.warning("%s cannot be made from (%s): every chunk of this save is written (unchanged_since)",
                        self._source.url, e)
        return {}

    def _recorded(self) -> tuple[dict[str, int], dict[str, str]]:
        """The CRC-32C and version `source`'s commit records of each chunk, by key;
        ValueError saying why there are none to use."""
        group = _commit.read_group(self._source)
        if _commit.state(self._source, group) is not _commit.State.COMMITTED:
            raise ValueError("it is not a committed step")
        assert group is not None
        crcs, versions = _vouched.parse(group.meta), _vouched.parse_versions(group.meta)
        if not versions:
            raise ValueError("its commit records no chunk's checksum and version (saved with checksums=False, or "
                             "before commits recorded versions)")
        return _vouched.by_key(crcs), _vouched.by_key(versions)

    def write_chunk(self, loc: _storage.Location, key: str, parts: Sequence[Any], crc: int | None
                    ) -> tuple[str | None, bool]:
        nbytes = sum(memoryview(part).nbytes for part in parts)
        version = self._versions.get(key)
        if crc is None or version is None or self._crcs.get(key) != crc or size_of(version) != nbytes:
            return loc.write_new(key, *parts), True
        try:
            made = loc.copy_new(key, self._source, nbytes=nbytes, expect=version)
        except (SourceChanged, FileNotFoundError):  # changed or deleted since its commit: the bytes are in hand
            return loc.write_new(key, *parts), True
        with self._lock:
            self._made_bytes += nbytes
        return made, False

    def committed(self, save_id: str | None, made: Mapping[str, str | None], crcs: Mapping[str, int]) -> None:
        if self._made_bytes and _multihost.process_index() == 0:
            log.info("%s of chunks unchanged, made from %s, not written (unchanged_since; process 0's part)",
                     _progress.size(self._made_bytes), self._source.url)
