"""The commit marker: reading it, writing it last, and removing checkpoints marker-first.

A checkpoint is committed exactly when its group metadata holds the attribute
`write_completed: true`. That metadata is one object (`zarr.json`, or `.zattrs` in
seqax's zarr v2 layout), and writing one object is atomic on local disks
(`Location.write(atomic=True)` writes a temporary file and renames it over), S3 and
GCS (a PUT is all or nothing) alike, so no reader can see a half-committed
checkpoint and no rename of the checkpoint is needed.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import re
from typing import Any

from . import _chunks, _naming, _zarrjson
from ._storage import Location
from .errors import CheckpointExistsError

log = logging.getLogger("zarrckpt")

GROUP_METADATA_FILES = ("zarr.json", ".zattrs", ".zgroup")  # v3, then seqax's v2 layout


class State(enum.Enum):
    ABSENT = "absent"
    UNCOMMITTED = "uncommitted"
    COMMITTED = "committed"


@dataclasses.dataclass(frozen=True)
class Group:
    """A checkpoint group's metadata as stored: zarr format, attributes, whole document."""

    zarr_format: int
    attributes: dict[str, Any]
    document: dict[str, Any]  # the v3 `zarr.json`; empty for seqax's v2 layout


def read_group(loc: Location) -> Group | None:
    """The group metadata at `loc`, read straight from its one metadata file, or None.

    One small read for zarrckpt's layout (listing steps calls this per candidate);
    only where `zarr.json` is absent are seqax's two v2 files asked for, together.
    A document that is not JSON reads as a group without attributes (uncommitted).
    """
    try:
        doc = _json_object(loc.read("zarr.json"))
    except FileNotFoundError:
        zattrs, zgroup = loc.read_if_present([".zattrs", ".zgroup"])
        if zattrs is not None:
            return Group(2, _json_object(zattrs), {})
        return Group(2, {}, {}) if zgroup is not None else None
    attributes = doc.get("attributes")
    return Group(3, attributes if isinstance(attributes, dict) else {}, doc)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested past what json parses
        return {}
    return doc if isinstance(doc, dict) else {}


def state_of(group: Group | None) -> State:
    if group is None:
        return State.ABSENT
    return State.COMMITTED if group.attributes.get(_naming.COMMIT_ATTR) is True else State.UNCOMMITTED


def state(loc: Location) -> State:
    """Whether `loc` holds a committed checkpoint; warns about damaged commit metadata,
    which counts as not committed (so choosing the newest step skips it)."""
    group = read_group(loc)
    if group is not None and group.zarr_format == 3 and not group.document:
        log.warning("%s/zarr.json is not a JSON object: treated as not committed", loc.url)
    elif group is not None and group.attributes.get(_naming.COMMIT_ATTR, True) is not True:
        log.warning("%s has %s = %r, not true: treated as not committed", loc.url, _naming.COMMIT_ATTR,
                    group.attributes[_naming.COMMIT_ATTR])
    return state_of(group)


def commit(loc: Location, group_document: dict[str, Any]) -> None:
    """Writes the group's final `zarr.json`: consolidated metadata and the commit marker.

    The document already describes every array, so opening a committed checkpoint
    costs one read whatever its leaf count.
    """
    attributes = {**group_document["attributes"], _naming.COMMIT_ATTR: True}
    loc.write("zarr.json", _zarrjson.encode_document({**group_document, "attributes": attributes}), atomic=True)


def remove(loc: Location) -> None:
    """Deletes a checkpoint, its commit marker first.

    An interrupted deletion therefore leaves an uncommitted directory, never one
    that looks committed but is missing data.
    """
    for name in GROUP_METADATA_FILES:
        loc.remove_file(name)
    loc.remove_tree()


# Every object a checkpoint (ours or seqax's) can hold, and the temporary files of an
# interrupted atomic write: anything else at a URL means it is not a checkpoint.
_CHECKPOINT_OBJECT = re.compile(
    r"(zarr\.json|\.zattrs|\.zgroup|\.zmetadata|PINNED)(\.[0-9a-f]{32}\.tmp)?"
    r"|[^/]+/((zarr\.json|\.zarray|\.zattrs)(\.[0-9a-f]{32}\.tmp)?"
    rf"|{_chunks.NAME.pattern}"  # zarrckpt's chunks
    r"|c(/\d+)+|\d+(\.\d+)*)")  # zarr's other chunk key encodings: seqax's and other writers' arrays


def remove_leftover(loc: Location) -> None:
    """Removes what an interrupted save or deletion left at `loc`, marker first.

    Refuses, with CheckpointExistsError, when `loc` holds anything a checkpoint would
    not: a mistyped URL must never cost someone their files.
    """
    foreign = sorted(key for key in loc.sizes(recursive=True) if not _CHECKPOINT_OBJECT.fullmatch(key))
    if foreign:
        raise CheckpointExistsError(
            f"{loc.url} is not empty and not a checkpoint (it holds {', '.join(map(repr, foreign[:3]))}"
            f"{', ...' if len(foreign) > 3 else ''}); refusing to delete it: save somewhere else")
    remove(loc)


def make_way(loc: Location, *, overwrite: bool) -> None:
    """Clears `loc` for a new checkpoint: a committed one is replaced only with
    `overwrite`; leftovers of a save, copy or deletion cut short are removed; anything
    that is not a checkpoint is refused (see `remove_leftover`)."""
    if state(loc) is State.COMMITTED:
        if not overwrite:
            raise CheckpointExistsError(
                f"{loc.url} already holds a committed checkpoint; pass overwrite=True to replace it")
        remove(loc)
    elif loc.exists():
        remove_leftover(loc)
