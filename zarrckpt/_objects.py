"""What a checkpoint owns: the objects its metadata records, and nothing else.

`copy_checkpoint` copies exactly these, and a save or copy that replaces a checkpoint
(`overwrite`) deletes exactly these: a place that holds anything else (a run directory
with its steps and notes, someone's files) is refused, naming what is there, so that a
mistyped URL never costs anyone their files. Leftovers of a save, copy or deletion cut
short (uncommitted, so without metadata to trust) are judged by their group metadata,
which must be zarrckpt's where there is any (see `_not_a_leftover`: someone's zarr
group is never one), and by their names (`not_ours`). A symbolic link is deleted
itself, never followed (see `_storage.local`).

What a checkpoint holds is learnt from a listing, each key judged by the metadata
(`inventory`), never by generating every key the metadata declares: metadata that
declares a huge grid costs nothing beyond what is stored.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import re

from . import _commit, _seqax
from ._format import chunks as _chunks, naming as _naming, safetensors as _safetensors
from ._restore import checkpoint as _reader
from ._storage import Entry, Location
from ._util import concurrency as _concurrency
from ._util.regions import first_absent, indices
from .errors import CheckpointError, CheckpointExistsError

# Every object a checkpoint (ours or seqax's) can hold, and the temporary files of an
# interrupted atomic write: anything else at a URL means it is not a checkpoint.
_TEMPORARY = r"(\.[0-9a-f]{32}\.tmp)?"
_CHECKPOINT_OBJECT = re.compile(
    rf"((zarr\.json|PINNED|[^/]+/zarr\.json|{_seqax.OBJECT_NAMES}){_TEMPORARY})"
    rf"|[^/]+/{_chunks.NAME.pattern}")
# What a leftover of zarrckpt's own layout holds without its group metadata (a deletion
# or, on S3 and GCS, a save or copy cut short), and of seqax's: zarr v2 keys, which
# folders of numbered files have too (see `not_ours`).
_LEFTOVER_OBJECT = re.compile(rf"((zarr\.json|PINNED|[^/]+/zarr\.json){_TEMPORARY})|[^/]+/{_chunks.NAME.pattern}")
_SEQAX_LEFTOVER_OBJECT = re.compile(rf"({_seqax.OBJECT_NAMES}){_TEMPORARY}")
# Beside what a committed checkpoint records: its pin, and temporary files of atomic writes.
_BESIDE_RECORDED = re.compile(r"PINNED|.*\.[0-9a-f]{32}\.tmp")
# The directories a leftover may hold empty (on a local disk, what a deletion cut short
# leaves of an array's): an array's, and seqax's chunk directories; only beside files of
# a checkpoint's, or in a run's step (see `not_ours`).
_LEFTOVER_DIRECTORY = re.compile(r"[^/]+")
_SEQAX_LEFTOVER_DIRECTORY = re.compile(r"[^/]+(/c)?(/\d+)*")


@dataclasses.dataclass(frozen=True)
class Owned:
    """One object of a checkpoint: its key, about how large it is (the most for zarrckpt's
    chunks, the decoded size for seqax's, 0 for small metadata), and for a chunk of
    zarrckpt's layout, the codec that checks its size and checksum."""

    key: str
    nbytes: int = 0
    codec: _chunks.ChunkCodec | None = None


@dataclasses.dataclass(frozen=True)
class Inventory:
    """What a listing of a checkpoint found, each key judged by the metadata: the objects
    it records (`owned`, its group metadata last) and what it does not (`foreign`); how
    many recorded objects the listing lacks (`missing`), and the first few of their
    keys (`some_missing`)."""

    owned: list[Owned]
    foreign: list[str]
    missing: int
    some_missing: list[str]


def inventory(ckpt: _reader.Checkpoint, listed: list[Entry] | None = None) -> Inventory:
    """`ckpt`'s objects as one listing of its location (`listed`, if made already) finds
    them. Work and memory follow what is stored, never what the metadata declares: a
    grid of millions of chunks costs nothing unless they are there. Raises
    CheckpointCorruptError (or MissingObject) if metadata it needs is damaged."""
    judge = _Judge(ckpt)
    owned, foreign = [], []
    for entry in ckpt.loc.walk() if listed is None else listed:
        found = judge.owned(entry.name)
        if found is None:
            foreign.append(entry.name)
        else:
            owned.append(found)
    missing, some = judge.missing({o.key for o in owned})
    last = {"zarr.json", _seqax.MARKER}
    owned.sort(key=lambda o: o.key in last)  # stable: the group metadata last
    return Inventory(owned, foreign, missing, some)


_SHOWN = 3  # missing keys named


class _Judge:
    """Which object a key is in a checkpoint, parsed from the key: arrays are looked up
    by name, chunk coordinates checked against their grids (which `open_checkpoint` has
    checked against `_format.chunks.MAX_GRID`); the chunks found are counted per array."""

    def __init__(self, ckpt: _reader.Checkpoint) -> None:
        self.ckpt = ckpt
        self.seqax = ckpt.layout == _seqax.LAYOUT
        leaves = list(ckpt.leaves.values())
        self.arrays = {leaf.codec.array: leaf for leaf in leaves if leaf.processes is None}
        self.per_process = {leaf.name: leaf for leaf in leaves if leaf.processes is not None}
        self.own: dict[str, _reader.StoredLeaf] = {}  # per-process arrays, as first met
        self.found: collections.defaultdict[str, set[tuple[int, ...]]] = collections.defaultdict(set)  # per array

    def owned(self, key: str) -> Owned | None:
        """The object `key` is, or None if the metadata records no such object."""
        if key in ((_seqax.GROUP, _seqax.MARKER) if self.seqax else ("zarr.json",)):
            return Owned(key)
        name, _, rest = key.partition("/")
        leaf = self._array(name)
        if leaf is None:
            return None
        if rest in ((_seqax.ARRAY, ".zattrs") if self.seqax else ("zarr.json",)):
            return Owned(key)
        codec = leaf.codec
        assert not isinstance(codec, _safetensors.TensorCodec)  # a checkpoint's leaf
        coords = codec.coords_of(rest)
        if coords is None or not all(i < n for i, n in zip(coords, _chunks.grid(leaf.shape, leaf.chunks))):
            return None
        self.found[name].add(coords)
        return Owned(key, codec.stored_bytes, codec) if isinstance(codec, _chunks.ChunkCodec) else \
            Owned(key, codec.data_bytes)

    def missing(self, present: set[str]) -> tuple[int, list[str]]:
        """How many objects the metadata records that are not in `present`, and the
        keys of the first few."""
        count, some = 0, list[str]()
        groups = [_seqax.GROUP, _seqax.MARKER] if self.seqax else ["zarr.json"]
        for name in itertools.chain([None], self.arrays, self.own):
            metadata = groups if name is None else [f"{name}/{_seqax.ARRAY if self.seqax else 'zarr.json'}"]
            lost = [key for key in metadata if key not in present]
            count += len(lost)
            some += lost[:_SHOWN - len(some)]
            if lost or name is None:  # an array's chunks cannot be counted without its metadata
                continue
            array = self._array(name)
            assert array is not None
            grid = _chunks.grid(array.shape, array.chunks)
            lacking = math.prod(grid) - len(self.found[name])
            count += lacking
            if lacking:
                codec = array.codec
                assert not isinstance(codec, _safetensors.TensorCodec)  # a checkpoint's array
                some += map(codec.key_at, first_absent(indices(grid), self.found[name], _SHOWN - len(some)))
        for leaf in self.per_process.values():  # processes whose value has no array at all
            there = _naming.processes_listed(leaf.name, leaf.processes or 0, self.own)
            absent = (leaf.processes or 0) - len(there)
            count += absent
            some += [_naming.object_key(_naming.per_process_name(leaf.name, p), "zarr.json")
                     for p in first_absent(range(leaf.processes or 0), there, _SHOWN - len(some))]
        return count, some

    def _array(self, name: str) -> _reader.StoredLeaf | None:
        """The array of that name: a leaf's, or one process's of a per-process leaf
        (read from its own `zarr.json` when first met)."""
        if (known := self.arrays.get(name) or self.own.get(name)) is not None:
            return known
        found = _naming.per_process_of(name)
        leaf = self.per_process.get(found[0]) if found else None
        if leaf is None or found is None or found[1] >= (leaf.processes or 0):
            return None
        self.own[name] = _reader.read_own_array(self.ckpt.loc, leaf, found[1])[0]
        return self.own[name]



def make_way(loc: Location, *, overwrite: bool) -> None:
    """Clears `loc` for a new checkpoint: a committed one is replaced only with
    `overwrite`, and only when `loc` holds nothing else; leftovers of a save, copy or
    deletion cut short are removed; anything that is not a checkpoint is refused
    (CheckpointExistsError naming it). Whether anything is there is asked together
    with the group metadata (one round trip, not two, before a save into a new place)."""
    found, there = _concurrency.run_all(lambda ask: ask(), (lambda: _commit.head(loc).state, loc.exists),
                                        2 if loc.requests_wait else 1)
    if found is _commit.State.COMMITTED:
        if not overwrite:
            raise CheckpointExistsError(
                f"{loc.url} already holds a committed checkpoint; pass overwrite=True to replace it")
        foreign = _foreign_beside_committed(loc)
        if foreign:
            raise CheckpointExistsError(
                f"{loc.url} holds a committed checkpoint and also {_some(foreign)}, which is not the checkpoint's; "
                "refusing to delete it: save somewhere else, or move that away first")
        _commit.remove(loc)
    elif there:
        remove_leftover(loc)


def remove_leftover(loc: Location) -> None:
    """Removes what an interrupted save or deletion left at `loc`, marker first.

    Refuses, with CheckpointExistsError, when `loc` holds anything a checkpoint would
    not, or group metadata that zarrckpt did not write: a mistyped URL must never cost
    someone their files (a zarr group of their own included).
    """
    group = _commit.read_group(loc)
    if group is not None and group.document.get("node_type", "group") != "group":  # inside a checkpoint
        raise CheckpointExistsError(f"{loc.url} is a zarr {group.document['node_type']!r:.40}, not a checkpoint; "
                                    "refusing to delete it: save somewhere else")
    if (whose := _not_a_leftover(group, _is_step(loc))) is not None:
        raise CheckpointExistsError(f"{loc.url} {whose}; refusing to delete it: save somewhere else")
    foreign = not_ours(loc, committed=False)
    if foreign:
        raise CheckpointExistsError(f"{loc.url} is not empty and not a checkpoint (it holds {_some(foreign)}); "
                                    "refusing to delete it: save somewhere else")
    _commit.remove(loc)


def not_ours(loc: Location, *, committed: bool) -> list[str]:
    """What `loc` holds that a checkpoint would not: beside a committed checkpoint's own
    objects, or in an uncommitted leftover, any name a checkpoint never has, and a
    directory where its group metadata should be (named 'zarr.json/'): such a step is
    not what it claims, and is left alone rather than half deleted."""
    misshapen = [f"{e.name}/" for e in loc.list_dir()
                 if e.name in _commit.GROUP_METADATA_FILES and e.type not in ("file", "link")]
    if committed:
        return misshapen + _foreign_beside_committed(loc)
    entries = loc.walk(empty_directories=True)
    names = [entry.name for entry in entries if entry.type != "dir"]
    step = _is_step(loc)
    theirs = _not_a_leftover(_commit.read_group(loc), step) is not None
    # seqax's names, where zarr v2 data of someone's could be: in a run's step, or beside
    # an array's metadata (a folder of numbered files has none; a copy writes it first).
    seqax = step or any(name.endswith(("/" + _seqax.ARRAY, "/" + _seqax.MARKER)) for name in names)
    foreign = [name for name in names if (theirs and name in _commit.GROUP_METADATA_FILES) or not (
        _LEFTOVER_OBJECT.fullmatch(name) or seqax and _SEQAX_LEFTOVER_OBJECT.fullmatch(name))]
    # Empty directories alone say nothing of whose they are: someone's folders, unless
    # files of a checkpoint's are beside them, or they are in a run's step (a deletion
    # of it cut short as it removed its last directories).
    ours = step or len(names) > len(foreign)
    empty = [entry.name for entry in entries if entry.type == "dir"]
    return misshapen + foreign + [f"{name}/" for name in empty if not ours or not (
        _LEFTOVER_DIRECTORY.fullmatch(name) or seqax and _SEQAX_LEFTOVER_DIRECTORY.fullmatch(name))]


def _is_step(loc: Location) -> bool:
    """Whether `loc` has the name of a run's step (what such a directory holds is a
    step's: zarrckpt's, or seqax's, whose runs zarrckpt resumes)."""
    return _naming.step_of_url(loc.url) is not None


def _not_a_leftover(group: _commit.Group | None, step: bool) -> str | None:
    """Why uncommitted group metadata `group` is not what a save, copy or deletion cut
    short leaves behind, or None where it may be (or where there is none): zarrckpt's
    `zarr.json` carries its attribute from its first write. seqax's v2 group metadata is
    a leftover in a run's `step` alone (seqax's own save cut short, a copy of zarrckpt's):
    elsewhere it cannot be told from a zarr v2 group of someone's."""
    if group is None or group.problem is not None:  # damaged metadata: judged by the names around it
        return None
    if group.zarr_format == 2:
        return None if step else ("holds an uncommitted zarr v2 group (someone's zarr data, or seqax's layout: a "
                                  "copy of one cut short, to delete yourself)")
    if not isinstance(group.attributes.get(_naming.META_ATTR), dict):
        return f"is a zarr group that zarrckpt did not write (its zarr.json has no {_naming.META_ATTR!r} attribute)"
    return None


def _foreign_beside_committed(loc: Location) -> list[str]:
    """What `loc` holds beside the committed checkpoint's own objects (a link at one of
    their keys is the checkpoint's, deleted itself, never followed), an empty directory
    included: a save leaves none."""
    entries = loc.walk(empty_directories=True)
    empty = [f"{e.name}/" for e in entries if e.type == "dir"]
    try:
        foreign = inventory(_reader.open_checkpoint(loc), [e for e in entries if e.type != "dir"]).foreign
    except CheckpointError:  # metadata too damaged to say: judge by names alone
        return empty + [e.name for e in entries if e.type != "dir" and not _CHECKPOINT_OBJECT.fullmatch(e.name)]
    return empty + [key for key in foreign if not _BESIDE_RECORDED.fullmatch(key)]


def _some(keys: list[str]) -> str:
    """`keys` for a message: each top-level entry once (a directory as 'name/')."""
    entries = sorted({key.split("/", 1)[0] + ("/" if "/" in key else "") for key in keys})
    return ", ".join(map(repr, entries[:5])) + (", ..." if len(entries) > 5 else "")
