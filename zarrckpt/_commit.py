"""The commit marker: reading it, writing it last, and removing checkpoints marker-first.

A checkpoint is committed exactly when its group metadata holds the attribute
`write_completed: true`. That metadata is one object (`zarr.json`, or `.zattrs` in
seqax's zarr v2 layout), and writing one object is atomic on local disks
(`Location.write(atomic=True)` writes a temporary file and renames it over), S3 and
GCS (a PUT is all or nothing) alike, so no reader can see a half-committed
checkpoint and no rename of the checkpoint is needed.

Where a store may apply a request after zarrckpt abandoned it (S3, GCS), nothing a
request lands late may change a save: there every object is created only if absent,
the commit too, and a save writes no uncommitted group metadata before it (see
`write_marker`): the step reads as absent until it commits.

Every save also gets an identity, `save_id` (random), written into the group metadata
before any chunk (at the commit, on S3 and GCS). A reader that notes it when it opens
a checkpoint and finds it unchanged after its last read has read one save, not parts
of two. zarrckpt writes the
commit marker and the identity at the start of `zarr.json`, so `head` learns both
from its first bytes, however large the document (about 7 MB at 10,000 leaves).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import re
import uuid
from typing import Any

from . import _seqax
from ._format import naming as _naming, zarrjson as _zarrjson
from ._storage import GROUP_BYTES, Location, NotAFileInCheckpoint, TooLarge
from .errors import CheckpointWriteError

log = logging.getLogger("zarrckpt")

GROUP_METADATA_FILES = ("zarr.json", _seqax.MARKER, _seqax.GROUP)  # v3, then seqax's v2 layout
SAVE_ID = "save_id"  # in the `zarrckpt` attribute, first
_HEAD_BYTES = 512
_HEAD = re.compile(rb'\{"zarr_format":3,"node_type":"group","attributes":\{("write_completed":true,)?'
                   rb'"zarrckpt":\{"save_id":"([0-9a-f]{32})"')


class State(enum.Enum):
    ABSENT = "absent"
    UNCOMMITTED = "uncommitted"
    COMMITTED = "committed"


@dataclasses.dataclass(frozen=True)
class Group:
    """A checkpoint group's metadata as stored: zarr format, attributes, whole document,
    and what is wrong with it when it cannot be understood (then it has no attributes)."""

    zarr_format: int
    attributes: dict[str, Any]
    document: dict[str, Any]  # the v3 `zarr.json`; empty for seqax's v2 layout
    problem: str | None = None

    @property
    def state(self) -> State:
        return State.COMMITTED if self.attributes.get(_naming.COMMIT_ATTR) is True else State.UNCOMMITTED

    @property
    def meta(self) -> dict[str, Any]:
        """zarrckpt's attribute (format version, tree, metrics...), or {} where there is
        none that is a JSON object."""
        meta = self.attributes.get(_naming.META_ATTR)
        return meta if isinstance(meta, dict) else {}

    @property
    def save_id(self) -> str | None:
        value = self.meta.get(SAVE_ID)
        return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True)
class Head:
    """Whether a checkpoint is there and committed, and the identity of its save (None
    for seqax's layout and checkpoints written before identities)."""

    state: State
    save_id: str | None


def new_save_id() -> str:
    return uuid.uuid4().hex


def read_group(loc: Location) -> Group | None:
    """The group metadata at `loc`, read straight from its one metadata file, or None.

    One read for zarrckpt's layout; only where `zarr.json` is absent are seqax's two
    v2 files asked for, together. A document that cannot be understood (not JSON, a
    directory, a symbolic link or a FIFO, larger than GROUP_BYTES: never read whole)
    reads as a group without attributes, and says why in `problem`.
    """
    try:
        return _v3_group(loc.read("zarr.json", cap=GROUP_BYTES))
    except FileNotFoundError:
        return _v2_group(loc)
    except IsADirectoryError:
        return Group(3, {}, {}, "is a directory")
    except (NotAFileInCheckpoint, TooLarge) as e:
        return Group(3, {}, {}, f"cannot be read: {e}")  # the error names the link: the step's own, maybe


def _v2_group(loc: Location) -> Group | None:
    """The group metadata at `loc` where `zarr.json` is absent: seqax's two v2 files,
    asked for together; None where neither is there."""
    try:
        attributes, there = _seqax.read_group(loc)
    except TooLarge as e:
        return Group(2, {}, {}, f"cannot be read: {e}")
    if attributes is not None:
        return parse_group(_seqax.MARKER, attributes)
    return Group(2, {}, {}) if there else None


def parse_group(key: str, raw: bytes) -> Group:
    """The group metadata in the object `key` (`zarr.json`, or seqax's `.zattrs`), read as `raw`."""
    if key == "zarr.json":
        return _v3_group(raw)
    attributes = _zarrjson.object_or_none(raw)
    return Group(2, attributes or {}, {}, None if attributes is not None else "is not a JSON object")


def _v3_group(raw: bytes) -> Group:
    doc = _zarrjson.object_or_none(raw)
    if doc is None:
        return Group(3, {}, {}, "is not a JSON object")
    attributes = doc.get("attributes")
    return Group(3, attributes if isinstance(attributes, dict) else {}, doc)


def someone_elses(group: Group | None) -> bool:
    """Whether `group` is readable group metadata that no checkpoint has: uncommitted and
    without zarrckpt's attribute (a zarr group made by zarr-python, say)."""
    return group is not None and group.problem is None and group.state is State.UNCOMMITTED and not group.meta


def head(loc: Location) -> Head:
    """Whether `loc` holds a committed checkpoint, and its save identity: from the first
    bytes of `zarr.json` where zarrckpt wrote it, else from the whole group metadata.
    Warns (once per checkpoint) about group metadata that cannot be understood or whose
    marker is not `true`, which count as not committed, so that choosing the newest
    step skips them."""
    try:
        raw = loc.read("zarr.json", limit=_HEAD_BYTES)
    except FileNotFoundError:  # not read again: seqax's files, where there are any
        group = _v2_group(loc)
        return Head(state(loc, group), None if group is None else group.save_id)
    except (IsADirectoryError, NotAFileInCheckpoint):
        raw = None
    if raw is not None and (found := _HEAD.match(raw)):
        return Head(State.COMMITTED if found.group(1) else State.UNCOMMITTED, found.group(2).decode())
    group = _v3_group(raw) if raw is not None and len(raw) < _HEAD_BYTES else read_group(loc)
    return Head(state(loc, group), None if group is None else group.save_id)


def state(loc: Location, group: Group | None) -> State:
    """The state of the checkpoint at `loc` whose group metadata is `group`; warns (once
    per checkpoint) when that metadata is damaged or its marker is not `true`."""
    if group is None:
        return State.ABSENT
    if group.problem is not None:
        warn_once(f"{loc.url}/{GROUP_METADATA_FILES[0 if group.zarr_format == 3 else 1]} {group.problem}: "
                   "treated as not committed")
    elif group.attributes.get(_naming.COMMIT_ATTR, True) is not True:
        warn_once(f"{loc.url} has {_naming.COMMIT_ATTR} = {group.attributes[_naming.COMMIT_ATTR]!r}, not true: "
                   "treated as not committed")
    return group.state


@functools.lru_cache(maxsize=1024)
def warn_once(message: str) -> None:
    """Logs a warning about something found in storage once per process: an evaluator
    polls every few seconds, and wants one warning per damaged step, not one per poll."""
    log.warning("%s", message)


def commit(loc: Location, group_document: dict[str, Any]) -> None:
    """Writes the group's final `zarr.json`, durably: consolidated metadata and the
    commit marker, first in its attributes (see `head`).

    The document already describes every array, so opening a committed checkpoint
    costs one read whatever its leaf count. CheckpointWriteError, with nothing written,
    where it is larger than a reader reads of a group's metadata (`GROUP_BYTES`).
    """
    attributes = {_naming.COMMIT_ATTR: True, **group_document["attributes"]}
    encoded = _zarrjson.encode_document({**group_document, "attributes": attributes})
    if len(encoded) > GROUP_BYTES:
        raise CheckpointWriteError(
            f"{loc.url}: its metadata would be {len(encoded):,} bytes, more than the {GROUP_BYTES:,} that zarrckpt "
            "reads of a checkpoint's metadata; not committed. Save fewer, larger leaves (stack a model's layers "
            "into one array each)")
    if not loc.late_safe:
        # Where the save wrote its uncommitted document first, it must still be there: the
        # step deleted meanwhile (`zarrckpt gc` or another writer taking it for a
        # leftover) would otherwise read as committed with its chunks gone.
        found, ours = head(loc), attributes.get(_naming.META_ATTR, {}).get(SAVE_ID)
        if found.state is not State.UNCOMMITTED or found.save_id != ours:
            raise CheckpointWriteError(f"{loc.url} was deleted or replaced by someone else while it was being "
                                       "saved (zarrckpt gc, or another writer taking it for a leftover); not "
                                       "committing it")
    write_marker(loc.unversioned(), "zarr.json", encoded)


def write_marker(loc: Location, key: str, document: bytes) -> None:
    """Writes `document`, the committed group metadata, at `key`, so that whatever the
    store does late, the save is committed exactly when this returns: raises if it is
    not.

    On a local disk and memory:// that is one atomic write over the uncommitted
    document. Where a request may land after it was abandoned (`Location.late_safe`: S3, GCS),
    no uncommitted document was written (see `SaveJob`), and the committed one is
    created only if absent; a commit whose requests failed is settled by creating an
    abandoned (uncommitted) `zarr.json` in its place, only if absent. Whichever is
    created first stands and the other fails on arrival: if the commit stands, it
    landed after all, and the save has committed. No request of the commit is a
    delete, which could land late on the commit itself."""
    if not loc.late_safe:
        loc.write(key, document, atomic=True, durable=True)
        return
    try:
        loc.write_new(key, document)
    except Exception:
        if key != "zarr.json":
            raise  # seqax's layout (a copy of one): nothing is settled
        try:
            loc.create(key, _abandoned(document))
        except FileExistsError:
            if loc.holds(key, document):
                log.warning("the commit of %s landed after its request had failed: it is committed", loc.url)
                return
        except Exception:  # the store still fails: the outcome is unknown, and said so
            log.warning("%s: the commit's request failed, and so did making sure it never lands late; if it does, "
                        "the checkpoint (whole: every chunk was written) will read as committed", loc.url)
        raise


def _abandoned(document: bytes) -> bytes:
    """The uncommitted group metadata of the save whose committed metadata is `document`:
    its identity, marked abandoned (`head` reads it as uncommitted)."""
    save_id = parse_group("zarr.json", document).save_id
    return _zarrjson.encode_document({"zarr_format": 3, "node_type": "group", "attributes": {
        _naming.META_ATTR: {SAVE_ID: save_id, "abandoned": True}}})


def remove(loc: Location) -> None:
    """Deletes a checkpoint, its commit marker first.

    An interrupted deletion therefore leaves an uncommitted directory, never one
    that looks committed but is missing data.
    """
    for name in GROUP_METADATA_FILES:
        loc.remove_file(name)
    loc.remove_tree()
