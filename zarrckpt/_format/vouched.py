"""What a commit vouches for (docs/pytree-zarr-checkpoint.md, "What the commit
records"): the CRC-32C of every chunk the save made, written into the group metadata
the commit writes, under `chunks_crc32c`, by array name and chunk name. A chunk that
another writer put in the step (a job that took the run over while this one was
paused, `cp` of another chunk over a chunk linked into later steps, a rewrite in place)
carries its own valid checksum, but not the one recorded: every zarrckpt read and
`verify` compares the two, and such a chunk is damage, never values.

Only chunks with a checksum (the default, `checksums=True`) are recorded: their
CRC-32C is the last four bytes of the chunk, so recording and checking it cost no pass
over the data. The one place that knows the record's layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

KEY = "chunks_crc32c"  # under zarrckpt's attribute of the group
_MAX_CRC = 2**32
Record = dict[str, dict[str, int]]  # each chunk's CRC-32C, by array name and chunk name


def grouped(crcs: Mapping[str, int]) -> Record:
    """The record of the chunks whose CRC-32C `crcs` holds (by chunk key:
    "<array>/<chunk name>")."""
    found: Record = {}
    for key, crc in crcs.items():
        array, _, chunk = key.rpartition("/")
        found.setdefault(array, {})[chunk] = crc
    return found


def by_key(record: Record) -> dict[str, int]:
    """The CRC-32C `record` holds, by chunk key (as `grouped` takes them)."""
    return {f"{array}/{chunk}": crc for array, chunks in record.items() for chunk, crc in chunks.items()}


def recorded(record: Record, key: str) -> int | None:
    """The CRC-32C `record` holds of the chunk `key` ("<array>/<chunk name>"), or None."""
    array, _, chunk = key.rpartition("/")
    return record.get(array, {}).get(chunk)


def merged(records: Iterable[Mapping[str, Mapping[str, int]]]) -> Record:
    """One record of the chunks that `records` (each process's, see `grouped`) hold."""
    found: Record = {}
    for record in records:
        for array, chunks in record.items():
            found.setdefault(array, {}).update(chunks)
    return found


def parse(meta: Mapping[str, Any]) -> Record:
    """The record in zarrckpt's attribute `meta` of a group ({} where it has none: a
    checkpoint saved before the record, or with `checksums=False`); ValueError saying
    what is wrong with it (a store may hold anything)."""
    found = meta.get(KEY, {})
    if not isinstance(found, dict):
        raise ValueError(f"{KEY} is not a mapping of arrays")
    for array, chunks in found.items():
        if not isinstance(chunks, dict) or not all(
                isinstance(crc, int) and not isinstance(crc, bool) and 0 <= crc < _MAX_CRC for crc in chunks.values()):
            raise ValueError(f"{KEY} of array {array!r:.200} is not a mapping of chunks to CRC-32C values")
    return found
