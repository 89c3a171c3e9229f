"""What a commit vouches for (docs/pytree-zarr-checkpoint.md, "What the commit
records"): the CRC-32C of every chunk the save made, written into the group metadata
the commit writes, under `chunks_crc32c`, by array name and chunk name, and the
version of each such chunk as the store answered the request that made it, under
`chunks_version`. A chunk that another writer put in the step (a job that took the run
over while this one was paused, `cp` of another chunk over a chunk linked into later
steps, a rewrite in place) carries its own valid checksum, but not the one recorded:
every zarrckpt read and `verify` compares the two, and such a chunk is damage, never
values. A later save makes a chunk of the same bytes from one recorded so, and only
from the version recorded (`save_checkpoint`'s `unchanged_since`).

Only chunks with a checksum (the default, `checksums=True`) are recorded: their
CRC-32C is the last four bytes of the chunk, so recording and checking it cost no pass
over the data. The one place that knows the record's layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

KEY = "chunks_crc32c"  # under zarrckpt's attribute of the group
VERSIONS_KEY = "chunks_version"
_MAX_CRC = 2**32
_MAX_VERSION_CHARS = 256
Record = dict[str, dict[str, int]]  # each chunk's CRC-32C, by array name and chunk name
Versions = dict[str, dict[str, str]]  # each chunk's version (`_storage.Entry.version`), by the same names
_T = TypeVar("_T")


def grouped(by_chunk_key: Mapping[str, _T]) -> dict[str, dict[str, _T]]:
    """The record of the chunks whose values `by_chunk_key` holds (by chunk key:
    "<array>/<chunk name>")."""
    found: dict[str, dict[str, _T]] = {}
    for key, value in by_chunk_key.items():
        array, _, chunk = key.rpartition("/")
        found.setdefault(array, {})[chunk] = value
    return found


def by_key(record: Mapping[str, Mapping[str, _T]]) -> dict[str, _T]:
    """What `record` holds, by chunk key (as `grouped` takes them)."""
    return {f"{array}/{chunk}": value for array, chunks in record.items() for chunk, value in chunks.items()}


def recorded(record: Record, key: str) -> int | None:
    """The CRC-32C `record` holds of the chunk `key` ("<array>/<chunk name>"), or None."""
    array, _, chunk = key.rpartition("/")
    return record.get(array, {}).get(chunk)


def report(crcs: Mapping[str, int], versions: Mapping[str, str | None]) -> dict[str, Any]:
    """What one process tells the commit of the chunks it made: their CRC-32C (`crcs`,
    by chunk key) and, of those, the versions the store said (`versions`)."""
    return {KEY: grouped(crcs),
            VERSIONS_KEY: grouped({key: version for key in crcs if (version := versions.get(key)) is not None})}


def attributes(reports: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """What the commit records of every process's `report`: each key with any chunk."""
    found: dict[str, dict[str, dict[str, Any]]] = {KEY: {}, VERSIONS_KEY: {}}
    for one in reports:
        for name, merged in found.items():
            for array, chunks in one.get(name, {}).items():
                merged.setdefault(array, {}).update(chunks)
    return {name: merged for name, merged in found.items() if merged}


def parse(meta: Mapping[str, Any]) -> Record:
    """The CRC-32C record in zarrckpt's attribute `meta` of a group ({} where it has none:
    a checkpoint saved before the record, or with `checksums=False`); ValueError saying
    what is wrong with it (a store may hold anything)."""
    return _parsed(meta, KEY, lambda crc: isinstance(crc, int) and not isinstance(crc, bool) and 0 <= crc < _MAX_CRC,
                   "CRC-32C values")


def parse_versions(meta: Mapping[str, Any]) -> Versions:
    """The record of versions in zarrckpt's attribute `meta` of a group ({} where it has
    none: a checkpoint saved before it); ValueError saying what is wrong with it."""
    return _parsed(meta, VERSIONS_KEY, lambda v: isinstance(v, str) and 0 < len(v) <= _MAX_VERSION_CHARS
                   and v.isascii() and v.isprintable(), "versions")


def _parsed(meta: Mapping[str, Any], key: str, valid: Any, what: str) -> Any:
    found = meta.get(key, {})
    if not isinstance(found, dict):
        raise ValueError(f"{key} is not a mapping of arrays")
    for array, chunks in found.items():
        if not isinstance(chunks, dict) or not all(map(valid, chunks.values())):
            raise ValueError(f"{key} of array {array!r:.200} is not a mapping of chunks to {what}")
    return found
