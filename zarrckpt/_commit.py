"""The commit marker: reading it, writing it last, and removing checkpoints marker-first.

A checkpoint is committed exactly when its group metadata holds the attribute
`write_completed: true`. That metadata is one object (`zarr.json`, or `.zattrs` in
seqax's zarr v2 layout), and writing one object is atomic on local disks (zarr's
LocalStore writes to a temporary file and renames it), S3 and GCS alike, so no
reader can see a half-committed checkpoint and no rename is needed.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from . import _naming, _zarrjson
from ._storage import Location

GROUP_METADATA_FILES = ("zarr.json", ".zattrs", ".zgroup")  # v3, then seqax's v2 layout


class State(enum.Enum):
    ABSENT = "absent"
    UNCOMMITTED = "uncommitted"
    COMMITTED = "committed"


def read_attributes(loc: Location) -> tuple[int, dict[str, Any]] | None:
    """(zarr format, group attributes) read straight from the metadata file, or None.

    One small read, without zarr's machinery: listing steps calls this per candidate.
    """
    for name in ("zarr.json", ".zattrs"):
        try:
            raw = loc.fs.cat_file(f"{loc.path}/{name}")
        except FileNotFoundError:
            continue
        try:
            doc = json.loads(raw)
        except ValueError:
            return (3 if name == "zarr.json" else 2), {}
        if name == "zarr.json":
            return 3, (doc.get("attributes") or {}) if isinstance(doc, dict) else {}
        return 2, doc if isinstance(doc, dict) else {}
    if loc.fs.exists(f"{loc.path}/.zgroup"):
        return 2, {}
    return None


def state_of(attributes: tuple[int, dict[str, Any]] | None) -> State:
    if attributes is None:
        return State.ABSENT
    return State.COMMITTED if attributes[1].get(_naming.COMMIT_ATTR) is True else State.UNCOMMITTED


def state(loc: Location) -> State:
    return state_of(read_attributes(loc))


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
