"""A chunk a save writes that a committed step holds byte for byte is made from that
step's chunk (`Location.copy_new`: a hard link on a local disk, a copy inside S3 or
GCS) instead of written. Its CRC-32C and size are the ones the step's commit records
for the chunk of the same name (see `_format.vouched`), which most changed chunks fail
at no cost; one that passes is compared byte for byte, since a 32-bit checksum alone
would take one changed chunk in 2**32 for unchanged. It is made only from the version
of that chunk the step became known with. On S3 and GCS that version is the store's
own (an ETag, a generation), checked in the copy's own request, so the step's chunk is
read and compared before it is copied: a chunk rewritten or deleted since, even
between the read and the copy, is another version, or none, and its bytes, in hand,
are written instead. Elsewhere a version (a file's modification time and size) is what
any program may set, so the chunk made (a link) is the one read and compared, and
written over with the bytes in hand where it is not them.

`SameChunks` is the decision; `SameChunksSince` is `save_checkpoint`'s `unchanged_since`,
which knows the step from its commit's record alone. A manager's `ReuseUnchanged`
(`lineage`) asks the same of every chunk it writes, against the step it knows.
"""

from __future__ import annotations

import dataclasses
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
from ..errors import CheckpointError

log = logging.getLogger("zarrckpt")


@dataclasses.dataclass
class SameChunks:
    """The chunks of the committed step `source` as a save may make its own from them:
    each one's CRC-32C (`crcs`) and version (`versions`), by key. With no `source`,
    every chunk is written."""

    source: _storage.Location | None
    crcs: Mapping[str, int]
    versions: Mapping[str, str | None]
    made_bytes: int = 0  # of this process's chunks, made from `source`
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def write_chunk(self, loc: _storage.Location, key: str, parts: Sequence[Any], crc: int | None
                    ) -> tuple[str | None, bool]:
        """`Reuse.write_chunk`: the chunk `key` of the save at `loc`, whose bytes are
        `parts` (CRC-32C `crc`), made from `source` where that step holds the very same
        chunk, else written."""
        nbytes = sum(memoryview(part).nbytes for part in parts)
        version = self.versions.get(key)
        source = self.source
        if (source is None or crc is None or version is None or self.crcs.get(key) != crc
                or size_of(version) != nbytes):
            return loc.write_new(key, *parts), True
        # On S3 and GCS a version (an ETag, a generation) is the store's own, checked in the
        # copy's request: the source compared is the one copied. Elsewhere a version (a
        # file's modification time) is what any program may set, so the chunk made is the
        # one compared, and written over where it is not these bytes.
        if loc.late_safe and not _holds(source, key, parts):
            return loc.write_new(key, *parts), True
        try:
            made = loc.copy_new(key, source, nbytes=nbytes, expect=version)
        except (SourceChanged, FileNotFoundError):  # changed or deleted since: the bytes are in hand
            return loc.write_new(key, *parts), True
        if not loc.late_safe and not _holds(loc, key, parts):
            return loc.write_new(key, *parts), True
        with self._lock:
            self.made_bytes += nbytes
        return made, False

    def say(self, option: str) -> None:
        """Logs, on process 0, what was made from `source` (nothing where nothing was)."""
        if self.made_bytes and self.source is not None and _multihost.process_index() == 0:
            log.info("%s of chunks unchanged, made from %s, not written (%s; process 0's part)",
                     _progress.size(self.made_bytes), self.source.url, option)


NOTHING_SAME = SameChunks(None, {}, {})


def _holds(loc: _storage.Location, key: str, parts: Sequence[Any]) -> bool:
    """`Location.holds`, False too where the object cannot be read (not a file, the store
    failing): the chunk is then written, never made from it."""
    try:
        return loc.holds(key, *parts)
    except (OSError, CheckpointError):
        return False


class SameChunksSince(NoReuse):
    """`save_checkpoint`'s `Reuse` (see `_save.collaborators`; `unchanged_since`): each
    chunk written that the committed step `source` holds byte for byte, as its commit
    records, is made from it. Only the commit's record is used, never what this process
    saved or restored before: the step may come from another process or an earlier
    run. No leaf is made whole from it: every leaf is copied off its devices and
    checksummed as without the option."""

    def __init__(self, source: _storage.Location) -> None:
        self._source = source
        self._same = NOTHING_SAME

    def plan(self, plans: Sequence[ArrayPlan], documents: Mapping[str, dict[str, Any]],
             step: _storage.Location) -> dict[str, Reused]:
        """Reads what `source`'s commit records. Never raises an Exception: a step that
        cannot be used leaves every chunk written, with a warning saying why."""
        try:
            crcs, versions = self._recorded()
        except Exception as e:  # written whole, as every other process may go on to do: never left waiting
            log.warning("%s cannot be made from (%s): every chunk of this save is written (unchanged_since)",
                        self._source.url, e)
        else:
            self._same = SameChunks(self._source, crcs, versions)
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
        return self._same.write_chunk(loc, key, parts, crc)

    def committed(self, save_id: str | None, made: Mapping[str, str | None], crcs: Mapping[str, int]) -> None:
        self._same.say("unchanged_since")
