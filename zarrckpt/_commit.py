"""The commit marker: reading it, writing it last, and removing checkpoints marker-first.

A checkpoint is committed exactly when its group metadata holds the attribute
`write_completed: true`. That metadata is one object (`zarr.json`, or `.zattrs` in
seqax's zarr v2 layout), and writing one object is atomic on local disks (zarr's
LocalStore writes to a temporary file and renames it), S3 and GCS alike, so no
reader can see a half-committed checkpoint and no rename is needed.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Group:
    """A checkpoint group's metadata as stored: zarr format, attributes, whole document."""

    zarr_format: int
    attributes: dict[str, Any]
    document: dict[str, Any]  # the v3 `zarr.json`; empty for seqax's v2 layout


def read_group(loc: Location) -> Group | None:
    """The group metadata at `loc`, read straight from its one metadata file, or None.

    One small read, without zarr's machinery: listing steps calls this per candidate.
    A document that is not JSON reads as a group without attributes (uncommitted).
    """
    for name in ("zarr.json", ".zattrs"):
        try:
            raw = loc.fs.cat_file(f"{loc.path}/{name}")
        except FileNotFoundError:
            continue
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = {}
        doc = doc if isinstance(doc, dict) else {}
        if name == "zarr.json":
            attributes = doc.get("attributes")
            return Group(3, attributes if isinstance(attributes, dict) else {}, doc)
        return Group(2, doc, {})
    if loc.fs.exists(f"{loc.path}/.zgroup"):
        return Group(2, {}, {})
    return None


def state_of(group: Group | None) -> State:
    if group is None:
        return State.ABSENT
    return State.COMMITTED if group.attributes.get(_naming.COMMIT_ATTR) is True else State.UNCOMMITTED


def state(loc: Location) -> State:
    return state_of(read_group(loc))


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
